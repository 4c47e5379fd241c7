#!/usr/bin/env python3
"""Codex CLI runs an exec turn with a tool call, end to end, against mlxd
(issue 34's last goal).

The default model, SmolLM2-135M-Instruct, reads Codex's prompt and tools
(mlxd renders them: its template drops them) but does not choose to call a
tool, and no model that does fits this machine with its network cut off. So
this script makes one that does, for Codex's own request only: a copy of
the default model whose last MLP block is fine-tuned until, at every
position of two scripted answers, the scripted token is the model's choice
with probability >= 0.999 (Codex samples at temperature 1):

  turn 1  Codex's request for SHELL_PROMPT       -> an `exec_command` call of `echo mlxd-ok`,
          in the format mlxd renders tools in (engine/model/tool_prompt.py)
  turn 2  the same, with the command's output    -> "The command printed mlxd-ok."

Only the last block's MLP learns: what feeds it (every earlier layer, and
the last layer's attention over the whole prompt) is fixed, so its inputs
are computed once, and training is a few seconds of Adam on ~40 rows.
The prompts are Codex's real requests, as the relay of
bench/agent_clients.py recorded them, turned into tokens by the engine's
own code (engine/api/responses_to_chat.py -> engine/model/generation.py `tokenize`); the
second request (with the command's output) is only known once Codex has
run the command, so the copy is tuned twice. Every step is real: a fresh
stack (`mlxd up`) per run, Codex CLI from npm in a loopback-only network
namespace, the command run by Codex itself, its output sent back by Codex.

  run 1  default model        Codex's first request recorded (the model answers in text)
  tune A on turn 1
  run 2  tuned copy A         the model calls exec_command; Codex runs it; its second request recorded
  tune B on turns 1 and 2 (the output's changing digits -- wall time, ids -- varied)
  run 3  tuned copy B         the reported run: the call, the command's output, the answer

The check (run 3): Codex exited 0, every request got 200, Codex ran
`echo mlxd-ok` and read `mlxd-ok` back, and its last message is the answer.
This shows the protocol end to end (the Responses API's function_call and
function_call_output items, streamed, through the gateway and the engine),
not that a small model can be an agent: docs/AGENTS.md says which models can.

Usage:
  .venv/bin/python bench/codex_tool_turn.py            # about 10 min on 2 CPU cores
  .venv/bin/python bench/codex_tool_turn.py --keep     # keep the run folder (requests, logs, tuned copies)

Progress to stderr, a summary to stdout, everything to
bench/results/codex_tool_turn.json. Linux (network namespaces); --no-netns
runs without one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_clients import (ALIAS, CACHE, CLIENTS, SHELL_MARK, SHELL_PROMPT, Relay, codex_cases,  # noqa: E402
                           install, leftover_stack, loopback_only, netns_prefix, redact, run_client)
from benchkit import RESULTS, interrupt_on_sigterm, machine_info, say, stop_all_children, write_json  # noqa: E402

OUT = RESULTS / "codex_tool_turn.json"
COMMAND = f"echo {SHELL_MARK}"
ANSWER = f"The command printed {SHELL_MARK}."
TOOL = "exec_command"       # Codex's shell tool (its `cmd` argument is the command line)
TARGET_PROB = 0.999         # every scripted token's probability, at least
VARIANTS = 4                # turn 2 with its output's digits and ids changed
MODEL_ID = "smollm2-codex"


# --- the engine's own prompt for a recorded request -------------------------------------------

def engine_prompt(body: dict, tokenizer: Any) -> list[int]:
    """The tokens the engine feeds the model for this /v1/responses body: the
    engine's own translation (Responses -> chat -> job) and tokenization."""
    from types import SimpleNamespace

    from mlxd.config_engine import EngineConfig
    from mlxd.engine.model.generation import ResidentModel, tokenize
    from mlxd.engine.model.grammar import OutputRules
    from mlxd.engine.model.prompt_tokens import PieceEncoder
    from mlxd.engine.api.request_metadata import without_metadata
    from mlxd.engine.api.responses_api import ResponsesRequest
    from mlxd.engine.api.responses_to_chat import to_chat_request
    from mlxd.engine.model.tool_prompt import tool_support

    chat = to_chat_request(ResponsesRequest.model_validate(body))
    limits = EngineConfig()
    renders, fmt = tool_support(tokenizer)
    resident = ResidentModel(MODEL_ID, None, tokenizer, PieceEncoder(tokenizer), renders_tools=renders,
                             tool_format=fmt)
    rules = chat.output_rules()
    if rules.constrained:
        raise SystemExit("Codex's request asks for a bound answer; this script scripts free ones")
    job = SimpleNamespace(
        images=(), kind="chat", prompt=None, model_id=MODEL_ID, rules=OutputRules(),
        messages=[m.for_template() for m in without_metadata(chat.messages, limits.strip_metadata)],
        tools=chat.tools_for_template(), template_kwargs=chat.template_kwargs(),
        params=SimpleNamespace(logit_bias=None))
    return tokenize(resident, job, limits.max_prompt_tokens)


