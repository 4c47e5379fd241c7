"""Shared pieces of the bad-input fuzz tests (tests/fuzz/): how many
examples to run, the properties every answer must have, a raw-socket HTTP
client for inputs `requests` refuses to send, hypothesis strategies for
nasty values, and a recorder that `bench/bad_input_fuzz.py` reads for its summary.

Examples per test: a small default keeps CI short; `MLXD_FUZZ_EXAMPLES=N`
runs N per test (bench/bad_input_fuzz.py sets it for long runs).

Known bugs: inputs that hit a bug already reported (and tested as a strict
xfail in the test files) are neutralised here, so the fuzz keeps looking for
new ones; `MLXD_FUZZ_KNOWN_BUGS=1` sends them as generated. Remove an entry
once its fix lands (the strict xfail will say so).
"""

from __future__ import annotations

import copy
import gzip
import http.client
import json
import os
import socket
import string
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlsplit

import psutil
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.core import NOT_SET

# --- how much to run ----------------------------------------------------------

_ENV_EXAMPLES = int(os.environ.get("MLXD_FUZZ_EXAMPLES", "0") or 0)
SEND_KNOWN_BUGS = os.environ.get("MLXD_FUZZ_KNOWN_BUGS", "1") == "1"  # the bugs found are fixed: send everything
LONG_RUN = _ENV_EXAMPLES > 0


def examples(default: int) -> int:
    """Examples for one test: `default` in CI, MLXD_FUZZ_EXAMPLES when set."""
    return _ENV_EXAMPLES or default


def fuzz_settings(default: int) -> settings:
    """Hypothesis settings for a test against a live server: no deadline (a
    request's time is not the property), no example database (nothing is
    written into the work tree), and no health checks about slow or
    filtered data (a live server is slow by nature)."""
    # Derandomized unless asked (bench/bad_input_fuzz.py does): the same examples on
    # every run, so the test suite is repeatable; long random runs find new bugs.
    return settings(max_examples=examples(default), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True,
                    derandomize=os.environ.get("MLXD_FUZZ_RANDOM") != "1")


# Text sizes: short (up to SMALL_TEXT characters) or huge (HUGE_MIN to
# HUGE_TEXT, far over any prompt limit, so refused before a prefill: a valid
# prompt near the limit costs seconds of CPU prefill). HUGE_TEXT stays far
# below what trips the known "huge prompt" bug (tokenizing tens of MB stalls
# the worker; see the xfail in test_engine_fuzz.py).
SMALL_TEXT = 200
HUGE_MIN = 64_000  # >= 16k tokens even for units the tokenizer merges (runs of spaces)
HUGE_TEXT = 300_000 if LONG_RUN else 100_000
HUGE_UNITS = ["a", " ", "\u202e", "ab ", "\x00", "\U0001f600"]
REQUEST_TIMEOUT = 60.0

# --- the properties ------------------------------------------------------------

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
# uvicorn (h11) rejects a malformed HTTP request before any app sees it; its
# answer is this plain-text 400. Accepted only for protocol-level abuse.
PROTOCOL_400 = b"Invalid HTTP request received."


@dataclass
class Answer:
    """One HTTP exchange, whatever client made it."""

    status: int | None  # None: the server closed the connection without answering
    headers: dict[str, str]
    body: bytes
    elapsed: float = 0.0
    error: str | None = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)

    def short(self) -> str:
        return f"{self.status} {self.body[:300]!r}" + (f" ({self.error})" if self.error else "")


def decode_body(answer: Answer) -> Answer:
    """Undo a gzip/deflate Content-Encoding as a client would; a body that
    does not decode is recorded in answer.error (check_answer fails it)."""
    encoding = (answer.header("content-encoding") or "").strip().lower()
    try:
        if encoding in ("gzip", "x-gzip"):
            answer.body = gzip.decompress(answer.body)
        elif encoding == "deflate":
            answer.body = zlib.decompress(answer.body)
    except (OSError, EOFError, zlib.error) as exc:
        answer.error = f"body does not decode as its Content-Encoding {encoding!r} says: {exc}"
    return answer


