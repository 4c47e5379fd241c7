"""The prompt cache in a real engine process: multi-turn reuse with exact
token counts, branches, models kept apart, the byte budget and its eviction
order, and the disk tier across kill -9, corrupt files and interrupted
writes. Token counts come from the demo model's own tokenizer."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from mlxd.engine.core.held_answers import CHECKPOINT_WAIT_S
from mlxd.toml_text import dumps
from testkit import common_prefix, engine_in, prompt_ids, real_default_model, settled_health, wait_until

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a careful assistant for the mlxd project. " * 30  # ~300 tokens


def toml(models, cache: dict | None = None, engine: dict | None = None) -> str:
    """demo-a and demo-b; `cache`: [engine.prompt_cache] settings, `engine`: more [engine] ones."""
    return dumps({"embeddings": {},  # no encoder's weights beside the model: the memory tests' budgets are exact
                  "engine": {"max_tokens_cap": 64, "batching": "always", **(engine or {}), "prompt_cache": cache or {}},
                  "models": {"demo-a": {"path": models.a}, "demo-b": {"path": models.b}},
                  "aliases": {"default": "demo-a"}})


def ask(url: str, messages: list[dict], model: str = "demo-a", max_tokens: int = 6, stream: bool = False):
    """(reply text, usage) of a greedy chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        b = r.json()
        return b["choices"][0]["message"]["content"], b["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    text.append(c["delta"].get("content") or "")
    return "".join(text), usage


def cache_stats(url: str) -> dict:
    return settled_health(url)["prompt_cache"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_each_turn_reuses_the_conversation_so_far(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models, {"disk": False}))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    reply, usage = ask(ep.url, messages)
    assert cached(usage) == 0 and usage["prompt_tokens"] == len(prompt_ids(tokenizer, messages))
    for turn in range(2, 5):
        previous = prompt_ids(tokenizer, messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"question {turn}"}]
        reply, usage = ask(ep.url, messages, stream=turn % 2 == 0)  # streamed usage carries it too
        now = prompt_ids(tokenizer, messages)
        # At least the whole previous prompt; at most all but the last token (it starts the answer).
        assert len(previous) <= cached(usage) <= len(now) - 1, (turn, usage)
        assert cached(usage) >= 0.9 * len(now)
    stats = cache_stats(ep.url)
    assert stats["hits"] == 3 and stats["requests"] == 4 and stats["memory_entries"] == 1
    assert 0 < stats["memory_bytes"] <= stats["memory_budget_bytes"]


def test_a_branch_reuses_only_the_shared_part_and_keeps_the_other(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models, {"disk": False}))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "plan the release"},
               {"role": "assistant", "content": "first we test"}]
    a = history + [{"role": "user", "content": "then what about the docs"}]
    b = history[:2] + [{"role": "assistant", "content": "we could ship today"},
                       {"role": "user", "content": "no"}]
    ask(ep.url, a)
    _, usage_b = ask(ep.url, b)
    assert cached(usage_b) == common_prefix(prompt_ids(tokenizer, a), prompt_ids(tokenizer, b))
    assert 300 < cached(usage_b) < usage_b["prompt_tokens"] - 5
    # The branch a came from is still there: a's next turn reuses all of a.
    _, usage_a = ask(ep.url, a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    assert cached(usage_a) >= len(prompt_ids(tokenizer, a))


def test_models_never_share_entries(start_engine, demo_models):
    ep = start_engine(toml=toml(demo_models))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "same words"}]
    _, first = ask(ep.url, messages, model="demo-a")
    _, other = ask(ep.url, messages, model="demo-b")  # same tokenizer, same prompt, other weights
    assert cached(first) == 0 and cached(other) == 0
    stats = cache_stats(ep.url)
    assert stats["model"].startswith("demo-b@") and stats["memory_entries"] == 1  # the swap dropped demo-a's
    _, back = ask(ep.url, messages, model="demo-a")  # from disk, where the swap put it
    assert cached(back) > 0 and cache_stats(ep.url)["disk_hits"] == 1


