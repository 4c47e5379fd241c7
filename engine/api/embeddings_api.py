"""POST /v1/embeddings: the request's model and dimensions decided, the job
handed to the worker (engine/core/embedding_queue.py), the answer in OpenAI's
shape. The decisions are pure; `answer_embeddings` is the thin I/O around them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from mlxd.api_errors import INVALID_REQUEST
from mlxd.config import Config
from mlxd.durations import parse_duration

from ..core.embedding_queue import EmbeddingQueue, EmbedJob, RerankJob
from ..model.errors import EngineError
from .request_schema import EmbeddingRequest


async def run_side_job(queue: EmbeddingQueue, job: EmbedJob | RerankJob, timeout_s: float, what: str) -> Any:
    """The job handed to the worker's side line and its result awaited: the
    line's refusal (busy, shutting down) or a 503 past `timeout_s`."""
    refusal = queue.offer(job)
    if refusal is not None:
        raise refusal
    try:
        return await asyncio.wait_for(asyncio.wrap_future(job.future), timeout_s)
    except asyncio.TimeoutError:
        raise EngineError(503, f"the {what} request took longer than {timeout_s:.0f}s", code="queue_timeout",
                          retry_after=5) from None


def embedding_model(config: Config, name: str) -> str:
    """The embedding model a request names (pure): an `[embeddings]` id; a
    chat model's name is a 400 that says which names embed, any other a 404."""
    if name in config.embeddings:
        return name
    names = ", ".join(sorted(config.embeddings)) or "none is configured"
    if config.resolve(name) is not None:
        raise EngineError(400, f"{name!r} is a chat model; /v1/embeddings takes an embedding model ({names})",
                          code=INVALID_REQUEST, param="model")
    raise EngineError(404, f"the embedding model {name[:100]!r} does not exist here (embedding models: {names})",
                      code="model_not_found", param="model")


def output_size(requested: int | None, native: int, trained: list[int]) -> int:
    """The vectors' size (pure): the model's own, or a smaller one it was
    trained to be cut to (`[embeddings.ID] dimensions`, Matryoshka)."""
    if requested is None or requested == native:
        return native
    allowed = sorted({d for d in trained if d < native} | {native})
    if requested not in allowed:
        raise EngineError(400, f"dimensions: this model's embeddings have {native} dimensions and cannot be cut to "
                               f"{requested} (allowed: {', '.join(map(str, allowed))})", code=INVALID_REQUEST,
                          param="dimensions")
    return requested


def cut(vectors: Any, size: int) -> Any:
    """The first `size` components (pure; numpy), made unit length again
    where the model's vectors are (OpenAI's `dimensions`); a model that does
    not normalise (no Normalize module) keeps its scale."""
    import numpy as np

    if size == vectors.shape[1]:
        return vectors
    part = vectors[:, :size]
    if not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3):
        return part
    return part / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)


def embeddings_body(vectors: Any, encoding_format: str, model: str, tokens: int) -> dict:
    """OpenAI's answer (pure): floats, or base64 of little-endian float32s."""
    import numpy as np

    if encoding_format == "base64":
        rows = [base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    else:
        rows = [[float(x) for x in v] for v in vectors.astype(np.float32)]
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row}
                                       for i, row in enumerate(rows)],
            "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def answer_embeddings(body: EmbeddingRequest, config: Config, queue: EmbeddingQueue, timeout_s: float) -> dict:
    """The request decided, computed by the worker, answered."""
    model_id = embedding_model(config, body.model)
    keep_alive = None if body.keep_alive is None else parse_duration(body.keep_alive)
    job = EmbedJob(model_id, body.inputs(), body.truncate, keep_alive)
    vectors, tokens = await run_side_job(queue, job, timeout_s, "embedding")
    size = output_size(body.dimensions, vectors.shape[1], config.embeddings[model_id].dimensions)
    return embeddings_body(cut(vectors, size), body.encoding_format, body.model, tokens)