def openai_error_problem(answer: Answer, null_type_ok: bool = False) -> str | None:
    """Why this error answer is not OpenAI's shape, or None when it is.
    null_type_ok: accept `"type": null` (a known gateway deviation)."""
    try:
        body = answer.json()
    except ValueError:
        return f"error body is not JSON: {answer.body[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"no 'error' object: {answer.body[:200]!r}"
    missing = OPENAI_ERROR_KEYS - err.keys()
    if missing:
        return f"error object lacks {sorted(missing)}: {answer.body[:200]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"error.message is not a non-empty string: {err['message']!r}"
    if not isinstance(err["type"], str) and not (null_type_ok and err["type"] is None):
        return f"error.type is not a string: {err['type']!r}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"error.param is neither null nor a string: {err['param']!r}"
    if err["code"] is not None and not isinstance(err["code"], (str, int)):
        return f"error.code is neither null, a string nor a number: {err['code']!r}"
    return None


def is_protocol_400(answer: Answer) -> bool:
    """uvicorn's own 400 for malformed HTTP (empty for a HEAD request)."""
    return (answer.status == 400 and (answer.header("content-type") or "").startswith("text/plain")
            and answer.body.strip() in (PROTOCOL_400, b""))


def check_answer(answer: Answer, what: str, *, protocol_abuse: bool = False, no_body: bool = False,
                 may_close: bool = False, null_type_ok: bool = False) -> None:
    """The fuzz property for one answer: no 5xx (a 429 or 503 only with
    Retry-After), and every 4xx in OpenAI's error shape.

    protocol_abuse: the request itself is malformed HTTP; uvicorn's plain
    400 is accepted. no_body: a HEAD request. may_close: the server may
    close the connection without an answer (a truncated request)."""
    if answer.status is None:
        assert may_close or (protocol_abuse and not (answer.error or "").startswith("timeout")), \
            f"{what}: no answer ({answer.error})"
        return
    assert answer.error is None, f"{what}: {answer.status} {answer.error}: {answer.body[:100]!r}"
    status = answer.status
    if status in (429, 503):
        assert answer.header("retry-after"), f"{what}: {status} without Retry-After: {answer.short()}"
    else:
        assert status < 500, f"{what}: server error {answer.short()}"
    if protocol_abuse and is_protocol_400(answer):
        return
    if 400 <= status and not no_body:
        problem = openai_error_problem(answer, null_type_ok)
        assert problem is None, f"{what}: {status} not in OpenAI's error shape: {problem}"


def error_code(answer: Answer) -> str | None:
    try:
        return answer.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# --- recording (for bench/bad_input_fuzz.py) ----------------------------------

class Recorder:
    """Counts requests by (target, endpoint, status); with MLXD_FUZZ_STATS
    set, appends one JSON line per request and per note to that file.
    Targets: engine, gateway, auth (key-less or wrong-key requests), health
    (the checks after each example), xfail (reproductions of known bugs)."""

    def __init__(self) -> None:
        self.path = os.environ.get("MLXD_FUZZ_STATS")
        self.counts: Counter = Counter()

    def request(self, target: str, method: str, path: str, status: int | None, elapsed: float,
                openapi: bool = False) -> None:
        """One request; `openapi`: generated by schemathesis from the target's document (counted per document)."""
        endpoint = path.split("?", 1)[0]
        if len(endpoint) > 40 or not endpoint.isascii() or not endpoint.isprintable():
            endpoint = "(odd path)"
        self.counts[(target, endpoint, status)] += 1
        self._write({"kind": "request", "target": target, "method": method[:16], "endpoint": endpoint,
                     "status": status, "elapsed": round(elapsed, 4), "openapi": openapi})

    def note(self, **fields: Any) -> None:
        self._write({"kind": "note", **fields})

    def _write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


RECORDER = Recorder()


# --- clients --------------------------------------------------------------------

def split_base(base: str) -> tuple[str, int, dict[str, str]]:
    """A base URL -> (host, port, the engine key's header where the URL
    carries it as its password: devkit.engine_process.with_key)."""
    url = urlsplit(base)
    return url.hostname or "", url.port or 80, {"Authorization": f"Bearer {url.password}"} if url.password else {}


