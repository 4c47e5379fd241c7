"""The gateway's decisions as tables: the key guard's verdict, where the
fast path sends a request, what the client sees after the engine refuses,
the model name in relayed bytes, error rewriting and readiness (pure)."""

import json
from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.gateway.app import admit, rewrite_backend_error
from mlxd.gateway.errors import ApiError
from mlxd.gateway.health import readiness
from mlxd.gateway.routing import (AfterRefusal, engine_restarting, hold_for_restart, lost_together, FastRoutes, StreamRenamer, ToEngine, ToLiteLLM, after_refusal,
                                  rename_model, route_request)

MODELS = {"small": {"repo": "mlx-community/Qwen3-4B-4bit", "ollama": "qwen3:4b"},
          "huge": {"repo": "mlx-community/Llama-3.3-70B-Instruct-4bit", "ollama": "llama3.3:70b"}}
ALIASES = {"coding": "huge", "fast": "small", "default": "small", "reasoning": "small"}
ROUTES = FastRoutes.plan(parse_config({"models": MODELS, "aliases": ALIASES}, Path("/nonexistent")), {"huge": True})
WITH_EMBEDDINGS = FastRoutes.plan(parse_config({"models": MODELS, "aliases": ALIASES,
                                                "embeddings": {"embedding": {"path": "/x"}}}, Path("/nonexistent")),
                                   {"huge": True})
EMBED = "/v1/embeddings"
ONLY_LIGHT = FastRoutes.plan(parse_config({"models": MODELS, "aliases": ALIASES, "gateway": {"only_light": True}},
                                          Path("/nonexistent")), {"huge": True})
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def chat(model, **extra) -> bytes:
    return json.dumps({"model": model, "messages": HI, **extra}).encode()


def error_code(decision):
    return decision.code if isinstance(decision, ApiError) else type(decision).__name__