def call_text(command: str) -> str:
    """The exec_command call as mlxd's rendering writes a call (what its parser reads back)."""
    from mlxd.engine.model.tool_prompt import tool_call_block

    return tool_call_block(TOOL, {"cmd": command})


def varied(body: dict, rng: random.Random) -> dict:
    """Turn 2 with what changes between runs changed: the call's id and the
    digits and hex ids in the command's output (wall time, chunk id)."""
    out = json.loads(json.dumps(body))
    for item in out.get("input") or []:
        if not isinstance(item, dict):
            continue
        if item.get("call_id"):
            item["call_id"] = "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(24))
        if item.get("type") == "function_call_output" and isinstance(item.get("output"), str):
            text = re.sub(r"(Chunk ID: )([0-9a-f]+)", lambda m: m[1] + "".join(
                rng.choice("0123456789abcdef") for _ in m[2]), item["output"])
            item["output"] = re.sub(r"[0-9]", lambda _m: rng.choice("0123456789"), text)
    return out


# --- tuning the last MLP --------------------------------------------------------------------------

@dataclass
class Example:
    tokens: list[int]   # prompt + reply + end of turn
    reply_from: int     # where the reply starts


def load_float32(folder: Path) -> tuple[Any, Any]:
    """The model as the engine serves it on the CPU (dequantised, float32), and its tokenizer."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load

    model, tokenizer = load(str(folder))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    return model, tokenizer


PREFIX_KV: dict[tuple[int, ...], list[Any]] = {}  # the shared prefix's KV, kept between the two tunings


def last_mlp_inputs(model: Any, examples: list[Example]) -> tuple[Any, Any]:
    """(rows, labels): the residual stream entering the last block's MLP at
    every position that predicts a reply token, and that token. The shared
    prefix (Codex's instructions and tools) is computed once, in chunks."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache

    inner = model.model
    last = inner.layers[-1]

    def forward(tokens: list[int], cache: list[Any]) -> Any:
        h = inner.embed_tokens(mx.array(tokens)[None])
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(inner.layers[:-1], cache[:-1]):
            h = layer(h, mask, cache=c)
        return h + last.self_attn(last.input_layernorm(h), mask, cache=cache[-1])

    shared = min(e.reply_from - 1 for e in examples)
    first = examples[0].tokens
    for e in examples[1:]:
        shared = min(shared, next((i for i, (a, b) in enumerate(zip(first, e.tokens)) if a != b), shared))
    key = tuple(first[:shared])
    if key not in PREFIX_KV:  # tune A's prefix is tune B's: its KV depends on no weight that learns
        PREFIX_KV.clear()
        PREFIX_KV[key] = make_prompt_cache(model)
        for i in range(0, shared, 512):
            forward(first[i:min(i + 512, shared)], PREFIX_KV[key])
            mx.eval([c.state for c in PREFIX_KV[key]])
    cache = PREFIX_KV[key]
    rows, labels = [], []
    for e in examples:
        rest = e.tokens[shared:-1]
        h = forward(rest, cache)[0]
        rows.append(h[e.reply_from - 1 - shared:])
        labels.append(mx.array(e.tokens[e.reply_from:]))
        mx.eval(rows[-1])
        for c in cache:
            c.trim(len(rest))
    return mx.concatenate(rows), mx.concatenate(labels)


def tune_last_mlp(model: Any, rows: Any, labels: Any, max_steps: int = 3000) -> dict:
    """Adam on the last block's MLP until every label's probability is >= TARGET_PROB."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    inner = model.model
    last = inner.layers[-1]
    head = inner.embed_tokens.as_linear if getattr(model.args, "tie_word_embeddings", True) else model.lm_head

    def logits_of(mlp: Any) -> Any:
        return head(inner.norm(rows + mlp(last.post_attention_layernorm(rows))))

    def loss_fn(mlp: Any) -> Any:
        return nn.losses.cross_entropy(logits_of(mlp), labels, reduction="mean")

    def worst() -> float:
        probs = mx.softmax(logits_of(last.mlp), axis=-1)
        return mx.min(mx.take_along_axis(probs, labels[:, None], axis=-1)).item()

    before = worst()
    optimizer = optim.Adam(learning_rate=1e-3)
    step_fn = nn.value_and_grad(last.mlp, loss_fn)
    t0 = time.monotonic()
    for step in range(1, max_steps + 1):
        loss, grads = step_fn(last.mlp)
        optimizer.update(last.mlp, grads)
        mx.eval(last.mlp.parameters(), optimizer.state, loss)
        if step % 20 == 0:
            p = worst()
            if step % 100 == 0:
                say(f"   step {step}: loss {loss.item():.5f}, lowest probability {p:.4f}")
            if p >= TARGET_PROB:
                return {"steps": step, "rows": int(labels.size), "lowest_probability_before": round(before, 6),
                        "lowest_probability": round(p, 6), "train_s": round(time.monotonic() - t0, 1)}
    raise RuntimeError(f"the last MLP did not learn the script in {max_steps} steps")


def tuned_copy(converted: Path, dest: Path, examples: list[Example]) -> dict:
    """`dest`: the converted default model with its last MLP tuned on
    `examples` (stored dense float32; the rest as it was, quantised)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, _tok = load_float32(converted)
    t0 = time.monotonic()
    rows, labels = last_mlp_inputs(model, examples)
    features_s = time.monotonic() - t0
    stats = tune_last_mlp(model, rows, labels)
    stats["features_s"] = round(features_s, 1)
    dest.mkdir(parents=True)
    for f in converted.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, dest / f.name)
    prefix = f"model.layers.{len(model.model.layers) - 1}.mlp."
    weights = {k: v for k, v in mx.load(str(converted / "model.safetensors")).items() if not k.startswith(prefix)}
    weights.update({prefix + k: v for k, v in tree_flatten(model.model.layers[-1].mlp.parameters())})
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return stats


