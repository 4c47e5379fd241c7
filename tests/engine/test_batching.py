"""Several requests at once (`max_concurrency` > 1), against real engine
processes: batched answers equal lone ones, per-request settings hold,
memory admission, cancellation and what the batch cannot take."""

from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from testkit import metric, wait_until

pytestmark = pytest.mark.timeout(240)


def complete(url: str, prompt: str, max_tokens: int = 24, **extra) -> requests.Response:
    return requests.post(url + "/v1/completions", timeout=120,
                         json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               **extra})


def chat_body(content: str, max_tokens: int = 24, **extra) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def at_once(fns: list) -> list:
    """Run the callables together (a barrier), return their results in order."""
    results: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - reported by the asserting test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    return results


def endless_stream(url: str) -> tuple[requests.Response, object]:
    """A streamed completion that goes on until its client leaves, once its first token has come; and
    its lines (kept by the caller: the iterator's collection would close the stream)."""
    r = requests.post(url + "/v1/completions", stream=True, timeout=60,
                      json={"model": "default", "prompt": "hold", "max_tokens": 100_000, "stream": True,
                            "temperature": 0})
    lines = r.iter_lines()
    wait_until(lambda: next(lines).startswith(b"data: "), 30, interval=0, what="first streamed token")
    return r, lines


PROMPTS = [f"Request {i}: " + " ".join(["word"] * (5 + 7 * i)) for i in range(4)]


def test_batched_answers_equal_the_answers_alone(start_engine):
    """Greedy answers of four requests decoded together are those each gets
    alone (prompts of different lengths: each row decoded over its own
    cache, attention row by row, engine/model/row_batch.py)."""
    single = start_engine({"max_tokens_cap": 256})
    alone = [complete(single.url, p).json() for p in PROMPTS]
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 256, "prompt_cache": {"enabled": False}})
    together = at_once([lambda p=p: complete(eng.url, p).json() for p in PROMPTS])
    assert [t["choices"][0]["text"] for t in together] == [a["choices"][0]["text"] for a in alone]
    assert [t["usage"] for t in together] == [a["usage"] for a in alone]
    assert metric(eng.url, "mlxd_engine_max_observed_concurrency") >= 2  # they really ran together
    assert eng.health()["max_concurrency"] == 4 and eng.health()["serving"]["rows_apart"]


@pytest.mark.parametrize("start", [0, 24])
def test_quantised_kv_batches(start_engine, start):
    """kv_bits 8 with max_concurrency 4 (refused before: mlx-lm's batch has
    no quantised cache): each row keeps its own quantised cache, quantised
    from the first position or once it holds `start` positions (some rows
    cross it in their prompt, some while decoding in the batch), and four
    requests are decoded together, each its whole answer. That a row
    decodes in the batch the tokens it decodes alone is
    tests/engine/test_row_batch.py's, bit for bit; through the engine, the
    CPU backend's products of one row and of several differ in their last
    bits, and quantising rounds that to a step of the 8-bit grid, which
    parts the random demo model's near ties: the answers are compared in
    their first tokens only."""
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": start, "max_tokens_cap": 256,
          "prompt_cache": {"enabled": False}}
    single = start_engine(kv)
    alone = [complete(single.url, p).json() for p in PROMPTS]
    eng = start_engine({**kv, "max_concurrency": 4})
    health = eng.health()
    assert health["max_concurrency"] == 4 and health["serving"]["rows_apart"], health["serving"]
    assert health["kv_cache"]["bits"] == 8
    together = at_once([lambda p=p: complete(eng.url, p).json() for p in PROMPTS])
    assert [t["usage"]["prompt_tokens"] for t in together] == [a["usage"]["prompt_tokens"] for a in alone]
    assert all(t["usage"]["completion_tokens"] == 24 or t["choices"][0]["finish_reason"] == "stop" for t in together)
    assert [t["choices"][0]["text"][:3] for t in together] == [a["choices"][0]["text"][:3] for a in alone]
    assert metric(eng.url, "mlxd_engine_max_observed_concurrency") >= 2  # they really ran together


