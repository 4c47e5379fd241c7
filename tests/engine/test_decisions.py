"""The engine's pure decisions, tested as tables: admission, the one-model
cache plan, stop sequences, fault specs, the prompt-size precheck, why
decoding ends, the worker's and the engine's health, and which invalid
requests are engine limits (unsupported_parameter) rather than mistakes."""

import pytest
from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST, UNSUPPORTED_PARAMETER
from mlxd.engine.core.admission import AdmissionQueue, AdmissionState, decide_admission, retry_after_s
from mlxd.engine.model.errors import EngineError
from mlxd.engine.model.faults import Fault, parse_faults
from mlxd.engine.model.generation import answer_finish, finish_reason
from mlxd.engine.api.health import LOAD_TIMEOUT_S, health_state, stuck_reason
from mlxd.engine.api.request_job import MAX_CHARS_PER_TOKEN, check_prompt_size
from mlxd.engine.model.model_cache import Load, Unload, plan_release, plan_switch
from mlxd.engine.api.request_fields import Unsupported
from mlxd.engine.api.request_schema import ChatCompletionRequest, CompletionRequest, describe_validation_errors
from mlxd.engine.model.stop_matcher import StopMatcher
from mlxd.engine.core.worker import Phase, WorkerStatus


@pytest.mark.parametrize("waiting, running, capacity, accepting, slots, expected", [
    (0, 0, 4, True, 1, None),          # idle: admit
    (0, 1, 4, True, 1, None),          # busy, room in the line
    (3, 1, 4, True, 1, None),
    (4, 1, 4, True, 1, 429),           # line full
    (0, 0, 0, True, 1, None),          # capacity 0 still admits to an idle worker
    (0, 1, 0, True, 1, 429),           # ... but not to a busy one
    (1, 0, 1, True, 1, 429),           # someone is already waiting for the idle worker
    (0, 0, 4, False, 1, 503),          # draining / restarting
    (0, 3, 0, True, 4, None),          # batching: a free slot admits even at capacity 0
    (0, 4, 0, True, 4, 429),           # ... every slot held
    (2, 4, 2, True, 4, 429),
    (1, 4, 2, True, 4, None),
])
def test_admission_table(waiting, running, capacity, accepting, slots, expected):
    err = decide_admission(AdmissionState(waiting, running, capacity, accepting, slots), mean_service_s=2.0)
    assert (err.status if err else None) == expected
    if err is not None:
        assert err.retry_after is not None and err.retry_after >= 1
        assert err.body()["error"]["code"] in ("queue_full", "engine_unavailable")


@pytest.mark.parametrize("waiting, service, expected", [(0, 0.1, 1), (3, 2.0, 8), (100, 10.0, 60)])
def test_retry_after_is_bounded(waiting, service, expected):
    assert retry_after_s(waiting, service) == expected


def test_admission_queue_is_fifo_and_withdraw_frees_the_place():
    q: AdmissionQueue[str] = AdmissionQueue(capacity=2)
    assert q.offer("a") is None
    assert q.take(0) == "a"
    assert q.offer("b") is None and q.offer("c") is None
    assert q.offer("d").status == 429
    assert q.withdraw("b") is True and q.withdraw("b") is False
    assert q.offer("d") is None
    q.done("a", 1.0)
    assert [q.take(0), ] == ["c"]
    q.done("c", 1.0)
    assert q.take(0) == "d"
    q.done("d", 1.0)
    assert q.take(0.01) is None


def test_admission_queue_holds_up_to_its_slots():
    q: AdmissionQueue[str] = AdmissionQueue(capacity=1, slots=2)
    assert q.offer("a") is None and q.take(0) == "a"
    assert q.offer("b") is None and q.take(0) == "b"
    assert q.snapshot()["running"] == 2
    assert q.offer("c") is None and q.offer("d").status == 429
    with pytest.raises(AssertionError):
        q.take(0)  # every slot held
    q.done("a", 1.0)
    assert q.take(0) == "c" and q.snapshot()["running"] == 2


def test_admission_queue_close_returns_waiters_and_refuses():
    q: AdmissionQueue[str] = AdmissionQueue(capacity=4)
    q.offer("a"), q.offer("b")
    assert q.close() == ["a", "b"]
    assert q.offer("c").status == 503


@pytest.mark.parametrize("resident, wanted, steps", [
    (None, "a", [Load("a")]),
    ("a", "a", []),
    ("a", "b", [Unload("a"), Load("b")]),  # unload strictly before load: never two resident
])
def test_plan_switch(resident, wanted, steps):
    assert plan_switch(resident, wanted) == steps


def test_plan_release():
    assert plan_release(None) == [] and plan_release("a") == [Unload("a")]