def http_request(target: str, base: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """A well-formed HTTP request (the body may be anything) via http.client;
    the URL's key is sent unless `headers` name an Authorization of their own."""
    host, port, auth = split_base(base)
    if any(name.lower() == "authorization" for name in headers or {}):
        auth = {}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request(method, path, body=body, headers={**auth, **(headers or {})})
        resp = conn.getresponse()
        answer = decode_body(Answer(resp.status, dict(resp.getheaders()), resp.read()))
    except (ConnectionError, http.client.HTTPException) as exc:
        answer = Answer(None, {}, b"", error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    return _recorded(answer, started, target, method, path)


def _recorded(answer: Answer, started: float, target: str, method: str, path: str) -> Answer:
    """Stamps the answer's time and records the request for the run's summary."""
    answer.elapsed = time.monotonic() - started
    RECORDER.request(target, method, path, answer.status, answer.elapsed)
    return answer


def post_json(target: str, base: str, path: str, body: Any, headers: dict[str, str] | None = None,
              ensure_ascii: bool = True) -> Answer:
    """POST `body` as JSON. ensure_ascii=False writes lone surrogates as
    the (invalid) UTF-8 bytes of their code points."""
    raw = json.dumps(body, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    return http_request(target, base, "POST", path, raw, {"Content-Type": "application/json", **(headers or {})})


def raw_request(target: str, base: str, data: bytes, *, label_method: str = "RAW", label_path: str = "(raw)",
                half_close: bool = False, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """Bytes straight onto a socket, for requests no HTTP library would
    send (odd header bytes, bad framing). half_close: shut our side down
    after sending, for requests that promise more body than they send."""
    host, port, auth = split_base(base)
    if auth and b"\r\n" in data:  # the key after the request line, so the bytes reach the handlers
        line, rest = data.split(b"\r\n", 1)
        data = line + b"\r\nAuthorization: " + auth["Authorization"].encode() + b"\r\n" + rest
    started = time.monotonic()
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            method = data.split(b" ", 1)[0].decode("latin-1")
            resp = http.client.HTTPResponse(sock, method=method)  # HEAD: no body to read
            resp.begin()
            answer = decode_body(Answer(resp.status, dict(resp.getheaders()), resp.read()))
        except TimeoutError:
            answer = Answer(None, {}, b"", error=f"timeout: no answer within {timeout}s")
        except (OSError, http.client.HTTPException) as exc:  # e.g. the server closed first (ENOTCONN)
            answer = Answer(None, {}, b"", error=f"{type(exc).__name__}: {exc}")
    finally:
        sock.close()
    return _recorded(answer, started, target, label_method, label_path)


def promises_more_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Framing headers (chunked, a Content-Length) that may make a server
    wait for body bytes we never send: such requests are half-closed."""
    return any(name.strip().lower() in (b"transfer-encoding", b"content-length") for name, _ in headers)


def raw_http(method: bytes, path: bytes, headers: Iterable[tuple[bytes, bytes]] = (), body: bytes = b"",
             content_length: bool = True) -> bytes:
    out = method + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if content_length:
        out += b"Content-Length: %d\r\n" % len(body)
    for name, value in headers:
        out += name + b": " + value + b"\r\n"
    return out + b"\r\n" + body


# --- the engine's health and memory -----------------------------------------------

def health_status(base: str, target: str = "health") -> int | None:
    try:
        return http_request(target, base, "GET", "/health", timeout=10).status
    except OSError:
        return None


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


# --- known bugs (reported; strict xfails in the test files) -----------------------

DEMO_VOCAB = 1024  # the demo models' vocabulary size


def _as_int(value: Any) -> int | None:
    """The int pydantic (lax mode, as the engine validates) makes of a JSON value, if any."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(int).validate_python(value)
    except (ValidationError, TypeError, ValueError):
        return None


def neutralise_known_bugs(body: Any) -> Any:
    """KNOWN BUG top_k >= vocab: mlx-lm's sampler raises on it, the engine
    takes it for an MLX fault, answers 500 and exits 86. Such a top_k is
    lowered below the demo vocabulary, unless MLXD_FUZZ_KNOWN_BUGS=1."""
    if SEND_KNOWN_BUGS or not isinstance(body, dict) or "top_k" not in body:
        return body
    k = _as_int(body["top_k"])
    if k is not None and k >= DEMO_VOCAB:
        body = {**body, "top_k": DEMO_VOCAB - 1}
        RECORDER.note(neutralised="top_k_over_vocab")
    return body


def invalid_request(path: str, body: Any) -> bool:
    """Whether the engine's own request model refuses this body (the
    client's fault: a 400 is the right answer). Classifies gateway 500s."""
    from pydantic import ValidationError

    from mlxd.engine.api.request_schema import ChatCompletionRequest, CompletionRequest

    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            return True
    # OpenAI's types for fields the engine ignores (metadata) or coerces (stream: "yes")
    if isinstance(body, dict) and ((body.get("metadata") is not None and not isinstance(body["metadata"], dict))
                                   or (body.get("stream") is not None and not isinstance(body["stream"], bool))):
        return True
    try:
        (ChatCompletionRequest if path == CHAT else CompletionRequest).model_validate(body)
        return False
    except (ValidationError, ValueError, TypeError, RecursionError):
        return True


def gateway_known_bug(path: str, body: Any, answer: "Answer") -> str | None:
    """KNOWN BUG (gateway): LiteLLM's proxy does not validate request
    bodies; a wrong JSON type in a field it reads itself (a non-object
    body, `messages` not a list, `content` an int, a `developer` message
    without content, `prompt` {} or [], `tools` 5, `response_format` [],
    `metadata` "x", `stream` "yes" on completions...) raises inside it and
    the client gets a 500 (some as text/plain) instead of a 400; and a
    completion prompt of token ids that goes to Ollama (an `X--ollama`
    model, or a fallback) is a 500 "Unmapped prompt format". Returns
    the bug's name when `answer` is such a 500 for a body the engine's own
    request model refuses; None otherwise, and always with
    MLXD_FUZZ_KNOWN_BUGS=1."""
    if SEND_KNOWN_BUGS or answer.status is None or answer.status < 500 or answer.status in (503,):
        return None
    if invalid_request(path, body):
        RECORDER.note(known_bug="gateway_500_on_invalid_body")
        return "gateway_500_on_invalid_body"
    if path == COMPLETIONS and b"Unmapped prompt format" in answer.body:
        # token-id prompts (valid for the engine) that reach Ollama's chat provider
        RECORDER.note(known_bug="gateway_token_ids_to_ollama")
        return "gateway_token_ids_to_ollama"
    return None


# --- strategies -------------------------------------------------------------------

SPECIAL_CHARS = ["\x00", "\u202e", "\u202d", "\u200f", "\u200b", "\u200d", "\ufeff", "\ufffe", "\uffff",
                 "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u0301\u0301\u0301", "\U0010ffff",
                 "\ud800", "\udfff", "\udbff\udfff", "\r\n", "\t", "\x7f", "\x1b[31m", "\u0000\u0000",
                 "\u05e9\u05dc\u05d5\u05dd", "\u0645\u0631\u062d\u0628\u0627", "\U000e0041", "\u2028\u2029"]
SPECIAL_STRINGS = ["", " ", "null", "None", "true", "0", "-1", "NaN", "Infinity", "{}", "[]", '{"a":1}', "%s%n",
                   "{{7*7}}", "{% for x in range(99999999) %}x{% endfor %}", "<|im_start|>", "<|endoftext|>",
                   "<tool_call>{\"name\": \"x\"}</tool_call>", "</s><s>", "\\u0000", "%00", "../" * 8,
                   "A" * 300, "\u202e" * 50, "\U0001f600" * 100]

odd_char = (st.characters()
            | st.characters(categories=["Cs"])  # lone surrogates: valid JSON escapes, invalid Unicode
            | st.sampled_from([c for c in SPECIAL_CHARS if len(c) == 1]))
odd_text = st.one_of(
    st.text(odd_char, max_size=40),
    st.sampled_from(SPECIAL_STRINGS),
    st.lists(st.sampled_from(SPECIAL_CHARS + SPECIAL_STRINGS), max_size=8).map("".join),
)
huge_text = st.builds(lambda n, c: c * n, st.integers(0, SMALL_TEXT) | st.integers(HUGE_MIN, HUGE_TEXT),
                      st.sampled_from(HUGE_UNITS))
any_text = st.one_of(odd_text, odd_text, huge_text)  # at most one huge text per body: see RSS_GROWTH_BOUND

big_ints = st.one_of(st.integers(), st.integers(-(2**70), 2**70),
                     st.sampled_from([0, -1, 1, 2**31, 2**31 - 1, 2**53 + 1, 2**63, 2**63 - 1, -(2**63), 2**64,
                                      10**30, 1_000_000, 1_000_001, 64, 65, 4096, 4097, 1023, 1024]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 1e-320, 5e-324, 1e308, -1e308, 0.5, 2.0000001, 1.5, 1e-9]))
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, odd_text)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(string.ascii_letters + "_", max_size=12), inner, max_size=4),
                    max_leaves=12)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


