"""The gateway end to end: real supervisord + engine + LiteLLM proxy, with
the Ollama stand-in (a test double of Ollama's HTTP API) as the fallback,
driven with the official `openai` client and `requests`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import openai
import pytest
import requests

from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.records import EnginePid
from mlxd.supervisor.control import rpc
from mlxd.toml_text import dumps, table_lines
from testkit import metric, wait_until

pytestmark = pytest.mark.timeout(300)
FAULT_WORD = "boom"  # faults fire only for prompts with this word (MLXD_FAULT_MATCH)
OLLAMA_MODEL = "llama3.2:3b"
OLLAMA_MARK = marker(OLLAMA_MODEL).split(":")[0]  # "[ollama-standin"


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL, "llama3.1:70b")) as standin:  # stopped by pid at the end
        yield standin


@pytest.fixture(scope="module")
def st(module_stack, ollama, demo_models):
    # Crashes are this module's subject: never a crash loop's cool-down in the middle of it.
    return module_stack(
        supervisor="loop_crashes = 100\n",
        engine=table_lines({"max_queue": 1, "max_tokens_cap": 100000}),
        gateway=table_lines({"ollama_url": ollama.url, "default_ollama_model": OLLAMA_MODEL}),
        models=dumps({"models": {"big": {"path": demo_models.heavy, "ollama": "llama3.1:70b"},
                                 # Served by the engine; its Ollama twin is one the stand-in lacks: a fallback that fails.
                                 "lonely": {"path": demo_models.a, "ollama": "missing:1b"}}}),
        env={"MLXD_FAULT_MATCH": FAULT_WORD},
    )


@pytest.fixture
def client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def engine_back_to_normal(st):
    """Each test starts with no fault and a healthy engine, and leaves it so."""
    st.fault_file.unlink(missing_ok=True)
    wait_until(st.healthy, 60, what="engine healthy")
    yield
    st.fault_file.unlink(missing_ok=True)
    info = rpc(st.paths).supervisor.getProcessInfo("engine")
    if info["statename"] != "RUNNING":
        rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="engine healthy again")


def ask(client: openai.OpenAI, content: str = "hello there", model: str = "default", **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0, **kw)


def stream_text(client: openai.OpenAI, content: str, model: str = "default") -> tuple[str, list]:
    chunks = list(ask(client, content, model, stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def from_ollama(text: str | None) -> bool:
    return bool(text) and text.startswith(OLLAMA_MARK)


def test_the_engine_answers_through_the_gateway(client, st):
    r = ask(client)
    assert not from_ollama(r.choices[0].message.content) and r.usage.completion_tokens == 8
    text, chunks = stream_text(client, "hello there")
    assert not from_ollama(text) and chunks[-1].choices[0].finish_reason == "length"


def test_missing_or_wrong_key_is_401_in_openai_format(st):
    url = st.gateway_url + "/v1/chat/completions"
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"}, {"x-api-key": "no"}):
        r = requests.post(url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    # LiteLLM's admin UI (/ui/...) is none of ours: /ui is mlxd's status page, whose data needs the key.
    for path in ("/v1/models", "/health", "/key/generate", "/ui/login", "/mlxd/status"):
        assert requests.get(st.gateway_url + path, timeout=10).status_code == 401, path
    assert requests.post(url, json={**body, "max_tokens": 2}, headers={"x-api-key": st.key}, timeout=60).ok
    open_health = requests.get(st.gateway_url + "/mlxd/health", timeout=5)
    assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}  # open, and says no more
    assert os.stat(st.paths.key).st_mode & 0o777 == 0o600


def test_litellms_health_routes_answer_without_a_key_and_say_nothing_more(st):
    for path in ("/health/liveliness", "/health/liveness"):
        r = requests.get(st.gateway_url + path, timeout=5)
        assert r.status_code == 200 and r.json() == "I'm alive!", path
    healthy = {"status": "healthy", "db": "Not connected"}  # LiteLLM's own answer without a database
    r = requests.get(st.gateway_url + "/health/readiness", timeout=10)
    assert r.status_code == 200 and r.json() == healthy
    assert requests.get(st.gateway_url + "/health/readiness/details", timeout=5).status_code == 401
    rpc(st.paths).supervisor.stopProcess("engine", True)
    wait_until(lambda: not st.healthy(), 10, what="engine down")
    r = requests.get(st.gateway_url + "/health/readiness", timeout=10)
    assert r.status_code == 200 and r.json() == healthy  # Ollama can still answer


def test_key_rotation_takes_effect_without_a_restart(st):
    old = st.key
    r = st.mlxd("key", "rotate")
    assert r.returncode == 0 and old not in r.stdout
    new = st.key
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = st.gateway_url + "/v1/chat/completions"
    assert requests.post(url, json=body, headers={"Authorization": f"Bearer {old}"}, timeout=30).status_code == 401
    assert requests.post(url, json=body, headers={"Authorization": f"Bearer {new}"}, timeout=60).status_code == 200


def test_heavy_alias_goes_to_ollama_without_touching_the_engine(client, st, ollama):
    before = metric(st.url, "mlxd_engine_model_loads"), _engine_chat_requests(st)
    r = ask(client, "what is heavy", model="big")
    assert r.choices[0].message.content.startswith(marker("llama3.1:70b"))
    assert (metric(st.url, "mlxd_engine_model_loads"), _engine_chat_requests(st)) == before


def _engine_chat_requests(st) -> float:
    text = requests.get(st.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('mlxd_engine_requests_total{endpoint="/v1/chat/completions"'))


def test_stopped_engine_falls_back_quickly_and_traffic_returns(client, st):
    rpc(st.paths).supervisor.stopProcess("engine", True)
    t0 = time.monotonic()
    r = ask(client, "are you there")
    assert from_ollama(r.choices[0].message.content)
    assert time.monotonic() - t0 < 1.5  # no retry ladder
    text, _ = stream_text(client, "streamed while down")
    assert from_ollama(text) and "streamed while down" in text
    rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="engine back")
    assert not from_ollama(ask(client).choices[0].message.content)  # back to the engine at once


def test_a_request_the_engine_dies_under_is_answered_by_the_restarted_engine(client, st, ollama):
    """Killed by SIGABRT at its 3rd token (the fault fires once): the request
    waits for the supervisor's restart and the new engine answers it; the
    client sees a slower answer from its own model, not Ollama's."""
    st.fault_file.write_text("abort@token:3/once")
    before, pid = ollama.stats()["chat_requests"], st.engine_pid()
    r = ask(client, f"{FAULT_WORD} once, please")  # (its own words: a request's crashes count toward quarantine)
    assert not from_ollama(r.choices[0].message.content) and r.usage.completion_tokens == 8
    assert ollama.stats()["chat_requests"] == before and st.engine_pid() != pid
    wait_until(lambda: any(rec.klass == "sigabrt" and rec.pid == pid for rec in st.records()), 30,
               what="the crash journaled")


