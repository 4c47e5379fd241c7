"""What a row of the batch proposes for a verify step (engine/model/row_batch.py):
speculative decoding as a per-row part of the one step, not a loop of its own.

A row that speculates has a proposer; each step the batch asks it whether a
verify is worth taking (`worth_verify`, judged on the tokens known: the row's
next token is still being computed), and in a verify step, with that token
known, what to propose (`propose`); the batch runs every row's token and its
proposals in one forward, keeps what the model agrees with, and tells the
proposer (`verified`), or, in a plain step, the token decoded (`plain`).

- `LookupProposer`: prompt lookup (engine/model/speculative.py): the row's
  n-gram index proposes what followed its last tokens earlier in its
  context, the tokens a grammar forces first; its DraftPolicy says how many
  are worth a verify, none where copying does not pay.
- `DraftProposer`: a draft model (engine/model/draft_model.py) proposes its
  greedy continuation, k forwards of the small model over the row's draft
  KV. The draft's KV is one allowance in the model's memory estimate: one
  row at a time holds it (DraftModel.take), the others decode plain.

Either way the tokens kept are the model's own: greedy, the longest prefix
it would have chosen; sampled, the speculative acceptance rule for a
proposal made for sure (speculative.accept_sampled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from .speculative import DraftPolicy, NgramIndex, SpecStats

if TYPE_CHECKING:
    from .constrained import GrammarProcessor
    from .draft_model import DraftModel


class Proposer(Protocol):
    stats: SpecStats

    def worth_verify(self, room: int) -> bool: ...

    def propose(self, last: int, joining: bool, room: int) -> list[int]: ...

    def verified(self, proposed: list[int], kept: list[int], seconds: float) -> None: ...

    def plain(self, token: int, joining: bool, seconds: float) -> None: ...

    def ended(self) -> None: ...


class LookupProposer:
    """Prompt lookup for one row: its prompt and answer's n-grams."""

    def __init__(self, tokens: list[int], grammar: GrammarProcessor | None = None) -> None:
        self.index = NgramIndex(tokens)  # the row's context and its next input (the prompt's last token)
        self.policy = DraftPolicy()
        self.stats = SpecStats()
        self.grammar = grammar  # its forced tokens are proposed first (a JSON key, a closing quote)

    def worth_verify(self, room: int) -> bool:
        at_hand = self.index.propose(1 + room)  # the first stands for the token being computed
        return len(at_hand) > 1 and self.policy.next_k(len(at_hand) - 1) > 0

    def propose(self, last: int, joining: bool, room: int) -> list[int]:
        if not joining:
            self.index.extend([last])  # its answer's newest token (a joining row's prompt already has it)
        forced = self.grammar.forced(room) if self.grammar is not None else []
        at_hand = forced or self.index.propose(room)
        if forced and self.policy.pays_for_certain(len(forced)):
            return at_hand
        return at_hand[:self.policy.next_k(len(at_hand))]

    def verified(self, proposed: list[int], kept: list[int], seconds: float) -> None:
        self.stats.forwards += 1
        self.stats.proposed += len(proposed)
        self.stats.accepted += len(kept)
        if proposed:
            self.policy.saw_verify(len(proposed), len(kept), seconds)
        self.index.extend(kept)

    def plain(self, token: int, joining: bool, seconds: float) -> None:
        self.policy.saw_step(seconds)
        self.stats.forwards += 1
        if joining:  # its prompt's last token: in the index already
            return
        shadow = self.index.propose(1)  # would the index have guessed it: the policy learns where copying is
        if shadow:
            self.policy.saw_shadow(shadow[0] == token)
        self.index.extend([token])

    def ended(self) -> None:
        pass


class DraftProposer:
    """A draft model's proposals for one row, over the draft's KV (`kv`
    holds `tokens`; `behind`: tokens the row's model has run that the
    draft has not yet)."""

    def __init__(self, draft: DraftModel, kv: list[Any], tokens: list[int], draft_tokens: int) -> None:
        self.draft = draft
        self.kv = kv
        self.tokens = list(tokens)
        self.draft_tokens = draft_tokens
        self.behind: list[int] = []
        self.stats = SpecStats(mode="draft")
        self._fed = 0  # proposals run through the draft in the last propose (their KV is in `kv`)

    def worth_verify(self, room: int) -> bool:
        return room >= 1  # as mlx-lm's speculative_generate_step: a draft proposes every step

    def propose(self, last: int, joining: bool, room: int) -> list[int]:
        k = min(self.draft_tokens, room)
        if k < 1:
            self.behind.append(last)
            self._fed = 0
            return []
        model = self.draft.model
        inputs = [*self.behind, last]
        y = model(mx.array([inputs], dtype=mx.int32), cache=self.kv)[:, -1, :].argmax(axis=-1)
        drafted = [y]
        for _ in range(k - 1):  # lazily: the k forwards are one graph, read once
            y = model(y[:, None], cache=self.kv)[:, -1, :].argmax(axis=-1)
            drafted.append(y)
        proposed = mx.concatenate(drafted).tolist()
        self.tokens += inputs + proposed[:-1]
        self.behind, self._fed = [], k - 1
        return proposed

    def verified(self, proposed: list[int], kept: list[int], seconds: float) -> None:
        self.stats.forwards += 1
        self.stats.proposed += len(proposed)
        self.stats.accepted += len(kept)
        if not proposed:  # nothing run through the draft (its `behind` has the row's token)
            return
        held = min(len(kept), self._fed)  # the draft's KV has the first k-1 proposals: those kept stay
        if self._fed > held:
            trim_prompt_cache(self.kv, self._fed - held)
            del self.tokens[len(self.tokens) - (self._fed - held):]
        self.behind = list(kept[self._fed:])  # all k kept: the last is not in the draft's KV yet
        self._fed = 0

    def plain(self, token: int, joining: bool, seconds: float) -> None:
        self.stats.forwards += 1
        self.behind.append(token)  # run through the row's model this step, not the draft

    def ended(self) -> None:
        self.draft.put_back(self.kv, self.tokens)  # for the next request's common prefix
