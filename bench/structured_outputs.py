#!/usr/bin/env python3
"""Bound answers (issue 34): how often they hold, and what binding costs.

One real `mlxd engine` on the default model's GGUF (SmolLM2-135M-Instruct;
on the GPU pass `--model PATH` for another), measured from outside over HTTP:

  validity     N requests each (temperature 0.7, distinct prompts): a
               json_schema answer (bounded schema) that parses and
               validates, a forced named tool call and a `required` call
               whose arguments match the tool's schema. Percent valid.
  decode       streamed, free text against json_schema, alternated over
               rounds: completion tokens / (last chunk - first chunk) per
               request, the median per arm, and their ratio
  mask         the grammar processor's own time per token, in process (the
               llguidance mask and its application, over an answer's tokens)
  batch        with --concurrency 4 (engine max_concurrency 4): 4 free
               requests at once against 3 free + 1 bound; the free rows'
               decode tok/s, and the ratio (what one bound row costs the others)

Usage:
  .venv/bin/python bench/structured_outputs.py --quick          # N=10, 2 rounds
  .venv/bin/python bench/structured_outputs.py                  # N=50, 5 rounds
  .venv/bin/python bench/structured_outputs.py --model PATH     # another model (folder), e.g. on the GPU

Progress to stderr, the Markdown table to stdout, everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import machine_info, md_table, say, start_engine, stop_all_children, write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 40}, "languages": {"type": "array", "items": {"type": "string",
                                                                                          "maxLength": 20},
                                                               "maxItems": 3}},
    "required": ["name", "age", "city", "languages"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
CITIES = ["Oslo", "Rome", "Lima", "Pune", "Kyiv", "Cairo", "Quito", "Perth", "Dakar", "Hanoi"]


def chat(url: str, body: dict, timeout: float = 600) -> dict:
    r = requests.post(url + "/v1/chat/completions", json={"model": "default", **body}, timeout=timeout)
    r.raise_for_status()
    return r.json()


def valid_person(text: str) -> bool:
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        return False
    return (set(doc) == set(SCHEMA["required"]) and isinstance(doc["age"], int) and isinstance(doc["name"], str)
            and isinstance(doc["languages"], list) and len(doc["languages"]) <= 3)


def valid_call(message: dict, name: str = "get_weather") -> bool:
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != name:
        return False
    args = json.loads(calls[0]["function"]["arguments"])
    return set(args) == {"city", "days"} and isinstance(args["city"], str) and isinstance(args["days"], int)


def validity(url: str, n: int) -> dict:
    counts = {"json_schema": 0, "named tool": 0, "required tool": 0}
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        a = chat(url, {"messages": [{"role": "user", "content": f"Invent a person from {city} ({i}), as JSON."}],
                       "temperature": 0.7, "max_tokens": 160,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
        counts["json_schema"] += valid_person(a["choices"][0]["message"]["content"])
        a = chat(url, {"messages": [{"role": "user", "content": f"Tell me something about {city} ({i})."}],
                       "temperature": 0.7, "max_tokens": 80, "tools": [WEATHER, TIME],
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        counts["named tool"] += valid_call(a["choices"][0]["message"])
        a = chat(url, {"messages": [{"role": "user", "content": f"Weather in {city} for {i % 5 + 1} days?"}],
                       "temperature": 0.7, "max_tokens": 80, "tools": [WEATHER], "tool_choice": "required",
                       "parallel_tool_calls": False})
        counts["required tool"] += valid_call(a["choices"][0]["message"])
        say(f"  validity {i + 1}/{n}: {counts}")
    return {k: 100.0 * v / n for k, v in counts.items()}


def streamed_rate(url: str, body: dict) -> float:
    """Decode tok/s of one streamed answer: completion tokens after the first / time after the first chunk."""
    first = last = None
    usage = None
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=600,
                       json={"model": "default", "stream": True, "stream_options": {"include_usage": True},
                             **body}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            if doc.get("choices") and doc["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    tokens = (usage or {}).get("completion_tokens", 0)
    return (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else float("nan")


FREE = {"max_tokens": 96, "temperature": 0}  # max_tokens: --max-tokens
BOUND = {"max_tokens": 96, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
    "name": "story", "schema": {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
                                "required": ["title", "story"], "additionalProperties": False}}}}


def decode(url: str, rounds: int) -> dict:
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    for r in range(rounds):
        arms = [("free", FREE), ("json_schema", BOUND)]
        for name, body in (arms if r % 2 == 0 else arms[::-1]):
            msg = [{"role": "user", "content": f"Write a long story about a lighthouse keeper ({r}), as JSON with a "
                                               "title and the story."}]
            rates[name].append(streamed_rate(url, {"messages": msg, **body}))
        say(f"  decode round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"tok_s": med, "ratio": med["json_schema"] / med["free"], "rounds": rates}


def batch(url: str, rounds: int) -> dict:
    free_rates: dict[str, list[float]] = {"4 free": [], "3 free + 1 bound": []}
    for r in range(rounds):
        for arm in (["4 free", "3 free + 1 bound"] if r % 2 == 0 else ["3 free + 1 bound", "4 free"]):
            bodies = [dict(FREE) for _ in range(4)]
            if arm != "4 free":
                bodies[3] = dict(BOUND)
            msgs = [[{"role": "user", "content": f"Write a long story about a fox ({r}.{i})."}] for i in range(4)]
            with ThreadPoolExecutor(4) as pool:
                rates = list(pool.map(lambda i: streamed_rate(url, {"messages": msgs[i], **bodies[i]}), range(4)))
            free_rates[arm].append(statistics.median(rates[:3]))
        say(f"  batch round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in free_rates.items()))
    med = {k: statistics.median(v) for k, v in free_rates.items()}
    return {"free_rows_tok_s": med, "ratio": med["3 free + 1 bound"] / med["4 free"], "rounds": free_rates}


def mask_cost(model_dir: Path, tokens: int = 200) -> dict:
    """The grammar processor's time per token, in process, on the model's tokenizer."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from mlxd.engine.model.constrained import GrammarProcessor, grammar_tokenizer
    from mlxd.engine.model.grammar import OutputRules, answer_grammar

    tok = load_tokenizer(model_dir)
    vocab = len(tok.vocab)
    lt = grammar_tokenizer(tok, vocab)
    grammar = answer_grammar(OutputRules(schema={"type": "object", "properties": {"story": {"type": "string"}},
                                                 "required": ["story"]}), None)
    text = '{"story": "' + "Once upon a time a keeper lived by the sea and watched the ships. " * 40
    ids = tok.encode(text, add_special_tokens=False)[:tokens]
    proc = GrammarProcessor(lt, grammar, vocab, sorted(tok.eos_token_ids))
    logits = mx.zeros((1, vocab))
    prompt = tok.encode("Hi", add_special_tokens=False)[-1:]
    began = time.perf_counter()
    for i in range(len(ids) + 1):  # the first call ends in the prompt; each later one in the token sampled before
        mx.eval(proc(mx.array(prompt + ids[:i]), logits))
    per_token = (time.perf_counter() - began) / (len(ids) + 1)
    assert not proc.failed, "the answer's tokens left the grammar"
    return {"us_per_token": per_token * 1e6, "tokens": len(ids), "vocab": vocab}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model folder (default: the default model's GGUF)")
    p.add_argument("-n", type=int, default=50, help="requests per kind for validity")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="N=10, 2 rounds")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens a decode / batch request generates")
    p.add_argument("--skip-validity", action="store_true",
                   help="no validity figures (a random-weight model's answers run to max_tokens)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "structured_outputs.json")
    a = p.parse_args()
    n, rounds = (10, 2) if a.quick else (a.n, a.rounds)
    FREE["max_tokens"] = BOUND["max_tokens"] = a.max_tokens
    from mlxd import default_model

    gguf = None if a.model else default_model.fetch(say=say)
    spec = {"path": str(a.model.resolve())} if a.model else {"gguf": str(gguf)}
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-so-"))
    results: dict = {"machine": machine_info(), "n": n, "rounds": rounds}
    try:
        for concurrency in (1, 4):
            config = {"engine": {"max_tokens_cap": 100000, "stuck_grace_s": 600, "max_concurrency": concurrency},
                      "models": {"bench": spec}, "aliases": {"default": "bench"}}
            server = start_engine(home / f"c{concurrency}", config, home / f"engine-c{concurrency}.log")
            server.wait_ready(300)
            say(f"engine up (max_concurrency {concurrency})")
            if concurrency == 1:
                results["validity_pct"] = {} if a.skip_validity else validity(server.url, n)
                results["decode"] = decode(server.url, rounds)
                model_dir = next((home / "c1").rglob("config.json")).parent if gguf else a.model
                results["mask"] = mask_cost(model_dir)
            else:
                results["batch"] = batch(server.url, rounds)
            server.stop()
    finally:
        stop_all_children()
    write_json(a.out, results)
    v, d, b, m = results["validity_pct"], results["decode"], results["batch"], results["mask"]
    print(md_table(["figure", "value"], [
        *[[f"valid {k} (of {n})", f"{pct:.0f} %"] for k, pct in v.items()],
        ["decode free / json_schema tok/s", f"{d['tok_s']['free']:.1f} / {d['tok_s']['json_schema']:.1f}"],
        ["json_schema / free", f"{d['ratio']:.2f}x"],
        ["grammar time per token", f"{m['us_per_token']:.0f} us (vocab {m['vocab']})"],
        ["batch: free rows tok/s, 4 free / 3 free + 1 bound",
         f"{b['free_rows_tok_s']['4 free']:.1f} / {b['free_rows_tok_s']['3 free + 1 bound']:.1f}"],
        ["batch: a bound row's cost to the others", f"{b['ratio']:.2f}x"]]))


if __name__ == "__main__":
    main()