def test_rows_that_share_a_prompt_prefill_it_once(start_engine):
    """Four agents with one long system prompt, arriving together, before
    any of it is in a prompt cache (none here): the first prefills it, the
    others take its KV from the decoding row (engine/model/batch_decoder.py,
    `_borrow_prefix`) -- reported as cached tokens -- and answer exactly
    what each answers alone."""
    system = "You are a careful coding agent; read the files before you edit them. " * 40
    questions = [f"Question {i}: " + " ".join(["why"] * (3 + 5 * i)) for i in range(4)]
    prompts = [system + q for q in questions]
    single = start_engine({"max_tokens_cap": 256, "prompt_cache": {"enabled": False}})
    alone = [complete(single.url, p).json() for p in prompts]
    assert all(a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0 for a in alone)
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 256, "prompt_cache": {"enabled": False}})
    together = at_once([lambda p=p: complete(eng.url, p).json() for p in prompts])
    assert [t["choices"][0]["text"] for t in together] == [a["choices"][0]["text"] for a in alone]
    cached = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in together]
    shared = min(a["usage"]["prompt_tokens"] for a in alone) - 20  # the questions differ within their last tokens
    assert sum(c >= shared for c in cached) >= 2, cached  # at least two rows joined beside one that had it
    assert all(c < t["usage"]["prompt_tokens"] for c, t in zip(cached, together))
    assert metric(eng.url, "mlxd_engine_max_observed_concurrency") >= 2


def test_batching_auto_follows_what_its_load_measured(start_engine):
    """[engine] batching = "auto": on the CPU one request at a time (four
    agents batched on 2 cores served 0.82-0.94x the turns a minute of
    serving them one at a time, bench/agents_load.py alternated,
    docs/BENCHMARKS.md), said in /health; elsewhere a step of four rows is
    timed against one row's at the load (engine/model/batch_probe.py), /health
    reports the ratio, and the plan batches only where it is at least 1.
    "always" batches whatever was measured."""
    import mlx.core as mx

    eng = start_engine({"max_concurrency": 4, "batching": "auto", "max_tokens_cap": 64})
    serving = eng.health()["serving"]
    if mx.default_device() == mx.cpu:
        assert serving["batch_speedup"] is None and "on the CPU" in serving["reason"], serving
        batches = False
    else:
        speedup = serving["batch_speedup"]
        assert isinstance(speedup, float) and 0 < speedup < 16, serving
        batches = speedup >= 1.0
        assert (serving["reason"] is None) == batches and (batches or "batched step" in serving["reason"]), serving
    assert serving["max_concurrency"] == (4 if batches else 1), serving
    answers = at_once([lambda p=p: complete(eng.url, p, max_tokens=8) for p in PROMPTS])
    assert all(r.status_code == 200 for r in answers)
    assert (metric(eng.url, "mlxd_engine_max_observed_concurrency") > 1) == batches
    always = start_engine({"max_concurrency": 4, "batching": "always", "max_tokens_cap": 64})
    assert always.health()["serving"]["batch_speedup"] is None and always.health()["max_concurrency"] == 4


