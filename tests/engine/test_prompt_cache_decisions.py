"""The prompt cache's decisions, as tables: which entry a prompt reuses and
how deep, what leaves memory first, whether a disk entry is worth reading,
and the memory the cache may use beside a model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mlxd.engine.cache.cache_keys import continues, conversation_keys, normalize
from mlxd.engine.cache.kv_cache import needs_repack, packed_length
from mlxd.engine.cache.prompt_cache_policy import (entries_to_evict, needs_boundary_snapshot, prefill_rate_for,
                                                  worth_reading, written_to_drop)
from mlxd.engine.cache.reuse import (ApproxPolicy, Candidate, choose_reuse, common_prefix, continues_conversation, explain,
                              find_tokens, max_changed, patch_plan, supersedes, walk_changes)
from mlxd.memory_estimate import GIB, prompt_cache_budget, request_fits


def toks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def cand(ids, prompt_len=None, trimmable=True) -> Candidate:
    arr = toks(*ids)
    return Candidate(arr, len(arr) if prompt_len is None else prompt_len, trimmable)


@pytest.mark.parametrize("a, b, expected", [
    ((1, 2, 3), (1, 2, 3), 3),
    ((1, 2, 3), (1, 2, 4), 2),
    ((1, 2), (1, 2, 3, 4), 2),
    ((9,), (1,), 0),
    ((), (1, 2), 0),
])
def test_common_prefix(a, b, expected):
    assert common_prefix(toks(*a), toks(*b)) == expected


# (candidates, prompt, expected (index, tokens reused, trim, copy) or None)
REUSE_TABLE = [
    # nothing cached
    ([], (1, 2, 3), None),
    # the next turn extends the last one: all of it, in place
    ([cand((1, 2, 3))], (1, 2, 3, 4, 5), (0, 3, 0, False)),
    # the same prompt again: all but the last token (its logits start the answer)
    ([cand((1, 2, 3, 4))], (1, 2, 3, 4), (0, 3, 1, False)),
    # the answer came back rendered differently (a <think> block dropped): cut back into the
    # generated part only, in place
    ([cand((1, 2, 3, 7, 8), prompt_len=3)], (1, 2, 3, 9, 10), (0, 3, 2, False)),
    # a conversation that diverges mid-history: only the shared part, and the other branch is kept
    ([cand((1, 2, 3, 4, 5))], (1, 2, 9, 9), (0, 2, 3, True)),
    # the longest shared prefix wins
    ([cand((1, 2, 8)), cand((1, 2, 3, 4, 8))], (1, 2, 3, 4, 5), (1, 4, 1, True)),
    # a tie goes to the most recently used (later in the list)
    ([cand((1, 2, 3)), cand((1, 2, 3))], (1, 2, 3, 4), (1, 3, 0, False)),
    # a cache that cannot be trimmed: only when all of it is a prefix
    ([cand((1, 2, 3), trimmable=False)], (1, 2, 3, 4), (0, 3, 0, False)),
    ([cand((1, 2, 3, 4), trimmable=False)], (1, 2, 3, 5), None),  # never at a wrong depth
    ([cand((1, 2, 3), trimmable=False)], (1, 2, 3), None),  # would leave nothing to prefill
    ([cand((1, 2, 3, 4), trimmable=False), cand((1, 2))], (1, 2, 3, 9), (1, 2, 0, False)),
    # nothing shared
    ([cand((5, 6))], (1, 2, 3), None),
]


def test_a_prefix_shorter_than_the_minimum_is_not_reused():
    entry = [cand(tuple(range(40)))]
    assert choose_reuse(entry, toks(*range(10), 99, 98), min_tokens=8).tokens == 10
    assert choose_reuse(entry, toks(*range(10), 99, 98), min_tokens=11) is None


@pytest.mark.parametrize("candidates, prompt, expected", REUSE_TABLE)
def test_choose_reuse(candidates, prompt, expected):
    got = choose_reuse(candidates, toks(*prompt))
    assert (None if got is None else (got.index, got.tokens, got.trim, got.copy)) == expected


@pytest.mark.parametrize("sizes, budget, evicted", [
    ([], 10, 0),
    ([3, 3, 3], 9, 0),
    ([3, 3, 3], 8, 1),  # least recently used first
    ([5, 1, 1], 2, 1),  # the big old one goes, two small recent ones stay
    ([1, 1, 5], 4, 3),  # the newest alone is over the budget: everything leaves
    ([4, 4], 0, 2),
])
def test_entries_to_evict(sizes, budget, evicted):
    assert entries_to_evict(sizes, budget) == evicted


@pytest.mark.parametrize("sizes, on_disk, budget, dropped", [
    ([10, 20, 30], [True, True, True], 60, []),            # fits already
    ([10, 20, 30], [True, True, True], 35, [0, 1]),        # the least recently used first
    ([10, 20, 30], [False, True, True], 35, [1, 2]),       # one not on disk stays; later ones go instead
    ([10, 20, 30], [False, False, True], 35, [2]),
    ([10, 20, 30], [False, False, True], 25, None),        # not enough on disk: nothing dropped, nothing waited for
    ([10, 20, 30], [True, True, False], 25, None),
    ([], [], 0, []),
])
def test_written_to_drop(sizes, on_disk, budget, dropped):
    """Entries dropped without a write to wait for (a write-behind's room): only those already on disk."""
    assert written_to_drop(sizes, on_disk, budget) == dropped


GB = 10**9


@pytest.mark.parametrize("file_bytes, saved, prefill_rate, read_timed, expected", [
    (1 * GB, 8000, 2000.0, True, True),  # 0.5 s to read vs 4 s of prefill
    (1 * GB, 8000, 100_000.0, True, False),  # the prefill is faster than the read
    (1 * GB, 8000, 100_000.0, False, True),  # ...but no read timed yet: the first one is tried
    (1 * GB, 8000, None, True, True),  # prefill speed not measured yet: read (within the limits)
    (20 * GB, 10**6, 1.0, True, False),  # 10 s: over max_read_s
    (20 * GB, 10**6, 1.0, False, False),  # ...which bounds a first read too
    (9 * GB, 10**6, 1.0, True, False),  # over the memory the cache may use
])
def test_worth_reading(file_bytes, saved, prefill_rate, read_timed, expected):
    assert worth_reading(file_bytes, saved, max_bytes=8 * GB, max_read_s=5.0, read_bytes_per_s=2 * GB,
                         read_timed=read_timed, prefill_tokens_per_s=prefill_rate) is expected


@pytest.mark.parametrize("warm, fastest, first, expected", [
    (True, 18_000.0, 5_000.0, 18_000.0),  # this engine has compiled its kernels: its best speed
    (False, 18_000.0, 5_000.0, 5_000.0),  # a restarted engine: what earlier engines' first prefills cost
    (False, 18_000.0, None, 18_000.0),  # no first prefill recorded (rates from an older version)
    (False, None, None, None),  # nothing measured
])
def test_prefill_rate_for(warm, fastest, first, expected):
    assert prefill_rate_for(warm, fastest, first) == expected


@pytest.mark.parametrize("buffer_len, offset, room, shared, expected", [
    (512, 300, 100, False, False),  # whole steps, room for the turn: used as it is
    (512, 300, 300, False, True),  # no room: mlx-lm would cut it at 300 and grow an odd buffer
    (556, 300, 100, False, True),  # not whole steps (grown from an odd offset)
    (512, 300, 100, True, True),  # shared with an entry that stays: always a copy
])
def test_needs_repack(buffer_len, offset, room, shared, expected):
    assert needs_repack(buffer_len, offset, room, 256, shared) is expected


@pytest.mark.parametrize("buffer_len, offset, room, expected", [
    (15360, 14000, 1000, False),  # a coarse length (steps of 1,024 under 16k), room for the turn: as it is
    (15104, 14000, 1000, True),  # whole steps of 256 but not a coarse length: a new cuDNN graph, so packed
    (15360, 14000, 1500, True),  # no room
    (512, 300, 100, False),  # short: coarse steps are whole steps of 256
])
def test_needs_repack_in_coarse_steps(buffer_len, offset, room, expected):
    assert needs_repack(buffer_len, offset, room, 256, False, coarse=True) is expected


@pytest.mark.parametrize("offset, room, expected", [(300, 100, 512), (300, 0, 512), (256, 0, 256), (256, 1, 512),
                                                    (12_384, 396, 12_800)])
def test_packed_length(offset, room, expected):
    assert packed_length(offset, room, 256) == expected


@pytest.mark.parametrize("offset, room, expected", [(300, 100, 512), (12_384, 396, 13_312), (15_626, 2_100, 18_432)])
def test_packed_length_in_coarse_steps(offset, room, expected):
    assert packed_length(offset, room, 256, coarse=True) == expected


@pytest.mark.parametrize("kinds, trimmable, expected", [
    (["KVCache"] * 4, True, False),
    (["KVCache", "RotatingKVCache"], True, True),  # the window may wrap during the answer
    (["ArraysCache", "KVCache"], False, True),  # recurrent layers: not trimmable
])
def test_needs_boundary_snapshot(kinds, trimmable, expected):
    assert needs_boundary_snapshot(kinds, trimmable) is expected


@pytest.mark.parametrize("budget, model, configured, expected", [
    (16 * GIB, 6 * GIB, None, 5 * GIB),  # half of what the model leaves
    (16 * GIB, 6 * GIB, 2 * GIB, 2 * GIB),  # as configured
    (16 * GIB, 6 * GIB, 40 * GIB, 10 * GIB),  # never more than what is left
    (16 * GIB, 20 * GIB, None, 0),  # a model over the budget leaves nothing (and is refused anyway)
    (16 * GIB, None, None, 4 * GIB),  # unknown size: assumed to take half
])
def test_prompt_cache_budget(budget, model, configured, expected):
    assert prompt_cache_budget(budget, model, configured) == expected


# --- agent-safe keys ------------------------------------------------------------------

@pytest.mark.parametrize("rule, text, expected", [
    ("iso_timestamps", "Now: 2026-11-23T10:31:02Z.", "Now: ⟨iso_timestamps⟩."),
    ("iso_timestamps", "at 2026-11-23 10:31 and 2026-11-23T10:31:02.123+01:00", "at ⟨iso_timestamps⟩ and ⟨iso_timestamps⟩"),
    ("iso_timestamps", "version 2026.11 on 2026-11-23", "version 2026.11 on 2026-11-23"),  # a date alone is stable
    ("clock_times", "It is 9:05 PM, or 21:05:30.", "It is ⟨clock_times⟩, or ⟨clock_times⟩."),
    ("uuids", "id 123e4567-e89b-12d3-a456-426614174000 done", "id ⟨uuids⟩ done"),
    ("request_ids", "msg_01XyZabc12 and req-8f3a9b1c and call_abc123", "⟨request_ids⟩ and ⟨request_ids⟩ and ⟨request_ids⟩"),
    ("request_ids", "sha 0123456789abcdef0123 kept short: abc123", "sha ⟨request_ids⟩ kept short: abc123"),
    ("request_ids", "message_board and call_me", "message_board and call_me"),  # not ids
])
def test_normalize(rule, text, expected):
    assert normalize(text, [rule]) == expected


def test_conversation_keys_see_a_later_turn_through_a_changed_timestamp():
    def convo(ts: str, *more: dict) -> list[dict]:
        return [{"role": "system", "content": f"Agent. Time: {ts}"}, {"role": "user", "content": "go"}, *more]

    turn1 = convo("2026-11-23T10:31:02Z")
    turn2 = convo("2026-11-23T10:32:40Z", {"role": "assistant", "content": "ok"}, {"role": "user", "content": "on"})
    other = [{"role": "system", "content": "Another agent."}, {"role": "user", "content": "go"}]
    on = ["iso_timestamps"]
    assert continues(conversation_keys(turn1, None, on), conversation_keys(turn2, None, on))
    assert not continues(conversation_keys(turn1, None, []), conversation_keys(turn2, None, []))  # off: no keys
    assert not continues(conversation_keys(turn1, None, on), conversation_keys(other, None, on))
    assert not continues(conversation_keys(turn2, None, on), conversation_keys(turn1, None, on))  # not backwards
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert not continues(conversation_keys(turn1, None, on), conversation_keys(turn2, tools, on))  # other tools


@pytest.mark.parametrize("budget, weights, need, cached, expected", [
    (16 * GIB, 8 * GIB, 2 * GIB, 1 * GIB, (True, 1 * GIB)),  # room for both
    (16 * GIB, 8 * GIB, 6 * GIB, 5 * GIB, (True, 2 * GIB)),  # the cache gives way first
    (16 * GIB, 8 * GIB, 8 * GIB, 5 * GIB, (True, 0)),  # all of it
    (16 * GIB, 8 * GIB, 9 * GIB, 0, (False, 0)),  # the request alone does not fit: refused
])
def test_request_fits(budget, weights, need, cached, expected):
    assert request_fits(budget, weights, need, cached) == expected


def entry(ids, trimmable=True, conversation=()):
    return SimpleNamespace(tokens=toks(*ids), trimmable=trimmable, conversation=tuple(conversation))


@pytest.mark.parametrize("new, old, expected", [
    (entry((1, 2, 3, 4)), entry((1, 2, 3)), True),  # a prefix of a trimmable newer entry
    (entry((1, 2, 3, 4), trimmable=False), entry((1, 2, 3)), False),  # the newer one cannot be cut back to it
    (entry((1, 2, 3)), entry((1, 2, 9)), False),  # a branch
    (entry((1, 2, 3)), entry((1, 2, 3, 4)), False),  # longer than the new one
    (entry((1, 5), conversation=("a", "b")), entry((1, 2), conversation=("a",)), True),  # an earlier turn
    (entry((1, 5), conversation=("a", "b")), entry((1, 2), conversation=("c",)), False),
])
def test_supersedes(new, old, expected):
    assert supersedes(new, old) is expected


# --- a turn's plan: same conversation or a branch, approximate reuse, why it stopped ---

def test_a_turn_of_the_same_conversation_continues_its_entry_in_place():
    entry = cand((1, 2, 3, 4, 7, 8), prompt_len=4)  # prompt 1-4, answer 7 8
    assert continues_conversation(entry, toks(1, 2, 3, 4, 7, 8, 9)) is True  # the answer came back, a new message
    assert continues_conversation(entry, toks(1, 2, 3, 4)) is True  # the same prompt again


# (entry tokens, its prompt_len, prompt, generation prompt tokens, continues?)
CONTINUES_TABLE = [
    # a reasoning template renders the answer without its think block, and its generation prompt differs from
    # history: all client tokens but the generation prompt match
    ((1, 2, 3, 50, 51, 60, 61), 5, (1, 2, 3, 70, 71, 72), 2, True),
    # ...but without knowing the generation prompt's length it is a branch
    ((1, 2, 3, 50, 51, 60, 61), 5, (1, 2, 3, 70, 71, 72), 0, False),
    # a clock changed inside the system prompt, aligned, and the earlier answer came back after it
    ((1, 2, 9, 9, 5, 6, 7, 8, 20, 21, 22, 23), 8, (1, 2, 8, 8, 5, 6, 7, 8, 20, 21, 22, 23, 30), 0, True),
    # two sub-agents whose prompts differ in a few tokens: the other's answer is not in the prompt
    ((1, 2, 9, 9, 5, 6, 7, 8, 20, 21, 22, 23), 8, (1, 2, 8, 8, 5, 6, 7, 8, 40, 41, 42, 43, 30), 0, False),
    # a shorter prompt than the entry's: never a later turn
    ((1, 2, 3, 4, 5), 5, (1, 2, 3), 0, False),
]


@pytest.mark.parametrize("tokens, prompt_len, prompt, gen, expected", CONTINUES_TABLE)
def test_continues_conversation(tokens, prompt_len, prompt, gen, expected):
    assert continues_conversation(cand(tokens, prompt_len), toks(*prompt), gen) is expected


def test_too_many_changed_tokens_is_another_conversation():
    base = list(range(100, 200))
    other = [t + 1000 if i % 5 == 0 else t for i, t in enumerate(base)]  # 20 of 100 changed
    entry = cand(base + [7, 8], prompt_len=100)
    assert max_changed(100) < 20
    assert continues_conversation(entry, toks(*other, 7, 8, 9)) is False


def test_patch_plan_recomputes_a_changed_span_and_keeps_the_rest():
    cached = toks(*range(100))
    prompt = cached.copy()
    prompt[40:43] = [900, 901, 902]  # a clock's digits
    end, spans = patch_plan(cached, np.concatenate([prompt, toks(5, 6)]), 101, ApproxPolicy(recompute_after=2))
    assert (end, spans) == (100, ((40, 45),))


def test_patch_plan_stops_where_a_change_of_length_shifts_everything_after_it():
    cached = toks(*range(100))
    prompt = np.concatenate([cached[:40], toks(900), cached[40:]])  # one token inserted
    end, spans = patch_plan(cached, prompt, len(prompt) - 1, ApproxPolicy())
    assert (end, spans) == (40, ())  # the exact prefix: recomputing the shifted rest would save nothing


def test_patch_plan_takes_close_changes_as_one_span_and_bounds_the_share():
    cached = toks(*range(200))
    prompt = cached.copy()
    prompt[[50, 53, 56]] = 999  # within MERGE_GAP: one span
    prompt[150] = 999
    end, spans = patch_plan(cached, prompt, 199, ApproxPolicy(recompute_after=0))
    assert (end, spans) == (199, ((50, 57), (150, 151)))
    end, _ = patch_plan(cached, prompt, 199, ApproxPolicy(max_changed_share=0.01, recompute_after=0))
    assert end == 50  # over the share: exact reuse only


def test_choose_reuse_with_approximate_reuse():
    entry = Candidate(toks(*range(100), 500, 501), 100, True, patchable=True)  # prompt 0..99, answer 500 501
    prompt = toks(*range(100), 500, 501, 600, 601)  # the next turn: the answer came back, a new message
    prompt[10] = 999  # ...and a clock moved on
    exact = choose_reuse([entry], prompt)
    assert (exact.tokens, exact.patches, exact.reused, exact.copy) == (10, (), 10, False)
    approx = choose_reuse([entry], prompt, approximate=ApproxPolicy(recompute_after=4))
    assert (approx.tokens, approx.patches, approx.reused, approx.exact) == (102, ((10, 15),), 97, 10)
    # an entry whose layers cannot be patched (a rotating or quantised cache) is reused exactly
    not_patchable = Candidate(entry.tokens, 100, True, patchable=False)
    assert choose_reuse([not_patchable], prompt, approximate=ApproxPolicy()).tokens == 10
    # another conversation that differs in a few tokens (another sub-agent's task): exact reuse only
    other = toks(*range(100), 700, 701, 600, 601)
    other[10] = 999
    branch = choose_reuse([entry], other, approximate=ApproxPolicy())
    assert (branch.tokens, branch.patches, branch.copy) == (10, (), True)


@pytest.mark.parametrize("entry, prompt, expected", [
    (None, (1, 2, 3), (0, "nothing cached")),
    (cand((1, 2, 3, 4, 5)), (1, 2, 3, 4, 5, 6), (None, "all but the last")),
    (cand((1, 2, 3)), (1, 2, 3, 4, 5, 6), (3, "ends at token 3")),
    (cand((1, 2, 3, 7, 8), prompt_len=3), (1, 2, 3, 9, 9, 9), (3, "answer came back different")),
    (cand((1, 2, 3, 4, 5)), (1, 2, 9, 4, 5, 6), (2, "prompt differs from the cached conversation at token 2")),
])
def test_explain_says_where_and_why_reuse_stopped(entry, prompt, expected):
    reuse = choose_reuse([entry] if entry else [], toks(*prompt))
    stopped, why = explain(reuse, entry, len(prompt), 0)
    assert stopped == expected[0] and expected[1] in why


@pytest.mark.parametrize("a, b, budget, expected", [
    (range(20), range(20), 4, (0, 20)),  # the same
    (range(20), [*range(20), 50, 51], 4, (0, 20)),  # b goes on after a
    # a clock's digits changed, same length
    (range(20), [*range(5), 90, 91, *range(7, 20)], 4, (2, 20)),
    # ...a token longer (9:59 -> 10:00): a's end falls one token later in b
    (range(20), [*range(5), 90, 91, 92, *range(7, 20)], 4, (3, 21)),
    # ...a token shorter
    (range(20), [*range(5), 90, *range(7, 20)], 4, (2, 19)),
    # two changes, within the budget and over it
    (range(30), [*range(5), 90, *range(6, 20), 91, *range(21, 30)], 4, (2, 30)),
    (range(30), [*range(5), 90, *range(6, 20), 91, *range(21, 30)], 1, None),
    # another text altogether: no point where they agree again
    (range(20), range(100, 130), 16, None),
])
def test_walk_changes(a, b, budget, expected):
    assert walk_changes(toks(*a), toks(*b), budget) == expected


def test_a_changed_value_of_another_length_still_continues_the_conversation():
    entry = cand((*range(10), 7, 8), prompt_len=10)  # prompt 0..9, answer 7 8
    assert continues_conversation(entry, toks(0, 1, 2, 90, 91, 5, 6, 7, 8, 9, 7, 8, 40)) is True  # 3 4 -> 90 91
    assert continues_conversation(entry, toks(*range(30, 40), 7, 8)) is False
    base = toks(*range(100, 130))
    entry = Candidate(np.concatenate([base, toks(7, 8)]), 30, True)
    longer = np.concatenate([base[:10], toks(1, 2), base[11:], toks(7, 8, 9)])  # one token became two
    assert continues_conversation(entry, longer) is True


def test_an_edit_too_large_to_walk_past_still_continues_when_the_last_message_and_answer_follow():
    history = toks(*range(100, 400))  # an old tool result at 150..250
    entry = Candidate(np.concatenate([history, toks(7, 8, 9, 10)]), 300, True, echo=(7, 8, 9, 10))
    cleared = np.concatenate([history[:50], toks(1, 2, 3), history[150:], toks(7, 8, 9, 10, 11)])
    assert walk_changes(history, cleared, max_changed(300)) is None  # 100 tokens became 3
    assert continues_conversation(entry, cleared) is True
    # Another conversation that shares the start but not the entry's last message and answer: a branch.
    other = np.concatenate([history[:50], toks(1, 2, 3), toks(*range(500, 700)), toks(7, 8, 9, 10)])
    assert continues_conversation(entry, other) is False
    # ...and one that holds the entry's last message but another answer: a branch too.
    assert continues_conversation(entry, np.concatenate([cleared[:-5], toks(70, 80, 90, 100)])) is False


@pytest.mark.parametrize("hay, needle, expected", [
    ((1, 2, 3, 4, 5), (3, 4), 2),
    ((1, 2, 3, 4, 5), (4, 3), -1),
    ((1, 2, 3), (1, 2, 3, 4), -1),
    ((256, 0), (1,), -1),  # whole tokens only: 256 then 0 holds the bytes of 1 at an odd offset
    ((256, 0, 1), (1,), 2),
])
def test_find_tokens(hay, needle, expected):
    assert find_tokens(toks(*hay), toks(*needle)) == expected


def test_the_walk_past_changes_is_bounded():
    """A turn may change at most MAX_CHANGED tokens, however long its prompt:
    the walk (run per cached entry, per request) stays cheap."""
    assert max_changed(100) == 16 and max_changed(2000) == 40 and max_changed(100_000) == 64
    base = np.arange(10_000, dtype=np.int32)
    changed = base.copy()
    changed[::100] += 20_000  # 100 changes
    assert walk_changes(base, changed, max_changed(10_000)) is None
    assert walk_changes(base, changed, 100) == (100, 10_000)
