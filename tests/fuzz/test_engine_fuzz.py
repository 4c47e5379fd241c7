"""Bad-input fuzzing of the engine: schemathesis from its own OpenAPI
document, then hypothesis with raw HTTP beyond what the schema says.

Property of every exchange: no 5xx (a 429 or 503 only with Retry-After),
every 4xx in OpenAI's error shape, and /health still 200 afterwards. After
the whole run (the last test): the same engine process is alive, still
answers a valid request, never counted a 5xx in its own metrics, and its RSS
grew by at most RSS_GROWTH_BOUND over the warmed-up baseline.

Bounded for CI (a few dozen examples per test); MLXD_FUZZ_EXAMPLES=N for a
long run (bench/bad_input_fuzz.py). Inputs hitting bugs already reported are
neutralised (fuzzkit.neutralise_known_bugs) and reproduced below as strict
xfails; MLXD_FUZZ_KNOWN_BUGS=1 sends them anyway.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import given, note
from hypothesis import strategies as st
from tokenizers import Tokenizer

from fuzz.fuzzkit import (CHAT, COMPLETIONS, DEMO_VOCAB, LONG_RUN, METHODS, RECORDER, TEXT_FIELDS, Answer, any_text,
                          base_for, big_ints, case_strategy, chat_body, check_answer, completion_body, content_type,
                          endpoint_and_field, error_code, floats, fuzz_settings, header_name, header_value,
                          health_status, http_request, is_protocol_400, malformed_body, max_tokens_value,
                          model_tricks, nasty, neutralise_known_bugs, odd_char, odd_text, post_json, raw_http,
                          raw_request, promises_more_body, rss_bytes, run_case, set_path, valid_json_bytes)
from mlxd.engine.api.request_job import MAX_CHARS_PER_TOKEN
from testkit import chat, metric, settled_health, wait_until

pytestmark = pytest.mark.timeout(7200 if LONG_RUN else 300)

TARGET = "engine"
CAP = 64            # SHARED_ENGINE's max_tokens_cap (tests/conftest.py)
PROMPT_LIMIT = 4096  # SHARED_ENGINE's max_prompt_tokens
ROUTES = {CHAT: "POST", COMPLETIONS: "POST", "/v1/models": "GET", "/health": "GET", "/metrics": "GET"}
# RSS may grow this much over the warmed-up baseline during the fuzz. The
# warm-up already sent the largest inputs the fuzz sends (huge prompts of
# each kind, a 20,000-message chat), which set the allocator's high-water
# mark (refused huge prompts are still tokenized whole: ~170 B a character);
# what is left is allocator noise: 200 random huge prompts after the
# warm-up moved RSS by under 20 MiB. A leak of 10 KiB a request over a long
# run (bench/bad_input_fuzz.py, ~10k requests) would exceed it.
RSS_GROWTH_BOUND = 96 * 2**20


# --- fixtures -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine


@pytest.fixture(scope="module")
def names(engine) -> set[str]:
    """Every model id and alias the engine serves."""
    return {m["id"] for m in requests.get(engine.url + "/v1/models", timeout=10).json()["data"]}


@pytest.fixture(scope="module")
def tokenizer(demo_models) -> Tokenizer:
    """The default model's tokenizer, as the engine uses it (an oracle for prompt lengths)."""
    return Tokenizer.from_file(str(Path(demo_models.a) / "tokenizer.json"))