def test_per_request_settings_hold_in_a_batch(start_engine):
    """Stop strings, max_tokens and sampling stay each request's own."""
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 256})
    free = complete(eng.url, PROMPTS[1], max_tokens=40).json()["choices"][0]["text"]
    assert len(free) > 8
    stop = free[5:8]
    results = at_once([
        lambda: complete(eng.url, PROMPTS[1], max_tokens=40, stop=[stop]),
        lambda: complete(eng.url, PROMPTS[1], max_tokens=3),
        lambda: complete(eng.url, PROMPTS[1], max_tokens=40, temperature=1.5, top_p=0.9),
        lambda: complete(eng.url, PROMPTS[1], max_tokens=40),
    ])
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    stopped, short, sampled, same = (r.json() for r in results)
    assert stopped["choices"][0]["text"] == free[:free.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert short["usage"]["completion_tokens"] == 3 and short["choices"][0]["finish_reason"] == "length"
    assert same["choices"][0]["text"] == free  # greedy beside sampled rows is still greedy
    assert sampled["usage"]["completion_tokens"] >= 1


def test_streamed_chat_in_a_batch_reports_usage_and_cached_tokens(start_engine):
    eng = start_engine({"max_concurrency": 3, "max_tokens_cap": 256})
    system = "You are a careful assistant. " * 20

    def stream(q: str) -> tuple[str, dict]:
        body = {"model": "default", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 16,
                "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        text, usage = "", {}
        with requests.post(eng.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                import json

                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
        return text, usage

    first = stream("first question")  # fills the prompt cache with the system prompt
    results = at_once([lambda q=q: stream(q) for q in ("second question", "third question", "fourth one")])
    for text, usage in [first, *results]:
        assert text and usage["completion_tokens"] >= 1
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u in results]
    assert max(cached) > 100, cached  # a request joining the batch reuses the cached system prompt


def test_a_seeded_request_is_served_alone_not_refused(start_engine):
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 256})
    results = at_once([
        lambda: complete(eng.url, PROMPTS[0], max_tokens=12, seed=7, temperature=1.0),
        lambda: complete(eng.url, PROMPTS[1], max_tokens=12),
        lambda: complete(eng.url, PROMPTS[0], max_tokens=12, seed=7, temperature=1.0),
    ])
    assert [r.status_code for r in results] == [200, 200, 200]
    assert results[0].json()["choices"][0]["text"] == results[2].json()["choices"][0]["text"]  # the seed holds


def test_a_client_gone_leaves_the_batch(start_engine):
    """A streamed request whose client disconnects ends within a step; the
    others in the batch go on to their end."""
    eng = start_engine({"max_concurrency": 2, "max_tokens_cap": 100_000})
    r, _lines = endless_stream(eng.url)
    other = complete(eng.url, PROMPTS[2], max_tokens=20)  # decoded beside the endless one
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 20
    # The finished row leaves at the batch's next step, which may come just
    # after its answer is sent; the endless one stays.
    wait_until(lambda: eng.health()["batch_size"] == 1, 20, what="the finished request to leave the batch")
    r.close()
    wait_until(lambda: eng.health()["batch_size"] == 0, 20, what="the gone client's request to leave the batch")


def test_health_shows_each_request_held_with_its_status(start_engine):
    """/health lists every request the worker holds, one status each: a
    seeded request waits (it is served alone once the batch drains) while
    the batch decodes; it runs once the batch has left."""
    eng = start_engine({"max_concurrency": 2, "max_tokens_cap": 100_000})
    r, _lines = endless_stream(eng.url)
    seeded: list = []
    waiter = threading.Thread(target=lambda: seeded.append(complete(eng.url, PROMPTS[1], max_tokens=8, seed=3)))
    waiter.start()

    def statuses() -> list[str]:
        return [q["status"] for q in eng.health()["requests"]]

    wait_until(lambda: statuses() == ["decoding", "waiting"], 30, what="the seeded request waiting behind the batch")
    h = eng.health()
    assert len(h["running"]) == 1 and h["running"][0] == h["requests"][0]["id"]  # waiting is not running
    r.close()
    waiter.join(60)
    assert seeded and seeded[0].status_code == 200
    wait_until(lambda: statuses() == [], 20, what="nothing held")


def test_a_request_waiting_behind_the_batch_gets_the_queue_timeout(start_engine):
    """Taken from the queue but waiting for room in the batch (here: a
    seeded request, served alone once the batch drains, behind an endless
    stream) is still waiting: past queue_timeout_s it gets the queue's 503,
    and the worker lets it go."""
    eng = start_engine({"max_concurrency": 2, "max_tokens_cap": 100_000, "queue_timeout_s": 2})
    r, _lines = endless_stream(eng.url)
    started = time.monotonic()
    seeded = complete(eng.url, PROMPTS[1], max_tokens=8, seed=3)
    assert seeded.status_code == 503, seeded.text
    assert seeded.json()["error"]["code"] == "queue_timeout"
    assert 2 <= time.monotonic() - started < 30
    wait_until(lambda: [q["status"] for q in eng.health()["requests"]] == ["decoding"], 20,
               what="the worker to let the timed-out request go")
    r.close()