deep = st.builds(nested, st.integers(1, 400))  # json.dumps recursion stays under Python's limit
nasty = st.one_of(junk, junk, huge_text, deep)


# --- request bodies and HTTP-level strategies (shared by the engine and gateway tests) ---

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


_strategies: dict = {}


def case_strategy(schema, path: str, method: str, mode: str):
    key = (id(schema), path, method, mode)
    if key not in _strategies:
        _strategies[key] = schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    return _strategies[key]


def run_case(case, target: str, check_alive, known_bug=lambda path, body, answer: None, null_type_ok: bool = False,
             **call_kwargs) -> Answer:
    """Send one schemathesis case; schemathesis checks no 5xx and response
    bodies against the schema, check_answer the OpenAI error shape.
    The documented 422 is never used (validation errors are 400, as OpenAI
    answers) and /metrics is text, so status-code and content-type
    conformance are not checked."""
    if isinstance(case.body, dict):
        case.body = neutralise_known_bugs(case.body)
    response = case.call(timeout=60, **call_kwargs)
    RECORDER.request(target, case.method, case.path, response.status_code, response.elapsed, openapi=True)
    answer = Answer(response.status_code, {k: v[0] for k, v in response.headers.items()}, response.content)
    what = f"{case.method} {case.path} {case.body!r:.300}"
    body = None if case.body is NOT_SET else case.body
    if case.method.upper() != "POST" or not known_bug(case.path, body, answer):
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        check_answer(answer, what, null_type_ok=null_type_ok)
    check_alive(what)
    return answer