@pytest.fixture(scope="module")
def baseline(engine) -> dict:
    """Warm the engine up with every kind of request the fuzz sends (so
    buffers, caches and the allocator reach their working size), then take
    the RSS the final test compares against."""
    from fuzz.fuzzkit import HUGE_MIN, HUGE_TEXT, HUGE_UNITS

    for stream in (False, True):
        assert chat(engine.url, max_tokens=CAP, stream=stream).status_code == 200
        assert chat(engine.url, model="second", max_tokens=CAP, stream=stream).status_code == 200
    for unit in HUGE_UNITS:  # the allocator's high-water mark for the huge prompts the fuzz sends
        for n in (HUGE_TEXT, (HUGE_TEXT + HUGE_MIN) // 2, HUGE_MIN):
            assert chat(engine.url, content=unit * n).status_code == 400
    many = {"model": "default", "messages": [{"role": "user", "content": "\U0010ffff" * MESSAGE_TEXT}] * MANY_MESSAGES,
            "max_tokens": 1}
    assert post_json(TARGET, engine.url, CHAT, many).status == 400
    for p in ("hi", [1, 2, 3], "y" * 200):
        assert post_json(TARGET, engine.url, COMPLETIONS, {"model": "default", "prompt": p, "max_tokens": CAP}).status == 200
    for path in ("/v1/models", "/health", "/metrics", "/openapi.json"):
        assert http_request(TARGET, engine.url, "GET", path).status == 200
    rss = min(rss_bytes(engine.proc.pid) for _ in range(3))
    RECORDER.note(target=TARGET, rss_before=rss, pid=engine.proc.pid)
    return {"pid": engine.proc.pid, "rss": rss, "5xx": server_errors_counted(engine.url),
            "cache_bytes": cached_bytes(engine)}


def cached_bytes(engine) -> int:
    """The prompt cache's memory tier, once the worker has stored its last turn:
    it grows with every new prompt up to its own budget (by design, tested
    in test_prompt_cache*), so the leak bound below leaves it out."""
    return settled_health(engine.url)["prompt_cache"]["memory_bytes"]


def server_errors_counted(url: str) -> dict[str, float]:
    """The engine's own count of 5xx answers, by endpoint and status."""
    text = requests.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("mlxd_engine_requests_total{") and re.search(r'status="5\d\d"', line)}


def engine_ok(engine, what: str) -> None:
    """After every example: the same process, and /health 200."""
    assert engine.proc.poll() is None, f"engine exited ({engine.proc.returncode}) after {what}"
    status = health_status(engine.url)
    assert status == 200, f"/health answered {status} after {what}"


def call(engine, path: str, body, what: str, **kw) -> Answer:
    answer = post_json(TARGET, engine.url, path, neutralise_known_bugs(body), **kw)
    check_answer(answer, what)
    engine_ok(engine, what)
    return answer


# --- schemathesis: the engine's own OpenAPI document ------------------------------

def _load(doc_or_url, base_url: str):
    schema = (schemathesis.openapi.from_url(doc_or_url) if isinstance(doc_or_url, str)
              else schemathesis.openapi.from_dict(doc_or_url))
    schema.config.update(base_url=base_url)
    return schema


@pytest.fixture(scope="module")
def engine_schemas(engine, names) -> dict:
    """GET /openapi.json as FastAPI generates it ("as_served"), and the same
    document with `model` pinned to the configured names ("known_models"),
    so that generated bodies get past the model lookup to the worker."""
    doc = requests.get(engine.url + "/openapi.json", timeout=10).json()
    pinned = copy.deepcopy(doc)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        pinned["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": sorted(names)}
    return {"as_served": _load(engine.url + "/openapi.json", engine.url), "known_models": _load(pinned, engine.url)}


# Every operation of the engine's document (test_every_operation_is_fuzzed keeps this whole).
OPERATIONS = [*ROUTES.items(), ("/v1/responses", "POST"), ("/v1/messages", "POST"), ("/v1/embeddings", "POST"),
              ("/v1/rerank", "POST"), ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}", "DELETE"), ("/livez", "GET")]


def test_every_operation_is_fuzzed(engine):
    doc = requests.get(engine.url + "/openapi.json", timeout=10).json()
    assert {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops} == set(OPERATIONS)


SCHEMA_RUNS = ([("as_served", path, method, "positive") for path, method in OPERATIONS]
               + [(doc, path, "POST", mode) for doc in ("as_served", "known_models") for path in (CHAT, COMPLETIONS)
                  for mode in ("positive", "negative") if (doc, mode) != ("as_served", "positive")])


@pytest.mark.parametrize("doc,path,method,mode", SCHEMA_RUNS)
@given(data=st.data())
@fuzz_settings(10)
def test_schemathesis_engine_openapi(engine, baseline, engine_schemas, doc, path, method, mode, data):
    case = data.draw(case_strategy(engine_schemas[doc], path, method, mode), label="case")
    run_case(case, TARGET, lambda what: engine_ok(engine, what))


# --- hypothesis, raw HTTP -----------------------------------------------------------