def test_a_stream_the_engine_dies_under_before_its_first_token_is_retried_on_the_restarted_engine(client, st, ollama):
    st.fault_file.write_text("abort@start/once")
    before, pid = ollama.stats()["chat_requests"], st.engine_pid()
    text, chunks = stream_text(client, f"{FAULT_WORD} stream me once")
    assert text and not from_ollama(text) and chunks[-1].choices[0].finish_reason == "length"
    assert ollama.stats()["chat_requests"] == before and st.engine_pid() != pid


def test_a_request_that_finds_the_engine_restarting_after_a_crash_waits_for_it(client, st, ollama):
    """Sent in the seconds a crashed engine takes to come back (the restarted
    process importing and loading): held for it, not answered by Ollama."""
    gateway_log = st.paths.logs / "gateway.log"
    held_before = gateway_log.read_text().count("is restarting; holding")
    crashes, pid = len(st.supervision()["crash_times"]), st.engine_pid()
    os.kill(pid, signal.SIGABRT)
    wait_until(lambda: len(st.supervision()["crash_times"]) > crashes, 10, what="the listener to see the crash")
    before = ollama.stats()["chat_requests"]
    r = ask(client, "are you back?")
    assert not from_ollama(r.choices[0].message.content) and ollama.stats()["chat_requests"] == before
    assert st.engine_pid() != pid and gateway_log.read_text().count("is restarting; holding") > held_before


def test_an_agents_retry_of_a_stream_cut_a_moment_ago_waits_for_the_restarted_engine(client, st, ollama):
    """A stream cut mid-answer ends with an error; the agent's client sends
    the turn again at once. A dying process can take seconds to go after its
    sockets close (a CUDA context torn down, a crash report written), so
    nothing on disk says yet that it died -- modelled here by stopping the
    runner, which records the exit, for 1.5 s. The gateway saw the death
    itself and holds the retry for the restart, not Ollama's answer in the
    middle of the conversation."""
    runner = EnginePid.read(st.paths.engine_pid).runner_pid
    st.fault_file.write_text("abort@token:40/once")  # late enough that the client has had tokens
    pid, before = st.engine_pid(), ollama.stats()["chat_requests"]
    os.kill(runner, signal.SIGSTOP)
    resume = threading.Timer(1.5, os.kill, (runner, signal.SIGCONT))  # the slow death's length, not a wait
    try:
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(model="default", stream=True, max_tokens=200, temperature=0,
                                                    messages=[{"role": "user", "content": f"{FAULT_WORD} cut me"}]):
                pass
        resume.start()
        text, chunks = stream_text(client, f"{FAULT_WORD} cut me")  # the retry, at once
    finally:
        resume.cancel()
        with contextlib.suppress(ProcessLookupError):  # resumed already, and gone with its engine
            os.kill(runner, signal.SIGCONT)
    assert text and not from_ollama(text) and chunks[-1].choices[0].finish_reason == "length"
    assert ollama.stats()["chat_requests"] == before and st.engine_pid() != pid