# --- the runs (in the namespace) -------------------------------------------------------------

def start_stack(home: Path, model: dict) -> Any:
    from mlxd.devkit.ports import free_port
    from mlxd.devkit.stack import Stack, stack_env
    from mlxd.toml_text import dumps

    home.mkdir(parents=True, exist_ok=True)
    (home / "mlxd.toml").write_text(dumps({
        "engine": {"port": free_port()}, "gateway": {"port": free_port()},
        "models": {MODEL_ID: model}, "aliases": {ALIAS: MODEL_ID}}))
    st = Stack(home, stack_env(home))
    st.up(timeout=600)
    return st


def codex_run(label: str, model: dict, run_dir: Path, codex: Path, timeout: float) -> dict:
    """A fresh stack on `model`, Codex's tool case through the relay; the
    run's record and Codex's requests (bodies)."""
    folder = run_dir / label
    st = relay = None
    try:
        t0 = time.monotonic()
        st = start_stack(folder / "home", model)  # short: supervisord's socket path has a limit
        say(f"{label}: stack ready in {time.monotonic() - t0:.0f} s")
        relay = Relay(st.gateway_url, folder / "requests").start()
        # one client folder for every run: Codex's prompt names its working directory
        case = next(c for c in codex_cases(codex, run_dir / "codex", relay.url + "/v1", st.key)
                    if c.name == "tool-slim")
        run = run_client(case, relay, st.url, timeout, folder, 60.0)
        seen = case.check(run)
        bodies = [json.loads((folder / "requests" / f"{r['i']:03d}-request.json").read_text())
                  for r in run.requests if r["method"] == "POST" and r["path"].startswith("/v1/responses")]
        record = {"run": label, "rc": run.rc, "timed_out": run.timed_out, "wall_s": run.wall_s, **seen,
                  "requests": [{k: r.get(k) for k in ("method", "path", "status", "duration_s", "response")}
                               for r in run.requests],
                  "stdout_tail": redact(run.stdout[-4000:], st.key), "stderr_tail": redact(run.stderr[-2000:], st.key)}
        say(f"{label}: rc {run.rc} in {run.wall_s} s; {len(bodies)} request(s) "
            f"{[r.get('status') for r in run.requests]}; tools run {[t['command'] for t in seen['tools_run']]}; "
            f"answer {seen['answer'][:80]!r}")
        return {"record": record, "bodies": bodies}
    finally:
        if relay is not None:
            relay.stop()
        if st is not None:
            shutil.copytree(st.paths.logs, folder / "mlxd-logs", dirs_exist_ok=True)
            st.stop()