def test_the_byte_budget_holds_and_evicts_least_recently_used_first(start_engine, demo_models):
    # demo-a holds 4 KiB of KV a token, in 1 MiB steps of 256 tokens: these ~700-token
    # conversations take 3 MiB each, so 7.5 MiB keeps two of them.
    ep = start_engine(toml=toml(demo_models, {"disk": False, "memory_gib": 0.0073}))
    budget = cache_stats(ep.url)["memory_budget_bytes"]
    assert budget == int(0.0073 * 2**30)

    def conv(name: str) -> list[dict]:
        return [{"role": "system", "content": f"{name}: " + SYSTEM[:1200]}, {"role": "user", "content": name}]

    seen = []
    for name in ("alpha", "beta", "gamma"):
        ask(ep.url, conv(name))
        seen.append(cache_stats(ep.url))
    assert [s["memory_entries"] for s in seen] == [1, 2, 2] and seen[-1]["evictions"] == 1
    assert all(s["memory_bytes"] <= budget for s in seen)
    # alpha was the least recently used, so it left; beta and gamma are still there.
    assert cached(ask(ep.url, conv("beta"))[1]) > 0
    assert cached(ask(ep.url, conv("alpha"))[1]) == 0  # gamma leaves now (beta was used since)
    assert cached(ask(ep.url, conv("beta"))[1]) > 0
    assert cached(ask(ep.url, conv("gamma"))[1]) == 0
    # Three conversations interleaving over a longer run: the budget always holds.
    for turn in range(6):
        ask(ep.url, conv(("alpha", "beta", "gamma")[turn % 3]))
        assert cache_stats(ep.url)["memory_bytes"] <= budget


def test_agent_safe_keys_keep_one_entry_per_conversation_and_reuse_only_real_matches(start_engine, demo_models,
                                                                                     tokenizer):
    def turn(ts: str, *more: dict) -> list[dict]:
        return [{"role": "system", "content": SYSTEM + f"\nCurrent time: {ts}"}, {"role": "user", "content": "go"},
                *more]

    for rules in ({}, {"normalize": ["iso_timestamps"]}):
        ep = start_engine(toml=toml(demo_models, {"disk": False, **rules}))
        first = turn("2026-11-23T10:31:02Z")
        reply, _ = ask(ep.url, first)
        second = turn("2026-11-23T10:32:15Z", {"role": "assistant", "content": reply}, {"role": "user", "content": "on"})
        _, usage = ask(ep.url, second)
        # The model saw the new time: the reuse stops at the first token that differs, rule or not.
        assert cached(usage) == common_prefix(prompt_ids(tokenizer, first), prompt_ids(tokenizer, second)) > 300
        stats = cache_stats(ep.url)
        # Turn 2 continues turn 1's conversation (a value changed, the answer came back) and replaces its
        # entry, with the rule or without it.
        assert stats["memory_entries"] == 1 and stats["superseded"] == 1


def test_a_request_whose_kv_cannot_fit_is_refused_and_the_cache_gives_way_first(start_engine, demo_models):
    from mlxd.memory_estimate import read_weight_bytes

    weights, _ = read_weight_bytes(demo_models.a)
    # A memory budget (75 % of this "machine") of the weights + 3 MiB: demo-a's KV takes 4 KiB a
    # token, so a request of up to ~760 tokens (prompt + max_tokens) fits beside the model.
    total = int((weights + 3 * 2**20) / 0.75) + 1
    ep = start_engine(toml=toml(demo_models, {"disk": False, "memory_gib": 1}, engine={"context_tokens": 128}),
                      env={"MLXD_MEMORY_TOTAL_BYTES": str(total)})
    short = [{"role": "system", "content": SYSTEM[:500]}, {"role": "user", "content": "short"}]
    ask(ep.url, short)  # ~300 tokens: fits, and its entry (2 MiB of buffer) stays in the cache
    assert cache_stats(ep.url)["memory_entries"] == 1
    r = requests.post(ep.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo-a", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "long"}],
        "max_tokens": 6})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "does not fit beside the model" in r.json()["error"]["message"]
    # Another ~500-token conversation fits only if the cached entry gives way: it does.
    other = [{"role": "system", "content": "other: " + SYSTEM[:900]}, {"role": "user", "content": "x"}]
    _, usage = ask(ep.url, other)
    assert usage["completion_tokens"] > 0
    stats = cache_stats(ep.url)
    assert stats["evictions"] >= 1 and requests.get(ep.url + "/health", timeout=5).json()["status"] == "ok"