@given(target=endpoint_and_field, value=nasty, ascii_json=st.booleans())
@fuzz_settings(40)
def test_wrong_types_at_every_field(engine, baseline, target, value, ascii_json):
    path, field = target
    body = set_path(base_for(path), field, value)
    note(f"{path} {field} = {value!r:.200}")
    answer = call(engine, path, body, f"{path} {field}={value!r:.200}", ensure_ascii=ascii_json)
    if answer.status == 200 and answer.header("content-type") == "application/json":
        data = answer.json()
        assert data["choices"] and data["usage"]["completion_tokens"] <= CAP
    elif answer.status == 200:  # a stream (`stream` coerced to true)
        assert answer.body.rstrip().endswith(b"data: [DONE]"), answer.body[-300:]


@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=malformed_body)
@fuzz_settings(40)
def test_malformed_json_bodies(engine, baseline, path, body):
    note(f"{path} {body[:200]!r}")
    answer = http_request(TARGET, engine.url, "POST", path, body, {"Content-Type": "application/json"})
    what = f"{path} body {body[:200]!r}"
    check_answer(answer, what)
    engine_ok(engine, what)


@given(field=st.sampled_from(TEXT_FIELDS), text=any_text, ascii_json=st.booleans(), stream=st.booleans())
@fuzz_settings(20)
def test_odd_unicode_and_sizes_in_text_fields(engine, baseline, field, text, ascii_json, stream):
    body = base_for(CHAT)
    if field.startswith("stop.") or field == "stop":
        body["stop"] = ["x"]
    body = set_path(body, field, text)
    body["stream"] = stream
    what = f"{field}={text[:100]!r} (len {len(text)}) ascii_json={ascii_json} stream={stream}"
    note(what)
    answer = call(engine, CHAT, body, what, ensure_ascii=ascii_json)
    if answer.status == 200 and stream:
        assert answer.body.rstrip().endswith(b"data: [DONE]"), answer.body[-300:]
        assert answer.header("content-type").startswith("text/event-stream")
    elif answer.status == 200:
        assert isinstance(answer.json()["choices"][0]["message"]["content"], (str, type(None)))


@given(field=st.sampled_from(["max_tokens", "max_completion_tokens"]), value=max_tokens_value,
       path=st.sampled_from([CHAT, COMPLETIONS]))
@fuzz_settings(30)
def test_max_tokens_values(engine, baseline, field, value, path):
    if path == COMPLETIONS:
        body = completion_body(**{field: value})
    else:
        body = chat_body(**{field: value})
    if field == "max_tokens" or path == COMPLETIONS:
        body.pop("max_completion_tokens", None)
    what = f"{path} {field}={value!r:.100}"
    answer = call(engine, path, body, what)
    if answer.status == 200:
        used = answer.json()["usage"]["completion_tokens"]
        assert used <= CAP, f"{what}: {used} tokens over the cap"
    else:
        assert answer.status == 400 and error_code(answer) == "invalid_request", f"{what}: {answer.short()}"


MANY_MESSAGES = 20_000
MESSAGE_TEXT = 8  # characters in a repeated message (bounds the largest prompt, see RSS_GROWTH_BOUND)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                 "content": st.one_of(st.text(odd_char, max_size=MESSAGE_TEXT), st.just("hi"))})


@given(n=st.one_of(st.integers(0, 30), st.sampled_from([1000, 5000, MANY_MESSAGES])), msg=message,
       varied=st.lists(message, max_size=20), path=st.just(CHAT))
@fuzz_settings(12)
def test_long_arrays_of_messages(engine, baseline, n, msg, varied, path):
    messages = (varied + [msg] * n) or []
    body = chat_body(messages=messages, max_tokens=2)
    what = f"{len(messages)} messages"
    answer = call(engine, path, body, what)
    if not messages:
        assert answer.status == 400 and error_code(answer) == "invalid_request", what
    if answer.status == 400 and error_code(answer) == "context_length_exceeded":
        # Refused after tokenizing ("has N tokens") or, when the rendered text is
        # longer than any tokenizer could fit, before ("has N characters").
        found = re.search(r"has (\d+) (tokens|characters)", answer.json()["error"]["message"])
        assert found, answer.json()
        count, unit = int(found.group(1)), found.group(2)
        assert count > PROMPT_LIMIT * (MAX_CHARS_PER_TOKEN if unit == "characters" else 1)
    if answer.status == 200:
        assert answer.json()["usage"]["prompt_tokens"] <= PROMPT_LIMIT


