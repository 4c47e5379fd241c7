"""An embedding or rerank request's turn between the core's steps
(engine/core/embedding_queue.py holds the line): one owner, `EmbeddingTurn`,
of the request under way.

An encoder's forward takes milliseconds, so a running answer waits one group
of an embedding request's forwards between two of its tokens, never a whole
request; with no chat work, the groups run one after another. The encoder
is loaded beside the chat model (one at a time); its idle time counts as the
model's (keep_alive).
"""

from __future__ import annotations

from typing import Any, Callable

from ..model.errors import EngineError
from ..model.runner import ModelRunner, NeedsModel
from .embedding_queue import EmbeddingQueue, SideJob
from .side_jobs import tokenizer_refusal


def mlx_fault(exc: BaseException) -> EngineError:
    return EngineError(500, f"MLX error: {exc}; the engine is restarting", code="mlx_error", retry_after=5)


class EmbeddingTurn:
    def __init__(self, queue: EmbeddingQueue | None, runner: ModelRunner, counters: dict[str, int],
                 progress: Callable[[], None], served: Callable[[float | None], None],
                 fatal: Callable[[BaseException], None], make_resident: Callable[[str], None]) -> None:
        self.queue = queue
        self.runner = runner
        self.counters = counters
        self.progress = progress  # the core's heartbeat: a long request's forwards are no hang
        self.served = served  # the model's idle time starts again (keep_alive: the request's own, or None)
        self.fatal = fatal  # an MLX fault: the core fails everything and the engine exits
        self.make_resident = make_resident  # the core's load of a chat model (a chat-model reranker's)
        self.under_way: tuple[SideJob, Any] | None = None  # the request and its forwards
        self._last = False  # the last step was an embedding's: the next one is the scheduler's

    def take(self, chat_work: bool) -> bool:
        """Whether this step is an embedding request's (and it ran): one is
        under way or waiting, and the last step was the scheduler's or it has
        nothing to do (`chat_work`: a chat request taken, running or waiting)."""
        if self.queue is None or (self.under_way is None and not self.queue.has_waiting()):
            return False
        if chat_work and self._last:
            self._last = False
            return False
        self._last = True
        if self.under_way is None:
            job = self.queue.take()
            if job is None:
                return False
            if not self._start(job, chat_work):
                self._last = False
                return False
        if self.under_way is not None:
            self._advance()
        return True

    def fail(self, error: EngineError) -> None:
        """The request under way told `error` (the engine is going down)."""
        if self.under_way is not None:
            self.under_way[0].fail(error)
        self.under_way = None

    def _start(self, job: SideJob, chat_work: bool) -> bool:
        """Its model resident (loaded when another or none is) and its inputs
        tokenized; a refusal goes to its future. False: it waits at the head
        of the line for the running answers to end (a chat-model reranker's
        model to load)."""
        try:
            try:
                self.under_way = (job, job.start(self.runner))
            except NeedsModel as need:
                if chat_work:
                    self.queue.put_back(job)  # type: ignore[union-attr]
                    return False
                self.make_resident(need.model_id)
                self.under_way = (job, job.start(self.runner))
        except EngineError as exc:
            job.fail(exc)
        except (ValueError, TypeError) as exc:
            job.fail(tokenizer_refusal(exc))
        except BaseException as exc:  # noqa: BLE001 - an MLX fault in the load: do not limp on
            self._fault(job, exc)
        return True

    def _advance(self) -> None:
        """The request's next group of forwards; its vectors to its future once done."""
        job, run = self.under_way  # type: ignore[misc]
        try:
            done = run.step()
        except EngineError as exc:
            self.under_way = None
            job.fail(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - an MLX fault: do not limp on
            self.under_way = None
            self._fault(job, exc)
            return
        self.progress()
        if not done:
            return
        self.under_way = None
        for key, value in job.counted(run).items():
            self.counters[key] += value
        self.served(job.keep_alive_s)
        job.finish(run)

    def _fault(self, job: SideJob, exc: BaseException) -> None:
        job.fail(mlx_fault(exc))
        self.fatal(exc)