def test_a_disk_entry_survives_kill_9_and_is_used_after_the_restart(tmp_path, demo_models):
    home = tmp_path / "home"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "remember this"}]
    with engine_in(home, toml(demo_models)) as ep:
        reply, _ = ask(ep.url, messages)
        # Idle now: the worker writes the conversation to disk.
        wait_until(lambda: cache_stats(ep.url)["disk_entries"] == 1, 30, what="the entry on disk")
        os.kill(ep.proc.pid, signal.SIGKILL)
        ep.proc.wait(10)
    # The measured speeds the next engine's first read is judged by went with it.
    rates = json.loads((home / "state" / "kv" / "rates.json").read_text())
    assert rates["prefill_tokens_per_s"] > 0 and rates["read_bytes_per_s"] > 0
    assert rates["first_prefill_tokens_per_s"] > 0
    with engine_in(home, toml(demo_models)) as ep:
        assert cache_stats(ep.url)["disk_entries"] == 1 and cache_stats(ep.url)["memory_entries"] == 0
        _, usage = ask(ep.url, messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}])
        assert cached(usage) > 300 and cache_stats(ep.url)["disk_hits"] == 1


def test_a_crash_in_the_middle_of_a_long_prefill_keeps_what_was_prefilled(tmp_path, demo_models):
    """A long prompt's KV reaches disk every 2,048 prefilled tokens: an
    engine killed while it prefills the rest leaves the retry all but the
    part after the last of them to prefill."""
    home = tmp_path / "home"
    long = [{"role": "user", "content": " ".join(f"item{i % 89}" for i in range(800))}]  # ~3,000 tokens
    slow = toml(demo_models, engine={"stuck_grace_s": 60})
    with engine_in(home, slow, env={"MLXD_FAULT": "slow@prefill:3"}) as ep:  # 3 ms a token: ~9 s of prefill
        def in_flight() -> None:
            try:
                requests.post(ep.url + "/v1/chat/completions", timeout=60,
                              json={"model": "demo-a", "messages": long, "max_tokens": 4})
            except requests.RequestException:
                pass  # killed under it

        import threading

        thread = threading.Thread(target=in_flight, daemon=True)
        thread.start()
        kv = home / "state" / "kv"  # (the writer's thread puts it there; the worker counts it once it is free)
        wait_until(lambda: [p for p in kv.glob("*.json") if p.name != "rates.json"], 60,
                   what="the first 2,048 tokens on disk")
        assert requests.get(ep.url + "/health", timeout=5).json()["phase"] == "prefill"  # still at it
        os.kill(ep.proc.pid, signal.SIGKILL)
        ep.proc.wait(10)
        thread.join(30)
    with engine_in(home, slow) as ep:
        _, usage = ask(ep.url, long, max_tokens=4)
        assert 2048 <= cached(usage) < usage["prompt_tokens"] and cache_stats(ep.url)["disk_hits"] == 1, usage