def test_memory_admission_keeps_the_batch_under_the_budget(start_engine, demo_models):
    """A budget with room for the model and the KV of two 512-token requests
    (at their peak), not three: of three long requests (rows decoded apart
    each hold their own length, so a short third one would fit beside two
    long ones), never more than two run at a time, MLX's peak memory stays
    under the budget, and every answer is whole."""
    import json

    from mlxd.memory_estimate import kv_cache_bytes

    from mlxd.engine.core.scheduler import Memory, Row, batch_kv_bytes

    config = json.loads((demo_models.a / "config.json").read_text())
    weights = sum(f.stat().st_size for f in demo_models.a.glob("*.safetensors"))
    # Rows of 512 positions at their peak, each its own: room for 2, not 3.
    shape = Memory(0, weights, kv_cache_bytes(config, 1))
    two, three = (batch_kv_bytes(shape, [Row(500, 12)] * n) for n in (2, 3))
    budget = weights + (two + three) // 2
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 4096, "memory_fraction": 1.0, "context_tokens": 256,
                        "prompt_cache": {"enabled": False}},
                       env={"MLXD_MEMORY_TOTAL_BYTES": str(budget)})
    batch_sizes: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            batch_sizes.append(eng.health()["batch_size"])
            stop.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompt_tokens = complete(eng.url, PROMPTS[0], max_tokens=1).json()["usage"]["prompt_tokens"]
        long_answer = 512 - prompt_tokens - 8
        # The first long request is decoding before the others are sent (on a loaded machine a burst
        # could otherwise reach the engine one by one, after the first had ended)
        first = requests.post(eng.url + "/v1/completions", stream=True, timeout=120,
                              json={"model": "default", "prompt": PROMPTS[0], "max_tokens": long_answer,
                                    "stream": True, "temperature": 0, "stream_options": {"include_usage": True}})
        lines = first.iter_lines()
        wait_until(lambda: next(lines).startswith(b"data: {"), 30, interval=0, what="the first request's first token")
        results = at_once([lambda: complete(eng.url, PROMPTS[0], max_tokens=long_answer),
                           lambda: complete(eng.url, PROMPTS[0], max_tokens=long_answer)])
        first_usage = [json.loads(line[6:])["usage"] for line in lines
                       if line.startswith(b"data: {") and json.loads(line[6:]).get("usage")]
    finally:
        stop.set()
        watcher.join()
    assert [r.status_code for r in results] == [200] * 2
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [long_answer, long_answer]
    assert first_usage[-1]["completion_tokens"] == long_answer
    # never three at once, and two were (the engine's own count)
    assert max(batch_sizes) <= 2 and eng.health()["max_observed_concurrency"] == 2
    health = eng.health()
    assert health["memory"]["mlx_peak_bytes"] <= health["memory"]["budget_bytes"]