@pytest.mark.parametrize("routes, path, body, expected", [
    (ROUTES, CHAT, chat("small"), "ToEngine"),
    (ROUTES, CHAT, chat("fast"), "ToEngine"),  # the engine knows aliases itself
    (ROUTES, CHAT, chat("coding"), "ToLiteLLM"),  # heavy: Ollama through LiteLLM
    (ROUTES, CHAT, chat("small--ollama"), "ToLiteLLM"),  # the explicit Ollama twin
    (ROUTES, CHAT, chat("nope"), "model_not_found"),
    (ROUTES, CHAT, chat("small,huge"), "model_not_found"),  # never LiteLLM's fan-out
    (ROUTES, CHAT, chat(None), "invalid_request"),  # the request models want a string
    (ROUTES, CHAT, b"", "invalid_request"),
    (ROUTES, CHAT, b"[1, 2]", "invalid_request"),
    (ROUTES, CHAT, b"{not json", "invalid_request"),
    (ROUTES, CHAT, b"[" * 100_000, "invalid_request"),  # nesting too deep to parse
    (ROUTES, CHAT, json.dumps({"model": "small", "messages": []}).encode(), "invalid_request"),
    (ROUTES, CHAT, chat("small", n=2), "ToEngine"),  # an engine limit, not malformed: Ollama may serve it
    (ROUTES, "/v1/completions", json.dumps({"model": "coding", "prompt": [1, 2]}).encode(),
     "unsupported_parameter"),  # token ids need the engine
    (ROUTES, CHAT, json.dumps({"model": "coding", "messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]}).encode(), "unsupported_parameter"),
    (ONLY_LIGHT, CHAT, chat("coding"), "ToEngine"),  # only_light: every alias is the light model on MLX
    (WITH_EMBEDDINGS, EMBED, json.dumps({"model": "embedding", "input": "x"}).encode(), "ToEngine"),
    (WITH_EMBEDDINGS, EMBED, json.dumps({"model": "embedding--ollama", "input": "x"}).encode(), "ToLiteLLM"),
    (WITH_EMBEDDINGS, EMBED, json.dumps({"model": "small", "input": "x"}).encode(), "invalid_request"),
    (WITH_EMBEDDINGS, CHAT, chat("embedding"), "invalid_request"),  # an encoder does not chat
    (WITH_EMBEDDINGS, EMBED, json.dumps({"model": "embedding", "input": []}).encode(), "invalid_request"),
    (WITH_EMBEDDINGS, EMBED, json.dumps({"model": "nope", "input": "x"}).encode(), "model_not_found"),
    (ROUTES, EMBED, json.dumps({"model": "small", "input": "x"}).encode(), "invalid_request"),  # none configured
])
def test_where_a_request_goes(routes, path, body, expected):
    assert error_code(route_request(path, body, routes)) == expected


@pytest.mark.parametrize("body, says", [
    (b"", "the request body is empty"),
    (b"{not json", "is not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"model": "small", "response_format": ' + b'{"a": ' * 1200 + b"1" + b"}" * 1201, "nests JSON arrays and "
     "objects too deep"),  # a 1,200-level schema: never called "not a JSON object"
])
def test_a_malformed_body_is_told_what_is_wrong(body, says):
    decision = route_request(CHAT, body, ROUTES)
    assert isinstance(decision, ApiError) and decision.status == 400 and says in decision.message, decision


def test_an_only_light_alias_reaches_the_engine_under_the_light_models_name():
    to = route_request(CHAT, chat("coding", max_tokens=3), ONLY_LIGHT)
    assert to == ToEngine(to.body, "coding", "small")
    assert json.loads(to.body) == {"model": "small", "messages": HI, "max_tokens": 3}
    assert route_request(CHAT, chat("small"), ROUTES) == ToEngine(chat("small"), "small", None)  # bytes as sent
    assert route_request(CHAT, chat("huge"), ROUTES) == ToLiteLLM()


RESPONSES = "/v1/responses"


def responses(model, **extra) -> bytes:
    return json.dumps({"model": model, "input": "hi", **extra}).encode()


@pytest.mark.parametrize("body, expected", [
    (responses("small"), "ToEngine"),
    (responses("coding"), "ToLiteLLM"),  # heavy: LiteLLM's Responses bridge to Ollama's chat
    (json.dumps({"model": "small"}).encode(), "invalid_request"),  # no input, no previous_response_id
    # What the engine cannot honour LiteLLM's bridge would drop without a word: refused here, for any model.
    (responses("small", tools=[{"type": "web_search"}]), "unsupported_parameter"),
    (responses("coding", tools=[{"type": "file_search"}]), "unsupported_parameter"),
    (responses("small", background=True), "unsupported_parameter"),
    (responses("coding", conversation="conv_1"), "unsupported_parameter"),
    # A stored conversation is the engine's alone.
    (responses("coding", previous_response_id="resp_1"), "unsupported_parameter"),
    (responses("small", previous_response_id="resp_1"), "ToEngine"),
])
def test_where_a_responses_request_goes(body, expected):
    assert error_code(route_request(RESPONSES, body, ROUTES)) == expected


def test_a_continued_response_stays_with_the_engine():
    assert route_request(RESPONSES, responses("small", previous_response_id="resp_1"), ROUTES).stays
    assert not route_request(RESPONSES, responses("small"), ROUTES).stays
    refused = route_request(RESPONSES, responses("small", tools=[{"type": "web_search"}]), ROUTES)
    assert refused.param == "tools" and "web_search" in refused.message


@pytest.mark.parametrize("status, code, expected", [
    (400, "invalid_request", AfterRefusal.ENGINE_ANSWER),
    (400, "invalid_messages", AfterRefusal.ENGINE_ANSWER),
    (400, "previous_response_not_found", AfterRefusal.ENGINE_ANSWER),
    (400, "model_too_large", AfterRefusal.FALL_BACK_UNLESS_500),
    (400, "unsupported_parameter", AfterRefusal.FALL_BACK_UNLESS_500),
    (400, "request_quarantined", AfterRefusal.FALL_BACK_UNLESS_500),
    (400, "context_length_exceeded", AfterRefusal.FALL_BACK_UNLESS_500),
    (429, "queue_full", AfterRefusal.FALL_BACK_UNLESS_500),
    (503, "draining", AfterRefusal.FALL_BACK),
    (500, "invalid_request", AfterRefusal.FALL_BACK),
    (400, None, AfterRefusal.FALL_BACK_UNLESS_500),
])
def test_what_follows_an_engine_refusal(status, code, expected):
    body = b"not json" if code is None else ApiError(status, "m", code).body()
    assert after_refusal(status, body) is expected


@pytest.mark.parametrize("code, expected", [
    ("context_length_exceeded", AfterRefusal.ENGINE_ANSWER),  # Ollama's twin would cut the input silently
    ("invalid_request", AfterRefusal.ENGINE_ANSWER),
    ("model_load_failed", AfterRefusal.FALL_BACK_UNLESS_500),
])
def test_what_follows_an_embedding_refusal(code, expected):
    assert after_refusal(400, ApiError(400, "m", code).body(), "/v1/embeddings") is expected


@pytest.mark.parametrize("lost_in_flight, retries, mode, restarting, wait_s, hold", [
    (True, 0, "backoff", True, 60, True),      # it died under the request: the supervisor is bringing it back
    (True, 0, "running", False, 60, True),     # the listener has not seen the death yet
    (True, 0, None, False, 60, True),          # no supervisor's word (an engine of its own): the wait is bounded
    (False, 0, "backoff", True, 60, True),     # refused while a restart is under way: wait for it, not Ollama
    (False, 0, "running", True, 60, True),     # the restarted process is still importing, loading
    (False, 0, "running", False, 60, False),   # refused with no restart under way: Ollama at once
    (False, 0, None, False, 60, False),
    (True, 1, "backoff", True, 60, False),     # died twice under it, alone the first time: the quarantine's, Ollama's
    (True, 0, "degraded", False, 60, False),   # a crash loop's cool-down: no engine for minutes
    (False, 0, "stopped", False, 60, False),   # an operator stopped it
    (True, 0, "stopped", False, 60, False),
    (True, 0, "backoff", True, 0, False),      # crash_retry_wait_s = 0: the fallback at once
])
def test_which_requests_wait_for_the_restarted_engine(lost_in_flight, retries, mode, restarting, wait_s, hold):
    assert hold_for_restart(lost_in_flight, retries, mode, restarting, wait_s) is hold


@pytest.mark.parametrize("retries, shared, restart_in_s, hold", [
    (1, True, 0.2, True),     # lost with others at the first crash, again at the next: a bystander queued behind
    (1, True, None, True),    # (the engine starting, not in backoff)
    (1, True, 30.0, False),   # a long backoff: it waited for one restart already, Ollama answers
    (1, False, 0.2, False),   # lost alone the first time: the likely culprit, never a third crash for it
    (2, True, 0.2, False),    # three times: Ollama's
    (0, False, 30.0, True),   # the first retry waits out any backoff (within crash_retry_wait_s)
])
def test_a_request_lost_with_others_is_retried_twice(retries, shared, restart_in_s, hold):
    assert hold_for_restart(True, retries, "backoff", True, 60, shared, restart_in_s) is hold


@pytest.mark.parametrize("at, losses, together", [
    (100.0, [100.0], False),                  # alone
    (100.0, [99.7, 100.0, 100.2], True),      # a batch lost at one crash
    (100.0, [97.0, 100.0, 103.5], False),     # others lost at other crashes
])
def test_requests_lost_at_the_same_crash(at, losses, together):
    assert lost_together(at, losses) is together


@pytest.mark.parametrize("mode, crash_times, last_exit, restarting", [
    ("backoff", [], None, True),
    ("starting", [], None, True),
    ("running", [1000.0 - 5], None, True),             # started after a crash 5 s ago: maybe still loading
    ("running", [1000.0 - 500, 1000.0 - 61], None, False),  # the last crash is past the window
    ("running", [], None, False),                      # the first start (no crash, no exit): Ollama meanwhile
    ("running", [1000.0 - 500], 1000.0 - 0.1, True),   # it died a moment ago; the listener has not said so yet
    ("running", [], 1000.0 - 61, False),               # an exit long ago
    ("stopped", [1000.0 - 5], 1000.0 - 1, False),
    ("degraded", [1000.0 - 5], 1000.0 - 1, False),
    (None, [], 1000.0 - 1, False),                     # no supervisor: no restart is coming
])
def test_when_a_restart_is_under_way(mode, crash_times, last_exit, restarting):
    assert engine_restarting(mode, crash_times, last_exit, now=1000.0, window_s=60.0) is restarting


@pytest.mark.parametrize("extra, at_the_gateway, after_the_engine", [
    ({"n": 2}, "ToEngine", AfterRefusal.FALL_BACK_UNLESS_500),
    ({"logprobs": True}, "ToEngine", AfterRefusal.FALL_BACK_UNLESS_500),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "ToEngine", AfterRefusal.FALL_BACK_UNLESS_500),  # a schema feature the engine cannot enforce
    ({"n": 2, "temperature": 9}, "invalid_request", AfterRefusal.ENGINE_ANSWER),  # a mistake as well as a limit
    ({"temperature": 9}, "invalid_request", AfterRefusal.ENGINE_ANSWER),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_request", AfterRefusal.ENGINE_ANSWER),
])
def test_which_invalid_requests_fall_back(extra, at_the_gateway, after_the_engine):
    """One decision on both sides, by the error's code: the gateway refuses a
    malformed body itself and lets an engine limit through; the engine's 400
    for that limit then sends it on to Ollama."""
    from pydantic import ValidationError

    from mlxd.engine.model.errors import EngineError
    from mlxd.engine.api.request_schema import ChatCompletionRequest, describe_validation_errors

    body = {"model": "small", "messages": HI, **extra}
    assert error_code(route_request(CHAT, json.dumps(body).encode(), ROUTES)) == at_the_gateway
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    message, param, code = describe_validation_errors(caught.value.errors())
    engine_answer = json.dumps(EngineError(400, message, code=code, param=param).body()).encode()
    assert after_refusal(400, engine_answer) is after_the_engine


SSE = [b'data: {"id":"c1","object":"chat.completion.chunk","model":"small","choices":[]}\n\n',
       b'data: {"id": "c1", "model" : "small", "choices": [{"delta": {"content": "\\"model\\": \\"small\\""}}]}\n\n',
       b"data: [DONE]\n\n"]


@pytest.mark.parametrize("crlf", [False, True])
def test_the_model_name_in_a_stream_does_not_depend_on_chunking_or_spacing(crlf):
    stream = b"".join(SSE).replace(b"\n", b"\r\n") if crlf else b"".join(SSE)
    expected = stream.replace(b'"model":"small"', b'"model":"coding"').replace(b'"model" : "small"',
                                                                                b'"model" : "coding"')
    for size in range(1, 40):
        renamer = StreamRenamer("small", "coding")
        out = b"".join(renamer.feed(stream[i:i + size]) for i in range(0, len(stream), size)) + renamer.flush()
        assert out == expected, size
    assert b'\\"model\\": \\"small\\"' in expected  # content that only looks like the field stays


def test_a_whole_answer_gets_the_public_name():
    assert json.loads(rename_model(b'{"model": "small", "x": 1}', "coding")) == {"model": "coding", "x": 1}


KEY = "sk-mlxd-right"


@pytest.mark.parametrize("scope_type, path, key, given, expected", [
    ("http", "/v1/chat/completions", KEY, KEY, None),
    ("http", "/v1/models/small", KEY, KEY, None),
    ("http", "/v1/chat/completions", KEY, None, 401),
    ("http", "/v1/chat/completions", KEY, KEY + "x", 401),
    ("http", "/v1/chat/completions", None, KEY, 401),  # no key file: nothing is served
    ("http", "/key/generate", KEY, KEY, 404),  # LiteLLM's admin routes are not served
    ("http", "/key/generate", KEY, None, 401),  # ... and the key is checked first
    ("websocket", "/v1/chat/completions", KEY, KEY, 404),
])
def test_the_key_guard(scope_type, path, key, given, expected):
    refusal = admit(scope_type, path, key, given)
    assert (refusal and refusal.status) == expected
    if refusal is not None:
        assert set(json.loads(refusal.body())["error"]) == {"message", "type", "param", "code"}


FALLBACK_FAILED = json.dumps({"error": {"message": "Connection refused. Fallback to x--ollama also failed",
                                        "type": None}}).encode()


@pytest.mark.parametrize("status, body, expected_status, expected_code, expected_type", [
    (500, FALLBACK_FAILED, 503, "backends_unavailable", "service_unavailable_error"),
    (404, b'{"detail": "Not Found"}', 404, "not_found", "invalid_request_error"),
    (405, b'{"detail": "Method Not Allowed"}', 405, "method_not_allowed", "invalid_request_error"),
    (500, b"Internal Server Error", 500, "gateway_error", "server_error"),
    (429, b'{"error": {"message": "slow down", "type": null, "code": "429"}}', 429, "rate_limited", "rate_limit_error"),
    # LiteLLM's numeric codes become words; a word stands
    (400, b'{"error": {"message": "bad", "type": "invalid_request_error", "code": "400"}}', 400, "invalid_request",
     "invalid_request_error"),
    (400, b'{"error": {"message": "bad", "type": "x", "code": "unsupported_parameter"}}', 400, "unsupported_parameter",
     "x"),
])
def test_backend_errors_become_openai_shaped(status, body, expected_status, expected_code, expected_type):
    new_status, new_body = rewrite_backend_error(status, body)
    err = json.loads(new_body)["error"]
    assert (new_status, err["code"], err["type"]) == (expected_status, expected_code, expected_type)


@pytest.mark.parametrize("path, status, body, expected", [
    # LiteLLM's (OpenAI-shaped) errors on Anthropic's route: Anthropic's shape, the code kept
    ("/v1/messages", 503, ApiError(503, "no backend", "backends_unavailable").body(),
     {"type": "error", "error": {"type": "overloaded_error", "message": "no backend", "code": "backends_unavailable",
                                 "param": None}}),
    ("/v1/messages/count_tokens", 400, b'{"error": {"message": "bad", "type": "x", "code": null}}',
     {"type": "error", "error": {"type": "invalid_request_error", "message": "bad", "code": "invalid_request",
                                 "param": None}}),
    # the engine's own (already Anthropic's), and every other route's, as they are
    ("/v1/messages", 400, ApiError(400, "bad", "invalid_request").body("/v1/messages"), None),
    ("/v1/chat/completions", 503, ApiError(503, "no backend", "backends_unavailable").body(), None),
    ("/v1/messages", 500, b"plain text", None),
    ("/v1/messages", 500, b"[1]", None),
])
def test_errors_on_anthropics_routes_get_its_shape(path, status, body, expected):
    from mlxd.gateway.app import in_route_shape

    assert json.loads(in_route_shape(path, status, body)) == expected if expected else \
        in_route_shape(path, status, body) == body


@pytest.mark.parametrize("engine, ollama, status", [(True, True, 200), (True, False, 200), (False, True, 200),
                                                    (False, False, 503)])
def test_ready_when_a_backend_can_answer(engine, ollama, status):
    got_status, doc = readiness(engine, ollama)
    assert got_status == status and set(doc) == {"status", "db"}


MESSAGES = "/v1/messages"


def messages(model, **extra) -> bytes:
    return json.dumps({"model": model, "max_tokens": 8, "messages": HI, **extra}).encode()


@pytest.mark.parametrize("body, expected", [
    (messages("small"), "ToEngine"),  # Anthropic's Messages API: the engine's own route
    (messages("coding"), "ToLiteLLM"),  # heavy: LiteLLM's Anthropic adapter to Ollama
    (json.dumps({"model": "small", "messages": HI}).encode(), "invalid_request"),  # max_tokens is required
    (messages("small", messages=[{"role": "tool", "content": "x"}]), "invalid_request"),
    (messages("small", messages=[*HI, {"role": "system", "content": "a reminder"}]), "ToEngine"),  # Claude Code's
    (messages("small", tool_choice={"type": "tool"}), "invalid_request"),  # which tool?
    # An engine limit: LiteLLM's adapter may still get Ollama to serve it.
    (messages("small", messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}]),
     "ToEngine"),
    (messages("nope"), "model_not_found"),
])
def test_where_a_messages_request_goes(body, expected):
    assert error_code(route_request(MESSAGES, body, ROUTES)) == expected


