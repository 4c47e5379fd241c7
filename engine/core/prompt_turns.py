"""A request's turn through the prompt cache (engine/cache/prompt_cache.py),
for the core: one owner, `PromptTurns`, of what a turn takes from the cache
and gives back.

At admission its cached prefix is fetched; once its first token is out its
prompt's KV goes to disk (a checkpoint, written behind), so a crash before
the answer's end costs at most the answer; its answer's end is held until
that write lands (bounded; held_answers.py, never waited for under a step);
at its end its KV goes back to the cache.
"""

from __future__ import annotations

import logging
from typing import Any

from ..cache.prompt_cache import PromptCache, kv_offset
from ..cache.prompt_cache_policy import Fetched
from ..model.decoder_rows import Admitted
from ..model.job import Job
from ..model.runner import ModelRunner

log = logging.getLogger("mlxd.engine.core.worker")


class PromptTurns:
    def __init__(self, runner: ModelRunner, cache: PromptCache) -> None:
        self.runner = runner
        self.cache = cache  # the core's, replaced with it (EngineCore.use_prompt_cache)

    def fetch(self, job: Job, tokens: list[int], max_tokens: int, request_bytes: int) -> Fetched:
        """The prompt's cached prefix (`max_tokens`: what its KV is allocated for beyond the prompt, decoded alone)."""
        fetched = self.cache.fetch(tokens, max_tokens, request_bytes)
        if fetched.excerpt is not None and log.isEnabledFor(logging.DEBUG):
            # What the prompt and the cached conversation hold where reuse stopped: which agent field broke it.
            cached, sent = self.runner.describe_reuse(*fetched.excerpt)
            log.debug("prompt cache: request %s (conversation %s) reused %d tokens; where it stopped the cache "
                      "holds %r and the prompt has %r", job.id, fetched.name, fetched.cached_tokens, cached, sent)
        return fetched

    def checkpoint(self, rows: list[Admitted]) -> None:
        """Prompts prefilled whose first token is out: their KV to disk now
        (its new blocks, copied; written behind), so a crash before the
        answer's end costs at most the answer (engine/cache/prompt_cache.py)."""
        for a in rows:
            if a.prefilled is not None and a.first_token_at is not None:
                a.checkpoint = self.save_progress(a, *self._prefill_done(a))

    def save_progress(self, a: Admitted, kv: list[Any], covered: int) -> Any:
        """A prompt's KV so far, to disk (also runner.save_progress, every
        CHECKPOINT_TOKENS of a long prefill): the prompt cache's write, or None."""
        if a.needs_snapshot or self.runner.plan is None or not self.runner.plan.prompt_cache:
            return None
        return self.cache.checkpoint(a.prompt[:covered], kv, a.job.conversation, prefilled=covered - a.fetched.start)

    @staticmethod
    def take_checkpoint(a: Admitted) -> Any:
        """Its prompt's write (None: none), for its answer's end to wait for (held_answers.py)."""
        writing, a.checkpoint = a.checkpoint, None
        return writing

    def store(self, a: Admitted, kv: list[Any] | None) -> None:
        """The turn's KV back to the prompt cache: at the prompt's boundary
        (its snapshot) where it cannot be cut back, else all it covers, fitted
        to its length by the cache (engine/cache/prompt_cache.py)."""
        cache = self.cache
        if not cache.enabled:
            return
        job, prompt, fetched, generated = a.job, a.prompt, a.fetched, a.generation.tokens
        if a.prefilled is not None and a.first_token_at is not None:  # it ended at its first token
            self._prefill_done(a)
        echo = self.runner.echo(generated)
        if a.needs_snapshot:
            if a.snapshot is not None:
                cache.store(prompt[:-1], len(prompt) - 1, a.snapshot, job.conversation, fetched, echo)
        elif kv is not None:
            cache.store((prompt + generated)[:kv_offset(kv) or 0], len(prompt), kv, job.conversation, fetched, echo,
                        fit=True)

    def _prefill_done(self, a: Admitted) -> tuple[list[Any], int]:
        """A row's prefill, taken once its first token is out: its speed to
        the prompt cache's disk-read decision, and (KV, tokens covered)."""
        assert a.prefilled is not None and a.first_token_at is not None
        prefilled, a.prefilled = a.prefilled, None
        recomputed = sum(end - start for start, end in a.fetched.patches)
        self.cache.note_prefill(len(a.prompt) - a.fetched.start + recomputed, a.first_token_at - a.admitted_at)
        return prefilled
