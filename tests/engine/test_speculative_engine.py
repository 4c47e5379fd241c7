"""Prompt lookup in the running engine (engine/model/speculative.py): the
same greedy answers as with `speculative = "off"`, over HTTP, and /metrics
says what it did. Two real engine processes on the demo model."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.timeout(180)

# Text an answer can copy from: the demo model's greedy answers repeat what they were given.
PROMPT = "Rewrite this line exactly: the quick brown fox jumps over the lazy dog. " * 6


def metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("mlxd_engine_spec_")}


def answer(url: str, max_tokens: int, stream: bool = False) -> tuple[str, dict]:
    r = requests.post(url + "/v1/chat/completions", timeout=120, stream=stream, json={
        "model": "default", "temperature": 0, "max_tokens": max_tokens, "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        return body["choices"][0]["message"]["content"], body["usage"]
    import json

    text, usage = "", {}
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
            usage = chunk.get("usage") or usage
    return text, usage


def test_prompt_lookup_answers_as_plain_decoding_does_and_says_so_in_metrics(start_engine):
    on = start_engine()  # the default: prompt_lookup
    off = start_engine({"speculative": "off"})
    before = metrics(on.url)
    for max_tokens in (1, 7, 64):
        for stream in (False, True):
            assert answer(on.url, max_tokens, stream) == answer(off.url, max_tokens, stream)
    after = metrics(on.url)
    assert after["mlxd_engine_spec_requests"] - before["mlxd_engine_spec_requests"] == 6
    assert after["mlxd_engine_spec_forwards"] <= after["mlxd_engine_spec_tokens"]
    assert metrics(off.url)["mlxd_engine_spec_requests"] == 0
    # A sampled request is speculated too (the acceptance rule); one with a penalty is not (a processor between).
    r = requests.post(on.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "temperature": 0.8, "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert metrics(on.url)["mlxd_engine_spec_requests"] == after["mlxd_engine_spec_requests"] + 1
    r = requests.post(on.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "temperature": 0, "max_tokens": 8, "presence_penalty": 0.5,
        "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200
    assert metrics(on.url)["mlxd_engine_spec_requests"] == after["mlxd_engine_spec_requests"] + 1


def test_a_stop_string_ends_the_answer_where_it_ends_without_prompt_lookup(start_engine):
    """Tokens verified in one forward still reach the client one by one, so a
    stop string cuts the answer at the same place (and the usage counts the same)."""
    on = start_engine()
    off = start_engine({"speculative": "off"})
    full, _ = answer(off.url, 64)
    assert len(full) > 30, full
    stop = full[20:24]  # a string the answer is known to hold
    bodies = []
    for url in (on.url, off.url):
        r = requests.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "temperature": 0, "max_tokens": 64, "stop": [stop],
            "messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200, r.text
        body = r.json()
        bodies.append((body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"],
                       body["usage"]["completion_tokens"]))
    assert bodies[0] == bodies[1]
    assert bodies[0][1] == "stop" and stop not in bodies[0][0] and full.startswith(bodies[0][0])


SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}, "replacement_text": {"type": "string"},
                                           "line_number": {"type": "integer"}},
          "required": ["file_path", "replacement_text", "line_number"], "additionalProperties": False}


def test_a_bound_answer_is_speculated_under_its_grammar_and_answers_as_without(start_engine):
    """Constrained decoding composes: every verified position is masked by the
    answer's grammar, the tokens it forces (the schema's keys) are proposed
    and accepted, and the answer is the same valid JSON as decoded plainly."""
    import json

    on = start_engine()
    off = start_engine({"speculative": "off"})
    bodies = []
    before = metrics(on.url)
    for url in (on.url, off.url):
        r = requests.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": PROMPT}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "edit", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        bodies.append(r.json()["choices"][0])
    assert bodies[0] == bodies[1]
    if bodies[0]["finish_reason"] == "stop":  # complete: valid under the schema
        assert set(json.loads(bodies[0]["message"]["content"])) == set(SCHEMA["required"])
    after = metrics(on.url)
    assert after["mlxd_engine_spec_requests"] - before["mlxd_engine_spec_requests"] == 1
    # The keys and the JSON around them are forced by the grammar: verified several at a time.
    assert after["mlxd_engine_spec_accepted"] - before["mlxd_engine_spec_accepted"] >= 8