def test_the_gateways_own_errors_on_the_messages_route_have_anthropics_shape():
    refused = route_request(MESSAGES, json.dumps({"model": "small", "messages": HI}).encode(), ROUTES)
    body = json.loads(refused.body(MESSAGES))
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_request" and "max_tokens" in body["error"]["message"]
    missing = json.loads(route_request(MESSAGES, messages("nope"), ROUTES).body(MESSAGES))
    assert missing["error"]["type"] == "not_found_error" and missing["error"]["code"] == "model_not_found"
    assert "type" not in json.loads(refused.body(CHAT))  # OpenAI's shape elsewhere
    # what follows the engine's refusal reads the code inside Anthropic's shape as inside OpenAI's
    engine_said = ApiError(400, "bad", "invalid_request").body(MESSAGES)
    assert after_refusal(400, engine_said, MESSAGES) is AfterRefusal.ENGINE_ANSWER
    assert after_refusal(400, ApiError(400, "no", "unsupported_parameter").body(MESSAGES),
                         MESSAGES) is AfterRefusal.FALL_BACK_UNLESS_500


def test_what_the_failed_fallback_said_is_one_short_line_beside_the_engines_error():
    from mlxd.gateway.routing import failed_fallback_note

    fallback = json.dumps({"error": {"message": "litellm.APIConnectionError: Ollama_chatException - Cannot\n connect "
                                                "to host 127.0.0.1:11434 " + "x" * 500, "type": None,
                                     "code": "400"}}).encode()
    note = failed_fallback_note(fallback)
    assert note.startswith(b"the Ollama fallback failed too: Cannot connect to host 127.0.0.1:11434 x")
    assert len(note) == 200 and b"\n" not in note and b"Exception" not in note
    assert failed_fallback_note(b"not json") == b"the Ollama fallback failed too: not json"
    litellms = json.dumps({"error": {"message": "litellm.BadRequestError: OpenAIException - the engine's words\n\n"
                                                "LiteLLM: model group 'coding' failed with the error above. Fallback to "
                                                "coding--ollama also failed: litellm.APIConnectionError: "
                                                "APIConnectionError: OpenAIException - Unmapped prompt format."}})
    assert failed_fallback_note(litellms.encode()) == b"coding--ollama failed too: Unmapped prompt format."
    assert failed_fallback_note("caf\u00e9".encode()).isascii()
    # cut where a space falls at the end: trimmed, or h11 refuses the header and the connection drops (found by fuzz)
    spaced = json.dumps({"error": {"message": "x" * 167 + " tail words"}}).encode()  # the 200th character a space
    assert not failed_fallback_note(spaced).endswith(b" ")
    import h11

    h11.Response(status_code=400, headers=[("x-mlxd-fallback", failed_fallback_note(spaced))])  # a valid header


