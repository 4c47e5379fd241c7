"""POST /v1/rerank (also /rerank and /v2/rerank): the request's reranker
decided, the job handed to the worker (engine/core/embedding_queue.py, the
embedding requests' line), the answer in the shape Cohere's and Jina's
clients read (`results` sorted by `relevance_score`, `meta`, and vLLM's
`usage`). The decisions are pure; `answer_rerank` is the thin I/O around
them.
"""

from __future__ import annotations

import uuid

from mlxd.api_errors import INVALID_REQUEST
from mlxd.config import Config
from mlxd.durations import parse_duration

from ..core.embedding_queue import EmbeddingQueue, RerankJob
from ..model.errors import EngineError
from ..model.rerank_decisions import RerankWork, ranked
from .embeddings_api import run_side_job
from .request_schema import RerankRequest


def reranker_for(config: Config, name: str) -> str:
    """The reranker a request names (pure): a `[rerankers]` id; a chat or
    embedding model's name is a 400 that says which names rerank, any other
    a 404."""
    if name in config.rerankers:
        return name
    names = ", ".join(sorted(config.rerankers)) or "none is configured"
    kind = "an embedding model" if name in config.embeddings else \
        "a chat model" if config.resolve(name) is not None else None
    if kind is not None:
        raise EngineError(400, f"{name!r} is {kind}; /v1/rerank takes a reranker ({names}); `[rerankers.ID] "
                               f"{'embedding' if kind == 'an embedding model' else 'chat_model'} = {name!r}` makes "
                               "one of it", code=INVALID_REQUEST, param="model")
    raise EngineError(404, f"the reranker {name[:100]!r} does not exist here (rerankers: {names})",
                      code="model_not_found", param="model")


def rerank_body(scores: list[float], body: RerankRequest, texts: list[str], tokens: int) -> dict:
    """The answer (pure): the best `top_n` documents, best first."""
    results = []
    for i in ranked(scores, body.top_n):
        result: dict = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model, "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": tokens, "output_tokens": 0}},
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def answer_rerank(body: RerankRequest, config: Config, queue: EmbeddingQueue, timeout_s: float) -> dict:
    """The request decided, scored by the worker, answered."""
    reranker_id = reranker_for(config, body.model)
    keep_alive = None if body.keep_alive is None else parse_duration(body.keep_alive)
    texts = body.texts()
    work = RerankWork(body.query, texts, body.max_tokens_per_doc, body.instruction)
    scores, tokens = await run_side_job(queue, RerankJob(reranker_id, work, keep_alive), timeout_s, "rerank")
    return rerank_body(scores, body, texts, tokens)