def test_crash_during_a_non_streaming_request_still_gives_a_complete_answer(client, st):
    # It kills the restarted engine too: after one retry, Ollama answers.
    st.fault_file.write_text("abort@token:3")
    n = sum(1 for rec in st.records() if rec.klass == "sigabrt")
    r = ask(client, f"{FAULT_WORD} please")
    assert from_ollama(r.choices[0].message.content) and r.choices[0].finish_reason in ("stop", "length")
    wait_until(lambda: sum(1 for rec in st.records() if rec.klass == "sigabrt") == n + 2, 30,
               what="both crashes journaled")


def test_engine_death_before_the_first_token_fails_the_stream_over(client, st):
    st.fault_file.write_text("abort@start")
    text, chunks = stream_text(client, f"{FAULT_WORD} stream me")
    assert from_ollama(text) and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_mid_stream_crash_is_an_explicit_error_and_never_a_silent_done(st):
    # Late enough that the client has received engine tokens: from then on a
    # fallback could only splice two answers, so it must be an explicit error.
    st.fault_file.write_text("abort@token:60")
    lines = []
    with requests.post(st.gateway_url + "/v1/chat/completions", stream=True, timeout=60,
                       headers={"Authorization": f"Bearer {st.key}"},
                       json={"model": "default", "stream": True, "max_tokens": 200, "temperature": 0,
                             "messages": [{"role": "user", "content": f"{FAULT_WORD} go"}]}) as r:
        assert r.status_code == 200
        try:
            lines = [ln for ln in r.iter_lines() if ln]
        except requests.exceptions.ChunkedEncodingError:
            pass  # a cut connection is explicit too
    from_engine = [ln for ln in lines if b'"mlxd-' in ln and b'"content"' in ln]
    assert len(from_engine) >= 10, "the engine had streamed tokens before it died"
    assert not any(OLLAMA_MARK.encode() in ln for ln in lines)  # no spliced second answer
    assert b"data: [DONE]" not in lines
    assert b'"error"' in lines[-1]  # told explicitly