@pytest.mark.parametrize("message, code, note", [
    # LiteLLM relayed the engine's refusal, then its fallback failed: the engine's error whole, the fallback apart
    ('litellm.BadRequestError: OpenAIException - {"error":{"message":"previous response x not found","type":'
     '"invalid_request_error","param":"previous_response_id","code":"previous_response_not_found"}}\n\nLiteLLM: '
     "model group 'default' failed with the error above. Fallback to default--ollama also failed: "
     "litellm.APIConnectionError: Ollama_chatException - Cannot connect to host 127.0.0.1:11434",
     "previous_response_not_found", b"default--ollama failed too: Cannot connect to host 127.0.0.1:11434"),
    # the engine's error with no fallback after it
    ('litellm.RateLimitError: OpenAIException - {"error":{"message":"busy","type":"rate_limit_error","param":null,'
     '"code":"engine_busy"}}', "engine_busy", None),
    # not an engine's error: left to rewrite_backend_error
    ("litellm.BadRequestError: OpenAIException - not json at all", None, None),
    ('litellm.BadRequestError: OpenAIException - {"error":{"message":"x","code":"400"}}', None, None),
    ("Fallback to default--ollama also failed: nothing", None, None),
    # a 429's: LiteLLM keeps only the engine's message; its code comes in the engine's header (below)
    ("litellm.RateLimitError: RateLimitError: OpenAIException - the engine is busy: 1 request(s) already waiting"
     "\n\nLiteLLM: model group 'lonely' failed with the error above. Fallback to lonely--ollama also failed: "
     "litellm.NotFoundError: Ollama_chatException - {\"error\":\"model 'missing:1b' not found\"}",
     "queue_full", b"lonely--ollama failed too: {\"error\":\"model 'missing:1b' not found\"}"),
])
def test_an_engines_error_relayed_by_litellm_reaches_the_client_as_the_engine_wrote_it(message, code, note):
    from mlxd.gateway.app import unwrap_engine_error

    body = json.dumps({"error": {"message": message, "type": None, "param": None, "code": "400"}}).encode()
    out, got_note = unwrap_engine_error(429, body, {"llm_provider-x-mlxd-error-code": "queue_full"}
                                        if "RateLimitError" in message else {})
    if code is None:
        assert (out, got_note) == (body, None)
    else:
        err = json.loads(out)["error"]
        assert err["code"] == code and "litellm" not in err["message"] and "Fallback" not in err["message"]
        assert not err["message"].startswith(("RateLimitError", "OpenAIException")) and got_note == note


