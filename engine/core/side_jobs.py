"""The side jobs the engine core runs between its decode steps
(engine/core/embedding_turn.py): an embedding request, several joined, a
rerank request. Each knows how to start its run on the runner, and how to
answer its client(s) when the run ends or fails; the turn steps any run a
group of forwards at a time.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..model.errors import EngineError
from ..model.rerank_decisions import RerankWork

if TYPE_CHECKING:
    from ..model.runner import ModelRunner

# The inputs a joined run of several clients' embedding requests may hold: a small request behind a large one
# waits at most one such run (~1 s on 2 CPU cores for all-MiniLM-L6-v2).
JOIN_INPUTS = 512


def tokenizer_refusal(exc: ValueError | TypeError) -> EngineError:
    """A tokenizer's refusal of an input as the 400 its client gets."""
    return EngineError(400, f"input: {exc}", code="invalid_request", param="input")


class SideRun(Protocol):
    """A request's forwards, a group at a time (engine/core/embedding_turn.py steps it)."""

    tokens: int

    def step(self) -> bool: ...


@dataclass(frozen=True)
class EmbedJob:
    """One /v1/embeddings request for the worker: its inputs as strings or token ids."""

    model_id: str
    inputs: list[str] | list[list[int]]
    truncate: bool
    keep_alive_s: float | None
    future: Future = field(default_factory=Future, compare=False)  # the vectors (numpy, n x d) and the token count
    kind = "embedding"

    def start(self, runner: ModelRunner) -> SideRun:
        """Its encoder resident (loaded when another or none is), its inputs tokenized."""
        encoder = runner.load_encoder(self.model_id)
        return encoder.start(encoder.tokenize(self.inputs, self.truncate))

    def result(self, run: Any) -> tuple[Any, int]:
        return run.vectors(), run.tokens

    def counted(self, run: Any) -> dict[str, int]:
        return {"embedding_requests": 1, "embedding_inputs": len(run.ids), "embedding_tokens": run.tokens}

    def finish(self, run: Any) -> None:
        self.future.set_result(self.result(run))

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True)
class RerankJob:
    """One /v1/rerank request for the worker: the reranker's id and the work."""

    model_id: str
    work: RerankWork
    keep_alive_s: float | None
    future: Future = field(default_factory=Future, compare=False)  # the scores (one a document) and the token count
    kind = "rerank"

    def start(self, runner: ModelRunner) -> SideRun:
        return runner.start_rerank(self.model_id, self.work)

    def result(self, run: Any) -> tuple[list[float], int]:
        return run.scores(), run.tokens

    def counted(self, run: Any) -> dict[str, int]:
        return {"rerank_requests": 1, "rerank_documents": len(self.work.documents), "rerank_tokens": run.tokens}

    def finish(self, run: Any) -> None:
        self.future.set_result(self.result(run))

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class JoinedEmbedJob:
    """Several clients' embedding requests for one model as one run: their
    inputs planned together (sorted by length, so rows of like length share
    a forward whichever request they came from), each request answered with
    its own vectors when the run ends. One whose inputs the tokenizer
    refuses is answered its 400 at the start; the others go on."""

    kind = "embedding"

    def __init__(self, parts: tuple[EmbedJob, ...]) -> None:
        self.parts = parts
        self.model_id = parts[0].model_id
        self.live: list[tuple[EmbedJob, int, int]] = []  # a part, its rows' span in the run
        # The longest keep_alive asked for holds the model; none asked: the engine's.
        asked = [p.keep_alive_s for p in parts if p.keep_alive_s is not None]
        self.keep_alive_s = max(asked) if asked else None

    def start(self, runner: ModelRunner) -> SideRun:
        encoder = runner.load_encoder(self.model_id)
        ids: list[list[int]] = []
        for part in self.parts:
            try:
                rows = encoder.tokenize(part.inputs, part.truncate)
            except EngineError as exc:
                part.fail(exc)
                continue
            except (ValueError, TypeError) as exc:
                part.fail(tokenizer_refusal(exc))
                continue
            self.live.append((part, len(ids), len(ids) + len(rows)))
            ids += rows
        if not ids:
            raise EngineError(400, "no input could be read", code="invalid_request", param="input")
        return encoder.start(ids)

    def counted(self, run: Any) -> dict[str, int]:
        return {"embedding_requests": len(self.live), "embedding_inputs": len(run.ids),
                "embedding_tokens": run.tokens}

    def finish(self, run: Any) -> None:
        vectors = run.vectors()
        for part, start, end in self.live:
            part.future.set_result((vectors[start:end], sum(len(r) for r in run.ids[start:end])))

    def fail(self, error: BaseException) -> None:
        for part in self.parts:
            part.fail(error)


SideJob = EmbedJob | RerankJob | JoinedEmbedJob