@pytest.mark.parametrize("shapes", ["any", "few"])
def test_a_second_request_joins_a_lone_one_where_it_stands(start_engine, shapes):
    """A request decoding alone (a batch of one) is joined by a second,
    mid-answer, and each answer is the one it gets alone, token for token.
    With `attention_shapes = "few"` (MLX's CUDA backend's default) the KV
    buffers come in coarse steps and each chunk is widened to whole steps of
    256 (its cached start run again, padding after): the same answers."""
    eng = start_engine({"max_concurrency": 2, "max_tokens_cap": 512, "prompt_cache": {"enabled": False},
                        "prefill_step_size": 16, "log_level": "debug", "attention_shapes": shapes})
    assert eng.health()["serving"]["mixed_prefill"]  # the load found a step of decode tokens and a chunk exact
    assert eng.health()["kv_cache"]["coarse_steps"] is (shapes == "few")
    alone = complete(eng.url, PROMPTS[3], max_tokens=150).json()["choices"][0]["text"]
    other_alone = complete(eng.url, PROMPTS[1], max_tokens=20).json()["choices"][0]["text"]
    r = requests.post(eng.url + "/v1/completions", stream=True, timeout=120,
                      json={"model": "default", "prompt": PROMPTS[3], "max_tokens": 150, "stream": True,
                            "temperature": 0})
    lines = r.iter_lines()
    import json

    text = ""

    def read_some() -> bool:
        nonlocal text
        line = next(lines)
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
        return len(text) > 0

    wait_until(read_some, 30, interval=0, what="the lone request's first tokens")
    other = complete(eng.url, PROMPTS[1], max_tokens=20)  # joins while the first decodes
    for line in lines:
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
    assert other.json()["choices"][0]["text"] == other_alone
    assert text == alone
    assert metric(eng.url, "mlxd_engine_max_observed_concurrency") == 2
    # The second's prompt, all but its last token, was prefilled inside the first's decode steps
    # (engine/model/row_segments.py), at most 16 tokens a step: steps that decoded the first's token and carried
    # the second's prompt tokens.
    mixed = [int(n) for n in re.findall(r"batch step [\d.]+ ms: 1 tokens decoded, (\d+) prompt tokens", eng.log())]
    if shapes == "few":  # after its first (a fresh buffer's, from position 0), every chunk run as a whole step of 256
        carried = [n for n in mixed if n]
        assert len(carried) >= 2 and carried[0] <= 16 and all(n == 256 for n in carried[1:]), mixed
    else:
        assert sum(mixed) == other.json()["usage"]["prompt_tokens"] - 1 and max(mixed) <= 16, mixed


def test_reasoning_splits_the_same_in_a_batch(start_engine, demo_models, think_model):
    """A reasoning model's answers, split into reasoning_content and content,
    are the same in a batch as alone, streamed or not."""
    from openai import OpenAI

    from conftest import engine_toml

    extra = {"demo-think": {"path": think_model}}
    single = start_engine(toml=engine_toml(demo_models, {"max_tokens_cap": 64}, extra_models=extra))
    batched = start_engine(toml=engine_toml(demo_models, {"max_tokens_cap": 64, "max_concurrency": 3},
                                            extra_models=extra))

    def ask(url: str, question: str, stream: bool) -> tuple[str, str]:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="demo-think", messages=[{"role": "user", "content": question}], max_tokens=24,
                  temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        if not stream:
            msg = client.chat.completions.create(**kw).choices[0].message
            return msg.content or "", (msg.model_extra or {}).get("reasoning_content") or ""
        content, reasoning = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        return content, reasoning

    questions = [("Tell me about the lighthouse.", False), ("What is a harbour?", True), ("Name a boat.", True)]
    alone = [ask(single.url, q, s) for q, s in questions]
    together = at_once([lambda q=q, s=s: ask(batched.url, q, s) for q, s in questions])
    assert together == alone
    assert all(reasoning for _, reasoning in alone)  # the template opened <think>: reasoning first


def test_a_deadline_ends_one_request_of_a_batch(start_engine):
    """The deadline holds per request: an endless generation ends at it like
    max_tokens does, while a short one beside it ends on its own."""
    # 20,000 tokens is endless within 3 s here; the batch's KV is allocated at
    # each row's whole grant, and a larger one takes the CPU a second to fill.
    eng = start_engine({"max_concurrency": 2, "max_tokens_cap": 20_000, "request_deadline_s": 3})
    started = time.monotonic()
    long, short = at_once([lambda: complete(eng.url, "hold", max_tokens=20_000),
                           lambda: complete(eng.url, PROMPTS[0], max_tokens=8)])
    assert long.status_code == 200 and long.json()["choices"][0]["finish_reason"] == "length"
    assert 8 < long.json()["usage"]["completion_tokens"] < 20_000
    assert time.monotonic() - started < 30
    assert short.json()["usage"]["completion_tokens"] == 8