def test_without_the_engines_header_a_text_only_error_is_left_to_litellms_rewrite():
    from mlxd.gateway.app import unwrap_engine_error

    body = json.dumps({"error": {"message": "litellm.RateLimitError: RateLimitError: OpenAIException - busy",
                                 "type": None, "code": "429"}}).encode()
    assert unwrap_engine_error(429, body, {}) == (body, None)
    out, _ = unwrap_engine_error(429, body, {"llm_provider-x-mlxd-error-code": "queue_full",
                                             "llm_provider-x-mlxd-error-param": "model"})
    assert json.loads(out)["error"] == {"message": "busy", "type": "rate_limit_error", "param": "model",
                                        "code": "queue_full"}


@pytest.mark.parametrize("headers, kept", [
    ({"llm_provider-retry-after": "4"}, "4"), ({"retry-after": "2", "llm_provider-retry-after": "4"}, None),
    ({}, None),
])
def test_an_upstreams_retry_after_is_kept(headers, kept):
    from mlxd.gateway.app import kept_retry_after

    assert kept_retry_after(headers) == kept


def test_a_broken_stream_ends_in_its_apis_error_event():
    from mlxd.gateway.routing import stream_failure

    error = ApiError(503, "the engine failed mid-stream (ClientPayloadError)", "engine_failed_mid_stream")
    chat = stream_failure("/v1/chat/completions", error)
    assert chat.startswith(b"data: ") and json.loads(chat[6:])["error"]["code"] == "engine_failed_mid_stream"
    responses = stream_failure("/v1/responses", error)
    head, data = responses.split(b"\n", 1)
    event = json.loads(data.removeprefix(b"data: "))
    assert head == b"event: error" and event["type"] == "error" and event["code"] == "engine_failed_mid_stream"
    assert responses.endswith(b"\n\n") and b"[DONE]" not in responses
    anthropic = stream_failure("/v1/messages", error)
    head, data = anthropic.split(b"\n", 1)
    event = json.loads(data.removeprefix(b"data: "))
    assert head == b"event: error" and event["type"] == "error"
    assert (event["error"]["type"], event["error"]["code"]) == ("overloaded_error", "engine_failed_mid_stream")