SMALL_LIMIT = 256  # prompt limit of the engine in test_prompt_limit_is_exact: cheap prefills near it


@pytest.fixture
def small_engine(start_engine):
    return start_engine({"max_prompt_tokens": SMALL_LIMIT, "max_tokens_cap": 4})


@given(n=st.one_of(st.integers(0, 2 * SMALL_LIMIT), st.integers(SMALL_LIMIT - 20, SMALL_LIMIT + 20),
                   st.integers(2 * SMALL_LIMIT, 100_000)),
       unit=st.sampled_from(["a", "hello ", "\u202e", "\U0001f600", " ", "ab\u200bc", "\x00", "\u0645\u0631"]))
@fuzz_settings(30)
def test_prompt_limit_is_exact(small_engine, tokenizer, n, unit):
    """Completions with a text prompt: 400 context_length_exceeded exactly
    when the tokenizer makes more than max_prompt_tokens of it (an engine
    with a small limit, so that prompts just under it prefill quickly)."""
    prompt = (unit * n)[:n]
    tokens = len(tokenizer.encode(prompt).ids)
    what = f"prompt of {n} x {unit!r}: {tokens} tokens"
    answer = post_json(TARGET, small_engine.url, COMPLETIONS, completion_body(prompt=prompt, max_tokens=1))
    check_answer(answer, what)
    engine_ok(small_engine, what)
    if tokens > SMALL_LIMIT:
        assert answer.status == 400 and error_code(answer) == "context_length_exceeded", answer.short()
        message = answer.json()["error"]["message"]
        # Exact count from the tokenizer, or refused before tokenizing when the
        # text is longer than any prompt that could fit (64 characters a token).
        assert f"has {tokens} tokens" in message or (f"has {len(prompt)} characters" in message
                                                      and len(prompt) > SMALL_LIMIT * 64), message
    else:
        assert answer.status == 200, answer.short()
        assert answer.json()["usage"]["prompt_tokens"] == tokens


token_ids = st.one_of(st.integers(-5, DEMO_VOCAB + 5), big_ints, st.booleans(), floats, st.none(), odd_text)


over_limit_ids = st.builds(lambda n, step: [(i * step) % DEMO_VOCAB for i in range(n)],
                           st.integers(PROMPT_LIMIT + 1, PROMPT_LIMIT + 200), st.integers(1, DEMO_VOCAB))


@given(ids=st.lists(token_ids, max_size=50) | over_limit_ids)
@fuzz_settings(20)
def test_completion_token_id_prompts(engine, baseline, ids):
    answer = call(engine, COMPLETIONS, completion_body(prompt=ids), f"prompt ids {ids[:20]!r} ({len(ids)})")
    plain = all(type(i) is int for i in ids)
    if plain and ids and all(0 <= i < DEMO_VOCAB for i in ids) and len(ids) <= PROMPT_LIMIT:
        assert answer.status == 200, answer.short()
    elif plain and len(ids) > PROMPT_LIMIT and all(0 <= i < DEMO_VOCAB for i in ids):
        assert error_code(answer) == "context_length_exceeded", answer.short()
    elif plain and ids and any(not 0 <= i < DEMO_VOCAB for i in ids):
        assert answer.status == 400, answer.short()


@given(temperature=st.one_of(floats, st.sampled_from([0, 0.7, 2])), top_p=st.one_of(floats, st.just(1)),
       top_k=st.one_of(big_ints, st.integers(0, 2 * DEMO_VOCAB)), min_p=floats, seed=st.one_of(st.none(), big_ints),
       penalties=st.tuples(st.one_of(st.none(), floats), st.one_of(st.none(), floats), st.one_of(st.none(), floats)),
       logit_bias=st.dictionaries(st.one_of(st.integers(0, DEMO_VOCAB + 10).map(str), odd_text), floats, max_size=5),
       stop=st.one_of(st.none(), odd_text, st.lists(odd_text, max_size=6)),
       path=st.sampled_from([CHAT, COMPLETIONS]), model=st.sampled_from(["default", "second", "fast"]))