def test_corrupt_and_partial_entry_files_are_removed_and_requests_still_answer(tmp_path, demo_models):
    home = tmp_path / "home"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    with engine_in(home, toml(demo_models)) as ep:
        ask(ep.url, messages)
        wait_until(lambda: cache_stats(ep.url)["disk_entries"] == 1, 30, what="the entry on disk")
    kv = home / "state" / "kv"
    (manifest,) = [p for p in kv.glob("*.json") if p.name != "rates.json"]  # the entry: its manifest over its blocks
    first, *rest = sorted((kv / "blocks").glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    assert rest, "a conversation of several blocks"
    data = first.read_bytes()
    first.write_bytes(data[:len(data) // 2])  # truncated: its header still reads
    (kv / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    (kv / "broken.json").write_text("{not json")
    (kv / "notes.txt").write_text("not an entry")
    with engine_in(home, toml(demo_models)) as ep:
        assert not any((kv / name).exists() for name in ("garbage.safetensors", "broken.json", "notes.txt"))
        assert cache_stats(ep.url)["disk_entries"] == 1  # the truncated block is found when read
        reply, usage = ask(ep.url, messages + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}])
        assert cached(usage) == 0 and usage["completion_tokens"] > 0  # answered, cold
        stats = cache_stats(ep.url)
        assert stats["disk_rejects"] == 4 and stats["disk_hits"] == 0
        assert not manifest.exists()  # the entry that named the bad block went with it
        assert not first.exists() or first.stat().st_size == len(data)  # rewritten whole by this turn (same tokens)
        assert requests.get(ep.url + "/health", timeout=5).json()["status"] == "ok"


def test_a_slow_disk_write_holds_up_no_request(start_engine, demo_models):
    """Files are written by the writer's thread (engine/cache/kv_writer.py): with
    every write taking 8 s (a slow disk), three requests that each evict the
    one before are all answered before the first file is even written, and
    the files land afterwards."""
    ep = start_engine(toml=toml(demo_models, {"memory_gib": 0.0015}),  # ~1.6 MB: less than one entry
                      env={"MLXD_FAULT": "slow@kv_write:8000"})

    def conversation(word: str) -> list[dict]:
        return [{"role": "system", "content": f"{word} " * 300}, {"role": "user", "content": word}]

    for word in ("alpha", "bravo", "charlie"):
        ask(ep.url, conversation(word))
    pc = requests.get(ep.url + "/health", timeout=5).json()["prompt_cache"]
    # Written on the worker, alpha's file (8 s) would have held bravo's request up until it was done.
    assert pc["evictions"] >= 2 and pc["disk_writes"] == 0 and pc["disk_writes_pending"] >= 1, pc
    wait_until(lambda: (lambda pc: pc["disk_writes"] >= 2 and pc["disk_writes_pending"] == 0)(cache_stats(ep.url)),
               120, what="every file written")
    pc = cache_stats(ep.url)
    assert pc["writing_bytes"] == 0 and pc["disk_entries"] >= 2  # on disk, and their arrays freed
    # (the files read back: test_a_disk_entry_survives_kill_9_and_is_used_after_the_restart; here the 8 s
    # writes have taught the cache that this disk is too slow to be worth reading)


def test_a_kill_9_the_moment_an_answer_arrives_finds_its_prompt_on_disk(tmp_path, demo_models):
    """An answer's end waits for its prompt's checkpoint (engine/core/held_answers.py):
    with every write 0.4 s slow -- longer than the short answer takes -- an
    engine killed the moment the answer arrives still leaves the next engine
    the prompt (sent at once, the end would have beaten the write)."""
    home = tmp_path / "home"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "remember this"}]
    with engine_in(home, toml(demo_models), env={"MLXD_FAULT": "slow@kv_write:400"}) as ep:
        reply, _ = ask(ep.url, messages, max_tokens=2)
        os.kill(ep.proc.pid, signal.SIGKILL)
        ep.proc.wait(10)
    with engine_in(home, toml(demo_models)) as ep:
        _, usage = ask(ep.url, messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}])
        assert cached(usage) > 300 and cache_stats(ep.url)["disk_hits"] == 1, usage


def test_a_slow_checkpoint_holds_up_no_other_rows_tokens(start_engine, demo_models):
    """The answer's end waits for its prompt on disk beside the step, not
    under it: with every write 3 s slow, a short answer after a long prompt
    is held to the limit (CHECKPOINT_WAIT_S), and the row decoding beside it
    gets its tokens all that while (a wait under the step held them all)."""
    ep = start_engine(toml=toml(demo_models, engine={"max_concurrency": 2, "max_tokens_cap": 4096}),
                      env={"MLXD_FAULT": "slow@kv_write:3000"})
    arrivals: list[float] = []

    def long_answer() -> None:
        body = {"model": "demo-a", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
                "temperature": 0, "stream": True}
        with requests.post(ep.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())

    thread = threading.Thread(target=long_answer, daemon=True)
    thread.start()
    wait_until(lambda: len(arrivals) >= 5, 60, what="the long answer under way")
    ask(ep.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "short"}], max_tokens=2)
    answered = time.monotonic()
    thread.join(120)
    assert arrivals[-1] > answered + 0.1, "the long answer ended before the short one: nothing to show"
    window = [t for t in arrivals if answered - 0.8 * CHECKPOINT_WAIT_S < t < answered - 0.1]
    assert len(window) >= 3, (len(window), len(arrivals))