def chat_body(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0, **fields}


def completion_body(**fields) -> dict:
    return {"model": "default", "prompt": "hello", "max_tokens": 4, "temperature": 0, **fields}


SAMPLING_FIELDS = ["model", "stream", "stream_options", "stream_options.include_usage", "max_tokens", "temperature",
                   "top_p", "top_k", "min_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "logit_bias.5", "logprobs", "user", "metadata"]
CHAT_FIELDS = SAMPLING_FIELDS + ["messages", "messages.0", "messages.0.role", "messages.0.content",
                                 "messages.0.content.0", "messages.0.content.0.text", "messages.0.name",
                                 "messages.0.tool_calls", "messages.0.tool_calls.0.function",
                                 "messages.0.tool_calls.0.function.arguments", "messages.0.tool_call_id",
                                 "max_completion_tokens", "tools", "tools.0", "tools.0.function", "tool_choice",
                                 "response_format", "response_format.type"]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["prompt", "prompt.0", "echo", "suffix"]


def base_for(path: str) -> dict:
    if path == COMPLETIONS:
        return completion_body(prompt=["hello"], logit_bias={"5": 1}, stream_options={"include_usage": False})
    return chat_body(
        messages=[{"role": "assistant", "content": [{"type": "text", "text": "hi"}], "name": "a",
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                   "tool_call_id": "c0"}, {"role": "user", "content": "hello"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        logit_bias={"5": 1}, stream_options={"include_usage": False}, response_format={"type": "text"})


def set_path(body: dict, dotted: str, value) -> dict:
    """A copy of `body` with the field at `dotted` (a.0.b) set to value
    (unchanged where the path runs into a scalar)."""
    out = copy.deepcopy(body)
    node = out
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[int(key) % len(node)] if isinstance(node, list) and node else node.setdefault(key, {})
        if not isinstance(node, (dict, list)) or (isinstance(node, list) and not node):
            return out
    if isinstance(node, list):
        node[int(last) % len(node)] = value
    else:
        node[last] = value
    return out


endpoint_and_field = st.one_of(st.tuples(st.just(CHAT), st.sampled_from(CHAT_FIELDS)),
                               st.tuples(st.just(COMPLETIONS), st.sampled_from(COMPLETION_FIELDS)))



def valid_json_bytes() -> st.SearchStrategy[bytes]:
    return st.sampled_from([json.dumps(chat_body()).encode(), json.dumps(completion_body()).encode()])



def _splice(data: bytes, at: int, insert: bytes) -> bytes:
    at = at % (len(data) + 1)
    return data[:at] + insert + data[at:]


NUMERIC_TOKENS = [b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" + b"0" * 5000,
                  b"0." + b"0" * 5000 + b"1", b"-0", b"1e2", b"1E-2", b"0x10", b"01", b"+1", b".5", b"1.", b"true",
                  b"9" * 20, b"1e999999999"]
malformed_body = st.one_of(
    st.builds(lambda d, k: d[:k % max(len(d), 1)], valid_json_bytes(), st.integers(0, 10_000)),  # truncated
    st.binary(max_size=2000),
    st.builds(_splice, valid_json_bytes(), st.integers(0, 10_000),
              st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00",
                               b"\xc0\xaf", b"\xe2\x82", b"\x80"])),  # invalid UTF-8
    st.builds(lambda field, tok: (b'{"model": "default", "messages": [{"role": "user", "content": "x"}], "'
                                  + field + b'": ' + tok + b"}"),
              st.sampled_from([b"max_tokens", b"temperature", b"top_p", b"top_k", b"seed", b"min_p", b"n",
                               b"presence_penalty", b"repetition_penalty", b"max_completion_tokens", b"logprobs"]),
              st.sampled_from(NUMERIC_TOKENS)),
    st.builds(lambda n, c: c[0] * n + c[1] * n, st.integers(1, 200_000),
              st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'{"model": "default", "messages": [', b"]}")])),
    st.builds(lambda n: b'{"model": "default", "messages": [{"role": "user", "content": "x", "name": '
              + b'{"a":' * n + b"1" + b"}" * n + b"}]}", st.integers(1, 100_000)),  # deep in a known field
    st.sampled_from([b"", b" ", b"null", b"[]", b"[1,2]", b"1", b'"x"', b"true", b"{}", b"{", b"}", b"\xef\xbb\xbf{}",
                     json.dumps(chat_body()).encode() * 2, json.dumps(chat_body()).encode() + b"xyz",
                     b'{"model": "default", "model": 5, "messages": []}', b"{'model': 'default'}",
                     b'{"model": "default" /* c */}', json.dumps(chat_body()).encode("utf-16"),
                     json.dumps(chat_body()).encode("utf-32"), b"\xef\xbb\xbf" + json.dumps(chat_body()).encode()]),
)