@pytest.mark.parametrize("model", ["default", "lonely"])
def test_busy_engine_429_falls_back_to_ollama(client, st, model):
    """A busy engine's 429 goes to Ollama; where that fails too ("lonely"'s
    twin is not there), the client gets the engine's 429 with its
    Retry-After, not LiteLLM's error without one."""
    # One request holds the worker, one waits in the engine's 1-place queue.
    holder = requests.post(st.url + "/v1/completions", stream=True, timeout=60,
                           json={"model": "default", "prompt": "hold", "max_tokens": 100000, "stream": True,
                                 "temperature": 0})
    holder.lines = holder.iter_lines()
    next(holder.lines)
    waiter = requests.Session()
    import threading
    t = threading.Thread(target=lambda: waiter.post(st.url + "/v1/completions", timeout=60,
                                                    json={"model": "default", "prompt": "w", "max_tokens": 2}))
    t.start()
    try:
        wait_until(lambda: requests.get(st.url + "/health", timeout=5).json()["queue_depth"] == 1, 30,
                   what="engine queue full")
        if model == "default":
            assert from_ollama(ask(client, "busy?").choices[0].message.content)
        else:
            r = requests.post(st.gateway_url + "/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {st.key}"},
                              json={"model": "lonely", "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "busy?"}]})
            assert r.status_code == 429 and r.json()["error"]["message"], r.text
            assert int(r.headers["retry-after"]) >= 1, r.headers
    finally:
        holder.close()
        t.join(60)


def test_a_quarantined_request_is_answered_by_ollama(client, st):
    st.fault_file.write_text("abort@token:2")
    poison = f"{FAULT_WORD} poison request"
    n = len([r for r in st.records() if r.fingerprint])
    # It kills the engine, waits for the restart, kills it again, alone both times: quarantined, and
    # answered by Ollama. The client never notices.
    assert from_ollama(ask(client, poison).choices[0].message.content)
    wait_until(lambda: len([r for r in st.records() if r.fingerprint]) == n + 2, 30, what="both crashes journaled")
    wait_until(st.healthy, 60, what="engine back")
    wait_until(lambda: st.paths.quarantine.exists() and json.loads(st.paths.quarantine.read_text())["fingerprints"],
               10, what="quarantine list")
    direct = requests.post(st.url + "/v1/chat/completions", timeout=30,
                           json={"model": "default", "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "user", "content": poison}]})
    assert direct.status_code == 400 and direct.json()["error"]["code"] == "request_quarantined"
    assert from_ollama(ask(client, poison).choices[0].message.content)
    st.fault_file.unlink()
    assert not from_ollama(ask(client, "an ordinary question").choices[0].message.content)


def test_status_shows_the_gateway(st):
    status = st.status()
    assert status["gateway"]["http_status"] == 200 and status["overall"] == "healthy"
    names = {p["name"]: p["state"] for p in status["processes"]}
    assert names == {"engine": "RUNNING", "gateway": "RUNNING", "crashwatch": "RUNNING", "standby": "RUNNING"}


def test_the_key_is_in_no_log_and_no_generated_file(client, st):
    ask(client)
    requests.post(st.gateway_url + "/v1/chat/completions", json={}, timeout=10,
                  headers={"Authorization": "Bearer sk-mlxd-wrong"})
    key = st.key
    for path in list(st.paths.logs.rglob("*")) + list(st.paths.generated.rglob("*")) + [st.paths.supervision]:
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    assert key not in st.mlxd("status", "--json").stdout


def test_light_models_take_the_engine_fast_path(st):
    """Answers from the engine are relayed as the engine sent them (its
    X-Request-Id), not rebuilt by LiteLLM (whose x-litellm-* headers)."""
    for stream in (False, True):
        r = requests.post(st.gateway_url + "/v1/chat/completions", timeout=60, stream=stream,
                          headers={"Authorization": f"Bearer {st.key}"},
                          json={"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                "stream": stream})
        assert r.status_code == 200 and "x-request-id" in r.headers
        assert not any(h.lower().startswith("x-litellm") for h in r.headers)
        body = r.text
        assert '"model": "fast"' in body or '"model":"fast"' in body


def test_litellm_admin_routes_are_not_served_even_with_the_key(st):
    auth = {"Authorization": f"Bearer {st.key}"}
    for method, path in (("POST", "/key/generate"), ("GET", "/ui/login"), ("GET", "/user/info"), ("GET", "/health"),
                         ("GET", "/spend/logs")):
        r = requests.request(method, st.gateway_url + path, headers=auth, json={}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.status_code, r.text[:200])
    assert requests.get(st.gateway_url + "/v1/models", headers=auth, timeout=30).status_code == 200


@pytest.mark.parametrize("model", ["default", "big"])  # engine-routed, and routed to Ollama
@pytest.mark.parametrize("bad", [
    {"tools": [{"name": "f"}]},                                  # a tool without "type"/"function"
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "function", "function": {"parameters": {}}}]},  # a function without a name
    {"tools": "none"},
    {"tool_choice": {"type": "function"}},
    {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
    {"messages": [{"role": "user", "content": "hi"},  # a tool call without "type" (fuzz finding)
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "ok"}]},
], ids=lambda b: json.dumps(b)[:40])
def test_malformed_tools_and_messages_are_400_on_every_route(st, model, bad):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **bad}
    r = requests.post(st.gateway_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {st.key}"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("model", [",", "default,big", "nope", "big--ollama--ollama", "default--ollama,big"])
def test_only_configured_model_names_are_served(st, model):
    """An unknown name is 404 model_not_found in OpenAI's shape -- never
    LiteLLM's comma fan-out ("a,b"), which answers 200 with a list of errors."""
    r = requests.post(st.gateway_url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {st.key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 404, (r.status_code, r.text[:200])
    assert r.json()["error"]["code"] == "model_not_found"


def test_non_json_tool_arguments_are_400_for_a_model_served_by_ollama(client, st):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    r = requests.post(st.gateway_url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {st.key}"},
                      json={"model": "big", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and "arguments is not JSON" in r.json()["error"]["message"], r.text[:300]
    # the engine takes them as they are (a model's own slightly broken JSON, echoed back by an agent)
    assert client.chat.completions.create(model="default", messages=messages, max_tokens=2).choices


def test_a_requests_keep_alive_reaches_the_engine_through_the_gateway(client, st):
    """Ollama's per-request keep_alive, sent as the openai client sends an extra field: 0 unloads the model once
    answered (engine/core/keep_alive.py); the next request loads it again and the engine answers it, not Ollama."""
    health = lambda: requests.get(st.url + "/health", timeout=10).json()  # noqa: E731
    loads = health()["counters"]["model_loads"]
    r = ask(client, extra_body={"keep_alive": 0})
    assert not from_ollama(r.choices[0].message.content)
    wait_until(lambda: health()["resident_model"] is None, 15, what="the unload keep_alive 0 asks for")
    r = ask(client)
    assert not from_ollama(r.choices[0].message.content)
    assert health()["counters"]["model_loads"] == loads + 1 and health()["resident_model"] is not None
    with pytest.raises(openai.BadRequestError, match="not a duration"):
        ask(client, extra_body={"keep_alive": "soon"})