def verdict(record: dict) -> dict:
    """What run 3 must show, each part checked on what Codex printed and the relay saw."""
    ran = [t for t in record.get("tools_run") or [] if SHELL_MARK in str(t.get("command"))]
    checks = {
        "codex_exit_0": record.get("rc") == 0,
        "every_request_200": bool(record.get("requests")) and all(r.get("status") == 200 for r in record["requests"]),
        "two_model_turns": len([r for r in record.get("requests") or [] if r.get("method") == "POST"]) >= 2,
        "command_run_by_codex": bool(ran),
        "output_read_back": any(SHELL_MARK in (t.get("output") or "") and t.get("exit_code") == 0 for t in ran),
        "final_answer": SHELL_MARK in (record.get("answer") or ""),
        "no_client_errors": not record.get("client_errors"),
    }
    return {"passed": all(checks.values()), **checks}


def inner(args: argparse.Namespace) -> int:
    interrupt_on_sigterm()
    from mlxd.engine.cpu.fast_blas import activate

    activate()  # before MLX is imported: the tuning's prefill on OpenBLAS, as the engine's (~15x the reference BLAS)
    run_dir = Path(args.run_dir)
    out_path = run_dir / "result.json"
    result: dict[str, Any] = {"runs": [], "tuning": []}
    try:
        result["network"] = loopback_only() if not args.no_netns else {"isolated": False, "note": "--no-netns"}
        codex = CLIENTS["codex"].bin(Path(args.cache))
        gguf = Path(args.gguf)
        first = codex_run("r1-default", {"gguf": str(gguf)}, run_dir, codex, args.timeout)
        result["runs"].append(first["record"])
        write_json(out_path, result)
        if not first["bodies"]:
            raise RuntimeError("Codex sent no /v1/responses request")

        from mlxd.engine.model.gguf_convert import convert_gguf

        converted = convert_gguf(gguf, run_dir / "converted", say=say)
        _model, tokenizer = load_float32(converted)
        eos = tokenizer.eos_token_id

        def example(body: dict, reply: str) -> Example:
            prompt = engine_prompt(body, tokenizer)
            return Example(prompt + tokenizer.encode(reply, add_special_tokens=False) + [eos], len(prompt))

        turn1 = [example(first["bodies"][0], call_text(COMMAND))]
        result["prompt_tokens"] = {"turn1": turn1[0].reply_from}
        say(f"tune A: turn 1 ({turn1[0].reply_from} prompt tokens) -> {call_text(COMMAND)!r}")
        result["tuning"].append({"copy": "A", **tuned_copy(converted, run_dir / "tuned-a", turn1)})
        say(f"tune A: {result['tuning'][-1]}")
        second = codex_run("r2-tuned-a", {"path": str(run_dir / "tuned-a")}, run_dir, codex, args.timeout)
        result["runs"].append(second["record"])
        write_json(out_path, result)
        followups = [b for b in second["bodies"][1:]
                     if any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in b.get("input", []))]
        if not followups:
            raise RuntimeError("tuned copy A: Codex sent no request with the command's output")
        rng = random.Random(0)
        turn2 = [example(followups[0], ANSWER)] + [example(varied(followups[0], rng), ANSWER)
                                                  for _ in range(VARIANTS)]
        result["prompt_tokens"]["turn2"] = turn2[0].reply_from
        say(f"tune B: turns 1 and 2 ({turn2[0].reply_from} prompt tokens, {VARIANTS} variants) -> {ANSWER!r}")
        result["tuning"].append({"copy": "B", **tuned_copy(converted, run_dir / "tuned-b", turn1 + turn2)})
        say(f"tune B: {result['tuning'][-1]}")
        third = codex_run("r3-tuned-b", {"path": str(run_dir / "tuned-b")}, run_dir, codex, args.timeout)
        result["runs"].append(third["record"])
        result["verdict"] = verdict(third["record"])
    except BaseException as exc:  # noqa: BLE001 - recorded; the stacks were stopped by codex_run
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"error: {result['error']}")
    finally:
        write_json(out_path, result)
    return 0