TEXT_FIELDS = ["messages.0.content", "messages.0.content.0.text", "messages.0.name", "messages.0.tool_call_id",
               "stop", "stop.0", "model", "user", "tool_choice", "messages.0.tool_calls.0.function.arguments",
               "messages.0.tool_calls.0.function.name", "tools.0.function.name", "tools.0.function.description"]



max_tokens_value = st.one_of(big_ints, floats, st.booleans(), st.none(), big_ints.map(str), floats.map(str), odd_text,
                             st.lists(big_ints, max_size=2))



CONTENT_TYPES = ["", "text/plain", "application/json; charset=latin-1", "application/json; charset=utf-16",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml",
                 "application/json, text/plain", "APPLICATION/JSON", "application/json;;;", "*/*", "x" * 5000,
                 "application/octet-stream", "application/json; boundary=\u00ff"]
content_type = st.one_of(st.sampled_from(CONTENT_TYPES),
                         st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=60))



header_name = st.one_of(st.sampled_from([b"X-A", b"Authorization", b"Content-Type", b"Accept", b"User-Agent",
                                         b"Transfer-Encoding", b"Expect", b"Accept-Encoding", b"Cookie"]),
                        st.binary(min_size=1, max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b))
header_value = st.one_of(st.binary(max_size=200).filter(lambda b: b"\r" not in b and b"\n" not in b),
                         st.builds(lambda n, c: c * n, st.integers(0, 150_000), st.sampled_from([b"a", b"\xff", b" "])),
                         st.sampled_from([b"gzip, br, zstd", b"100-continue", b"chunked", b"identity",
                                          b"\x00", b"\x7f", b"\xc3\xa9", b"v\r\n continued", b"v\rX-B: w"]))



METHODS = [b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT", b"PROPFIND",
           b"FOO", b"get", b"G-E-T"]

def model_tricks(model_dirs: list[str]) -> st.SearchStrategy[str]:
    """`model` values that try to name a file or folder, or look like a configured name."""
    prefixes = ["", "/", "./", "../", "../../", "..\\", "%2e%2e/", "%2e%2e%2f", "~/", "file://", "hf://",
                "mlx-community/", "\x00", " ", "C:\\", "\\\\server\\share\\"]
    stems = ["default", "demo-a", "etc/passwd", "demo-a/../demo-b", *model_dirs,
             "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "Llama-3.3-70B-Instruct", "..", ".", "", "DEFAULT",
             "default ", "fast\n", "d\u0435fault", "llama3.2:3b", "ollama_chat/llama3.2:3b", "default--ollama"]
    suffixes = ["", "\x00", "/", "%00", " ", "\n", "/..", "/config.json", "?x=1", "#", ":latest", "\u200b"]
    return st.one_of(st.builds(lambda a, b, c: a + b + c, st.sampled_from(prefixes), st.sampled_from(stems),
                               st.sampled_from(suffixes)),
                     odd_text)