@fuzz_settings(30)
def test_sampling_parameters_reach_the_worker(engine, baseline, temperature, top_p, top_k, min_p, seed, penalties,
                                              logit_bias, stop, path, model):
    """Sampling settings in and out of range with a real model: a 200 with
    at most the cap of tokens, or a 400."""
    fields = dict(model=model, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                  presence_penalty=penalties[0], frequency_penalty=penalties[1], repetition_penalty=penalties[2],
                  logit_bias=logit_bias, stop=stop, max_tokens=CAP)
    body = chat_body(**fields) if path == CHAT else completion_body(**fields)
    what = f"{path} {json.dumps(fields)[:400]}"
    answer = call(engine, path, body, what)
    assert answer.status in (200, 400), what
    if answer.status == 200:
        assert answer.json()["usage"]["completion_tokens"] <= CAP


@given(ctype=content_type,
       path=st.sampled_from([CHAT, COMPLETIONS]),
       body=st.one_of(valid_json_bytes(), st.sampled_from([b"a=b&c=d", b"--x\r\n\r\n--x--", b"<xml/>", b""])))
@fuzz_settings(25)
def test_content_types(engine, baseline, ctype, path, body):
    what = f"Content-Type {ctype[:80]!r} body {body[:60]!r}"
    headers = [(b"Content-Type", ctype.encode("latin-1"))]
    answer = raw_request(TARGET, engine.url, raw_http(b"POST", path.encode(), headers, body), label_method="POST",
                         label_path=path)
    check_answer(answer, what, protocol_abuse=True)
    engine_ok(engine, what)


@given(headers=st.lists(st.tuples(header_name, header_value), max_size=12),
       many=st.one_of(st.just(0), st.integers(0, 5000)),
       route=st.sampled_from([("GET", "/health"), ("GET", "/v1/models"), ("POST", CHAT)]))
@fuzz_settings(25)
def test_header_abuse(engine, baseline, headers, many, route):
    """Odd bytes in names and values, huge values, thousands of headers:
    an answer (uvicorn's plain 400 for malformed HTTP, or no answer for a
    header block it will not read) and never a 5xx."""
    method, path = route
    extra = headers + [(b"X-Many-%d" % i, b"v") for i in range(many)]
    body = json.dumps(chat_body()).encode() if method == "POST" else b""
    data = raw_http(method.encode(), path.encode(), extra + [(b"Content-Type", b"application/json")], body)
    what = f"{method} {path} with {len(extra)} headers, first {headers[:3]!r:.300}"
    answer = raw_request(TARGET, engine.url, data, label_method=method, label_path=path,
                         half_close=promises_more_body(headers))
    check_answer(answer, what, protocol_abuse=True)
    engine_ok(engine, what)


PATHS = [p.encode() for p in ROUTES] + [b"/", b"/v1", b"/v1/", b"/v1/chat/completions/", b"/V1/CHAT/COMPLETIONS",
                                        b"/v1/chat/completions?stream=true", b"/v1//chat/completions",
                                        b"/%2e%2e/health", b"/../../etc/passwd", b"/v1/models/../../health",
                                        b"//health", b"/health%00", b"/health;x", b"/" + b"a" * 20000, b"*",
                                        b"http://evil.example/health", b"/v1/models/default", b"/docs", b"/openapi.json",
                                        b"/v1/embeddings", b"/%ff%fe", b"/\xc3\xa9", b"/health\x00", b"/v1/chat#x"]


@given(method=st.sampled_from(METHODS), path=st.sampled_from(PATHS),
       body=st.one_of(st.just(b""), valid_json_bytes()))
@fuzz_settings(40)
def test_wrong_methods_and_paths(engine, baseline, method, path, body):
    """Anything but a route's own method is a 404/405 in OpenAI's shape."""
    what = f"{method!r} {path[:80]!r}"
    headers = [(b"Content-Type", b"application/json")]
    answer = raw_request(TARGET, engine.url, raw_http(method, path, headers, body), label_method=method.decode(),
                         label_path=path.decode("latin-1"))
    check_answer(answer, what, protocol_abuse=True, no_body=method == b"HEAD")
    route = path.decode("latin-1").split("?")[0]
    if ROUTES.get(route) == method.decode() or (route in ("/openapi.json", "/docs") and method in (b"GET", b"HEAD")):
        fits = method != b"POST" or (b'"messages"' if route == CHAT else b'"prompt"') in body
        assert answer.status == (200 if fits else 400), f"{what} {body[:80]!r}: {answer.short()}"
    elif answer.status is not None and not is_protocol_400(answer):
        allowed = (400, 404, 405, 307) if route.endswith("/") else (400, 404, 405)  # 307: starlette drops a final /
        assert answer.status in allowed, f"{what}: {answer.short()}"
    engine_ok(engine, what)