@pytest.mark.parametrize("stops, pieces, emitted, stopped", [
    ([], ["ab", "cd"], "abcd", False),
    (["\n\n"], ["ab\n", "\ncd"], "ab", True),                 # stop straddles two pieces
    (["END"], ["xE", "N", "Dy"], "x", True),
    (["END"], ["xE", "N", "x"], "xENx", False),                # a false start is released
    (["END"], ["xEN"], "xEN", False),                          # ... and flushed at the end
    (["ab", "b"], ["xab"], "x", True),                         # earliest match wins
    (["stop"], ["", "st", "", "op"], "", True),
])
def test_stop_matcher(stops, pieces, emitted, stopped):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == emitted and m.stopped == stopped


@pytest.mark.parametrize("stops, pieces, matched", [
    (["ab", "b"], ["xab"], "ab"),      # the first to occur
    (["b", "ab"], ["xab"], "ab"),
    (["xy", "ab"], ["ab", "xy"], "ab"),
    (["END"], ["xE", "N", "Dy"], "END"),
    (["END"], ["xEN"], None),          # no stop string ended it
])
def test_stop_matcher_names_the_stop_string_that_ended_the_text(stops, pieces, matched):
    m = StopMatcher(stops)
    for p in pieces:
        m.feed(p)
    assert m.matched == matched


@pytest.mark.parametrize("spec, faults", [
    ("abort@token:3", (Fault("abort", "token", 3),)),
    ("hang@start", (Fault("hang", "start", 1),)),
    ("raise@load, abort@idle", (Fault("raise", "load"), Fault("abort", "idle"))),
    ("", ()),
])
def test_parse_faults(spec, faults):
    assert parse_faults(spec) == faults


@pytest.mark.parametrize("spec", ["explode@token", "abort", "abort@nowhere", "abort@token:x"])
def test_parse_faults_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_faults(spec)


@pytest.mark.parametrize("fault, point, tokens, fires", [
    (Fault("abort", "token", 3), "token", 2, False),
    (Fault("abort", "token", 3), "token", 3, True),
    (Fault("abort", "token", 3), "start", 0, False),
    (Fault("raise", "load"), "load", 0, True),
])
def test_fault_fires_at(fault, point, tokens, fires):
    assert fault.fires_at(point, tokens) is fires


LIMIT = 100  # max_prompt_tokens for the prompt-size table
CHARS = LIMIT * MAX_CHARS_PER_TOKEN


@pytest.mark.parametrize("messages, tools, prompt, refused", [
    (None, None, "x" * CHARS, False),
    (None, None, "x" * (CHARS + 1), True),
    (None, None, list(range(CHARS + 1)), False),           # token ids: the worker counts them exactly
    ([{"role": "user", "content": "hi"}], None, None, False),
    ([{"role": "user", "content": "x" * CHARS}], None, None, True),  # the JSON around it counts too
    ([{"role": "user", "content": "", "name": "n" * CHARS}], None, None, True),  # not only the content
    ([{"role": "user", "content": "hi"}], [{"description": "d" * CHARS}], None, True),  # tool schemas count
])
def test_prompt_size_precheck(messages, tools, prompt, refused):
    if not refused:
        check_prompt_size(messages, tools, prompt, LIMIT)
        return
    with pytest.raises(EngineError) as err:
        check_prompt_size(messages, tools, prompt, LIMIT)
    assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", "messages")


@pytest.mark.parametrize("stopped, model_finish, cancelled, past_deadline, expected", [
    (False, None, False, False, None),              # go on
    (True, None, False, False, "stop"),             # a stop string
    (False, "stop", False, False, "stop"),          # the model's end of sequence
    (False, "length", False, False, "length"),      # max_tokens
    (False, None, True, False, "cancelled"),
    (False, None, False, True, "deadline"),
    (True, "length", True, True, "stop"),           # a stop string wins over everything
    (False, "length", True, True, "length"),        # a finished answer is not a cancelled one
    (False, None, True, True, "cancelled"),         # cancelled, not answered as complete
])
def test_finish_reason(stopped, model_finish, cancelled, past_deadline, expected):
    assert finish_reason(stopped, model_finish, cancelled, past_deadline) == expected


@pytest.mark.parametrize("finish, called_tools, expected", [
    ("stop", True, "tool_calls"),
    ("stop", False, "stop"),
    ("length", True, "length"),  # cut off after a tool call: still "length"
])
def test_answer_finish(finish, called_tools, expected):
    assert answer_finish(finish, called_tools) == expected