def test_kill_9_during_a_disk_write_leaves_no_entry(tmp_path, demo_models):
    home = tmp_path / "home"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "write me"}]
    # The engine kills itself (SIGKILL) with the entry written but not yet renamed into place.
    with engine_in(home, toml(demo_models), env={"MLXD_FAULT": "kill@kv_write"}) as ep:
        try:  # the first write is the prompt's, as its answer is decoded: the kill may cut the answer short
            ask(ep.url, messages)
        except requests.RequestException:
            pass
        assert ep.proc.wait(30) == -signal.SIGKILL
    kv = home / "state" / "kv"
    # Its blocks reached their place, but not the manifest that makes them an entry: only its temporary file.
    assert [p.name for p in kv.glob("*.json")] in ([], ["rates.json"])
    assert list((kv / "tmp").glob("*")) and list((kv / "blocks").glob("*"))
    with engine_in(home, toml(demo_models)) as ep:
        assert not (kv / "tmp").exists()  # the next engine removed it, and the blocks no entry names
        assert list((kv / "blocks").glob("*")) == []
        _, usage = ask(ep.url, messages)
        assert cached(usage) == 0 and cache_stats(ep.url)["disk_hits"] == 0


def test_cache_off_reports_zero_cached_tokens(start_engine, demo_models):
    ep = start_engine(toml=toml(demo_models, {"enabled": False}))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    for _ in range(2):
        _, usage = ask(ep.url, messages)
        assert cached(usage) == 0
    assert cache_stats(ep.url)["enabled"] is False and not (Path(ep.home) / "state" / "kv").exists()


@pytest.mark.timeout(600)
def test_greedy_answers_are_the_same_with_and_without_the_cache_on_the_real_model(start_engine):
    gguf = real_default_model()
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    transcripts = {}
    for enabled in (True, False):
        ep = start_engine(toml=dumps({"engine": {"prompt_cache": {"enabled": enabled}},
                                       "models": {"smollm2": {"gguf": gguf}}, "aliases": {"default": "smollm2"}}))
        messages = [{"role": "system", "content": "You are a concise geography tutor."}]
        turns = []
        for q in questions:
            messages.append({"role": "user", "content": q})
            reply, usage = ask(ep.url, messages, model="smollm2", max_tokens=12)
            messages.append({"role": "assistant", "content": reply})
            turns.append((reply, usage["completion_tokens"], cached(usage)))
        transcripts[enabled] = turns
        ep.stop()
    with_cache, without = transcripts[True], transcripts[False]
    assert [t[:2] for t in with_cache] == [t[:2] for t in without]  # same text, same token counts
    assert "Paris" in with_cache[0][0]
    assert all(c > 30 for _, _, c in with_cache[1:]) and all(c == 0 for _, _, c in without)


def test_a_conversation_larger_than_the_cache_comes_back_from_disk(start_engine, demo_models):
    """A cache squeezed below one conversation (as beside a big model on a
    Mac) keeps none of it in memory; its turn's file is read back into the
    next turn's own KV, which admission granted: it is not started cold."""
    ep = start_engine(toml=toml(demo_models, {"memory_gib": 0.0005}))  # ~0.5 MB: this conversation takes ~1.3
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "remember this"}]
    reply, _ = ask(ep.url, messages)
    wait_until(lambda: cache_stats(ep.url)["disk_entries"] == 1, 30, what="the entry on disk")
    pc = cache_stats(ep.url)
    assert pc["memory_entries"] == 0 and pc["memory_budget_bytes"] < 2**20, pc
    _, usage = ask(ep.url, messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}])
    assert cached(usage) > 300 and cache_stats(ep.url)["disk_hits"] == 1