@given(data=st.data(), path=st.sampled_from([CHAT, COMPLETIONS]))
@fuzz_settings(40)
def test_model_is_only_ever_a_configured_name(engine, baseline, demo_models, names, data, path):
    """Paths, traversal, URL-encoding, NUL, look-alikes: a `model` that is
    not exactly a configured id or alias is a 404 model_not_found (a 400
    over 256 characters), and nothing is loaded for it."""
    dirs = [str(demo_models.a), str(demo_models.b), str(demo_models.heavy), str(Path(demo_models.a).parent)]
    model = data.draw(model_tricks(dirs), label="model")
    loads = metric(engine.url, "mlxd_engine_model_loads")
    body = chat_body(model=model) if path == CHAT else completion_body(model=model)
    answer = call(engine, path, body, f"model={model!r}")
    if model in names:
        assert answer.status in (200, 400), answer.short()  # 400: a heavy model is refused
    else:
        assert metric(engine.url, "mlxd_engine_model_loads") == loads, f"model={model!r} loaded something"
        if 1 <= len(model) <= 256 and model == model.encode("utf-8", "replace").decode("utf-8"):
            assert answer.status == 404 and error_code(answer) == "model_not_found", answer.short()
        else:
            assert answer.status in (400, 404), answer.short()


# --- bugs this fuzz found, fixed: their reproductions -------------------------------

def test_top_k_at_or_over_the_vocabulary_is_harmless(start_engine):
    ep = start_engine()
    r = chat(ep.url, max_tokens=2, temperature=1.0, top_k=DEMO_VOCAB)
    try:
        assert r.status_code in (200, 400), r.text
    finally:
        assert wait_until(lambda: ep.proc.poll() is not None or health_status(ep.url, "xfail") == 200, 10)
    assert ep.proc.poll() is None and health_status(ep.url, "xfail") == 200


def test_huge_prompt_is_refused_without_stalling_the_worker(start_engine):
    ep = start_engine({"stuck_grace_s": 1.0, "max_prompt_tokens": 4096, "shutdown_grace_s": 0.5})
    assert chat(ep.url).status_code == 200
    before = rss_bytes(ep.proc.pid)
    r = chat(ep.url, content="a" * 2_000_000, max_tokens=1, timeout=120)  # ~3 s of tokenizing
    grown = rss_bytes(ep.proc.pid) - before
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert health_status(ep.url, "xfail") == 200
    assert grown < 100 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB for one refused request"


# --- after the fuzz --------------------------------------------------------------------

def test_engine_survived_the_fuzz(engine, baseline):
    """Runs last in this module: the same process, a valid request still
    works, no 5xx ever counted by the engine itself, RSS within the bound."""
    assert engine.proc.poll() is None and engine.proc.pid == baseline["pid"]
    assert requests.get(engine.url + "/health", timeout=10).json()["pid"] == baseline["pid"]
    r = chat(engine.url, max_tokens=8)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # (the startup's /health 503s while loading are in the baseline)
    assert server_errors_counted(engine.url) == baseline["5xx"], "the engine counted 5xx answers during the fuzz"
    rss = min(rss_bytes(engine.proc.pid) for _ in range(3))
    RECORDER.note(target=TARGET, rss_after=rss, pid=engine.proc.pid, restarts=0)
    cache_grown = cached_bytes(engine) - baseline["cache_bytes"]
    grown = rss - baseline["rss"] - cache_grown
    health = requests.get(engine.url + "/health", timeout=10).json()  # where it went, for a failure's message
    assert grown <= RSS_GROWTH_BOUND, (f"engine RSS grew {grown / 2**20:.1f} MiB during the fuzz beside its prompt "
                                       f"cache's {cache_grown / 2**20:.1f} MiB ({baseline['rss'] / 2**20:.0f} -> "
                                       f"{rss / 2**20:.0f} MiB); the engine's memory: {health.get('memory')}")