def test_tool_calls_are_parsed_per_request_in_a_batch(start_engine, demo_models, agent_model):
    """The fine-tuned agent model's tool call comes out as OpenAI tool_calls
    for each of three requests decoded together, streamed or not."""
    import json

    from openai import OpenAI

    from conftest import engine_toml
    from mlxd.devkit import agent_model as agent

    extra = {"agent": {"path": agent_model}}
    eng = start_engine(toml=engine_toml(demo_models, {"max_tokens_cap": 64, "max_concurrency": 3},
                                        extra_models=extra))
    client = OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(stream: bool) -> tuple[str | None, list[tuple[str, dict]]]:
        kw = dict(model="agent", messages=[{"role": "user", "content": agent.WEATHER_QUESTION}],
                  tools=[agent.WEATHER_TOOL], max_tokens=64, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            return choice.finish_reason, [(c.function.name, json.loads(c.function.arguments))
                                          for c in choice.message.tool_calls or []]
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        return chunks[-1].choices[0].finish_reason, [(c.function.name, json.loads(c.function.arguments))
                                                     for c in calls]

    results = at_once([lambda: ask(False), lambda: ask(True), lambda: ask(False)])
    assert results == [("tool_calls", [("get_weather", agent.WEATHER_ARGS)])] * 3


def test_penalties_and_logit_bias_hold_per_request_in_a_batch(start_engine):
    """Logits processors stay each request's own: penalised and biased
    requests beside a plain one answer as they do alone."""
    settings = [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0, "presence_penalty": 0.5},
                {"logit_bias": {"5": 5.0}}, {}]
    single = start_engine({"max_tokens_cap": 256, "prompt_cache": {"enabled": False}})
    alone = [complete(single.url, PROMPTS[2], max_tokens=30, **s).json()["choices"][0]["text"] for s in settings]
    assert len(set(alone)) > 1  # the settings change the answer
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 256, "prompt_cache": {"enabled": False}})
    together = at_once([lambda s=s: complete(eng.url, PROMPTS[2], max_tokens=30, **s) for s in settings])
    assert [t.json()["choices"][0]["text"] for t in together] == alone


def test_finished_turns_leave_nothing_behind_but_the_prompt_cache(start_engine):
    """Four agents, turn after turn, four at once: what MLX holds once each
    round is over and written is the model and the prompt cache's entries.
    A finished request used to stay alive in reference cycles (its prompt
    cache write and its disk-progress hook each pointed back at it) until
    Python's cyclic collector happened to run: a whole turn's KV a request,
    ~60 GiB over 24 turns of the 8B model on the lent GPU."""
    eng = start_engine({"max_concurrency": 4, "max_tokens_cap": 64})
    convs = [[{"role": "system", "content": f"Agent {i}. " + "rules and tools " * 150}] for i in range(4)]

    def turn(i: int, n: int) -> None:
        convs[i].append({"role": "user", "content": f"turn {n} " + "output " * 80})
        r = requests.post(eng.url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": convs[i], "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        convs[i].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    def settled_excess() -> int:
        """MLX's active bytes beyond the prompt cache's entries, once no write is under way, as sampled
        after that (the engine samples MLX's figures between steps, and every second while idle)."""
        def written() -> dict | None:
            h = eng.health()
            pc = h["prompt_cache"]
            return h if h["phase"] == "idle" and pc["writing_bytes"] == 0 and pc["disk_writes_pending"] == 0 else None
        wait_until(written, 60, what="the prompt cache's writes done")
        settled_at = time.monotonic()
        h = wait_until(lambda: (h := eng.health())["memory"]["mlx_sampled_s_ago"] < time.monotonic() - settled_at
                       and h, 10, what="MLX's memory sampled since")
        return h["memory"]["mlx_active_bytes"] - h["prompt_cache"]["memory_bytes"]

    excess = []
    for n in range(7):
        at_once([lambda i=i: turn(i, n) for i in range(4)])
        excess.append(settled_excess())
    # Each round adds a turn's KV per agent (~1.3 MiB here): kept by the cache, never beside it.
    assert excess[-1] - excess[0] < 8 * 2**20, [e >> 20 for e in excess]