@pytest.mark.parametrize("phase, since_ago, progress_ago, stuck", [
    (Phase.DECODE, 0.0, 5.0, False),
    (Phase.DECODE, 0.0, 31.0, True),                # past stuck_grace_s without a token
    (Phase.PREFILL, 0.0, 31.0, True),
    (Phase.IDLE, 100.0, 100.0, False),              # idle is never stuck
    (Phase.LOADING, 60.0, 60.0, False),             # loads may take long ...
    (Phase.LOADING, LOAD_TIMEOUT_S + 1, 0.0, True),  # ... but not forever
])
def test_stuck_reason(phase, since_ago, progress_ago, stuck):
    now = 10_000.0
    status = WorkerStatus(phase, "m", since=now - since_ago, last_progress=now - progress_ago)
    reason = stuck_reason(status, now, stuck_grace_s=30.0)
    assert (reason is not None) == stuck


@pytest.mark.parametrize("alive, phase, exiting, unhealthy, draining, ready, expected", [
    (True, Phase.IDLE, None, None, False, True, "ok"),
    (True, Phase.STARTING, None, None, False, False, "loading"),
    (True, Phase.IDLE, None, None, True, True, "draining"),
    (True, Phase.DECODE, None, "stuck: x", True, True, "unhealthy"),   # stuck beats draining
    (True, Phase.FAILED, "fatal: x", "stuck: x", True, True, "exiting"),  # a fatal exit beats stuck
    (False, Phase.FAILED, "fatal: x", None, False, True, "unhealthy"),  # a dead worker beats all
    (True, Phase.FAILED, None, None, False, True, "exiting"),  # failed, before the loop heard: never ok
    (False, Phase.STOPPED, None, None, True, True, "draining"),        # stopped on purpose
])
def test_health_state(alive, phase, exiting, unhealthy, draining, ready, expected):
    status, reason = health_state(alive, phase, exiting, unhealthy, draining, ready)
    assert status == expected and (reason is None) == (status == "ok")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def validation_code(schema, body) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        schema.model_validate(body)
    message, _, code = describe_validation_errors(caught.value.errors())
    return message, code


@pytest.mark.parametrize("schema, body, code", [
    (ChatCompletionRequest, {**CHAT, "n": 2}, UNSUPPORTED_PARAMETER),
    (ChatCompletionRequest, {**CHAT, "logprobs": True}, UNSUPPORTED_PARAMETER),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "array", "uniqueItems": True}}}}, UNSUPPORTED_PARAMETER),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema"}}, INVALID_REQUEST),
    (CompletionRequest, {**TEXT, "echo": True}, UNSUPPORTED_PARAMETER),
    (CompletionRequest, {**TEXT, "suffix": "}"}, UNSUPPORTED_PARAMETER),
    (ChatCompletionRequest, {**CHAT, "n": 2, "logprobs": 1}, UNSUPPORTED_PARAMETER),  # limits only
    (ChatCompletionRequest, {**CHAT, "n": 2, "temperature": 9}, INVALID_REQUEST),  # one mistake decides
    (ChatCompletionRequest, {**CHAT, "temperature": 9}, INVALID_REQUEST),
    (ChatCompletionRequest, {**CHAT, "stop": list("abcde")}, INVALID_REQUEST),
    (ChatCompletionRequest, {**CHAT, "messages": []}, INVALID_REQUEST),
    (CompletionRequest, {**TEXT, "prompt": ["a", "b"]}, INVALID_REQUEST),  # Ollama takes one prompt too
])
def test_which_invalid_requests_are_engine_limits(schema, body, code):
    assert validation_code(schema, body)[1] == code


def test_an_engine_limits_message_is_as_before():
    assert validation_code(ChatCompletionRequest, {**CHAT, "n": 2}) == (
        "n: Value error, only n=1 is supported (the engine generates one sequence at a time)", UNSUPPORTED_PARAMETER)


@pytest.mark.parametrize("raised, code", [
    (Unsupported("anything at all"), UNSUPPORTED_PARAMETER),
    (ValueError("logprobs are not supported by this engine"), INVALID_REQUEST),  # the wording alone decides nothing
    (ValueError("only n=1 is supported"), INVALID_REQUEST),
    (None, INVALID_REQUEST),  # pydantic's own checks carry no raised error
])
def test_the_code_follows_the_errors_type_not_its_wording(raised, code):
    error = {"type": "value_error", "loc": ("body", "n"), "msg": f"Value error, {raised}"}
    if raised is not None:
        error["ctx"] = {"error": raised}
    assert describe_validation_errors([error]) == (f"n: Value error, {raised}", "n", code)
    assert describe_validation_errors([]) == ("invalid request", None, INVALID_REQUEST)


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 8192}, 8192),
    ({}, None),
    ({"max_position_embeddings": 0}, None),
    ({"max_position_embeddings": "8192"}, None),
])
def test_a_models_context_from_its_config(config, expected):
    from mlxd.engine.model.model_load import context_tokens

    assert context_tokens(config) == expected