# --- the outer run ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", action="store_true", help="keep the run folder")
    p.add_argument("--timeout", type=float, default=480.0, help="time limit of one Codex run, s (480)")
    p.add_argument("--cache", type=Path, default=CACHE, help=f"where Codex is installed ({CACHE})")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--no-netns", action="store_true", help="run without a network namespace (not Linux)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        return inner(args)
    interrupt_on_sigterm()
    from mlxd import default_model

    installed = install(CLIENTS["codex"], args.cache)
    say(f"codex: {installed['package']} {installed['version']}")
    gguf = default_model.fetch(say=say)
    if gguf is None:
        say(default_model.missing_hint())
        return 1
    runs_root = args.cache.parent / "agent-runs"
    runs_root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=dt.datetime.now().strftime("codex-%m%d%H%M-"), dir=runs_root))
    say(f"run folder: {root}{' (kept)' if args.keep else ''}")
    cmd = [*netns_prefix(args.no_netns), sys.executable, str(Path(__file__).resolve()), "--inner",
           "--run-dir", str(root), "--gguf", str(gguf), "--cache", str(args.cache),
           "--timeout", str(args.timeout)] + (["--no-netns"] if args.no_netns else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        proc.wait(args.timeout * 3 + 1800)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        say(f"stopping the namespace's runner (pid {proc.pid})")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for home in root.glob("r*/home"):
            leftover_stack(home)
        stop_all_children()
    path = root / "result.json"
    doc = {"machine": machine_info(), "codex": installed, "command": COMMAND, "answer_scripted": ANSWER,
           "prompt": SHELL_PROMPT, **(json.loads(path.read_text()) if path.exists() else {"error": "no result"})}
    write_json(args.out, doc)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    v = doc.get("verdict") or {}
    print(json.dumps({"verdict": v, "tuning": doc.get("tuning"), "prompt_tokens": doc.get("prompt_tokens"),
                      "error": doc.get("error")}, indent=1))
    say(f"results: {args.out}" + (f"; run folder: {root}" if args.keep else ""))
    return 0 if v.get("passed") else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
