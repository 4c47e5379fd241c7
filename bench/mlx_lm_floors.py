#!/usr/bin/env python3
"""The floors of bench/agents_load.py (issue 51, item 6): the same agents'
conversations run by mlx-lm alone, in process, no server, one floor a process.

The conversations are agents_load's: each agent's system prompt and user turns
(the same text), rendered each turn by the model's chat template as the engine
renders them (add_generation_prompt), greedy answers of at most --max-tokens
(ended by an EOS token as the engine ends them), each answer's text appended
as the assistant's message before the next turn. Every floor keeps each
conversation's KV across turns, as the engine's prompt cache does: a turn's
prompt is matched against the tokens its KV holds, the KV trimmed to the
common prefix and only the rest prefilled. With `shared_prefix` (agents_load
--shared-system) the first turns' common prefix is prefilled once and copied
to every row. The floors:

  plain   the agents' rows as equal rows of one batch, a plain KVCache of batch B, no mask: each turn every
          row's new tokens are cut or padded (the row's own tokens again) to the rows' mean, all rows trimmed to
          the shortest common prefix, prefilled together, then decoded together until every row has its
          answer; rows a cut or a pad made differ from their conversation are prefilled again from there
          the next turn (`prefilled_tokens` counts it)
  batch   mlx-lm's BatchGenerator (BatchKVCache), rows of their real, unequal lengths; an agent's next turn is
          inserted with its kept KV as soon as its answer ends (an out-of-memory is reported as such)
  serial  one row at a time (mlx_lm.generate.generate_step), each agent's turn alone over its own kept KV,
          the agents in turn order; a turn's TTFT counts from when its agent's previous answer ended

  python bench/mlx_lm_floors.py --spec SPEC.json --floor plain|batch|serial --out OUT.json

SPEC.json (run_floors writes it): model, systems, user_turns, max_tokens, shared_prefix, prefill_step (2048).
Progress to stderr; the turns and their summary to --out (status "out of memory" when MLX ran out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

FLOORS = ("plain", "batch", "serial")
TITLES = {"plain": "equal rows, plain KVCache", "batch": "unequal rows, BatchKVCache", "serial": "one row at a time"}
OOM = "out of memory"
OOM_WORDS = ("out of memory", "unable to allocate", "malloc", "outofmemory")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- pure --------------------------------------------------------------------------------

def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def equalize(rows: list[list[int]]) -> list[list[int]]:
    """Every row cut or padded to the rows' mean length (at least 1), a pad
    repeating the row's own tokens."""
    n = max(1, round(sum(len(r) for r in rows) / len(rows)))
    return [((r or [0]) * (n // max(1, len(r)) + 1))[:n] for r in rows]


def _p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """agents_load's figures for a floor's turns (dicts: agent, turn, t0, ttft_s, end_s, ...)."""
    wall = max((t["end_s"] for t in turns), default=0.0) - min((t["t0"] for t in turns), default=0.0)
    later = sorted(t["ttft_s"] for t in turns if t["turn"] >= 2 and t["ttft_s"] is not None)
    by_turn: dict[int, list[float]] = {}
    for t in turns:
        if t["ttft_s"] is not None:
            by_turn.setdefault(t["turn"], []).append(t["ttft_s"])
    return {"turns_completed": len(turns), "wall_s": wall, "turns_per_minute": 60 * len(turns) / wall if wall else None,
            "ttft_s_p50_by_turn": {n: _p50(v) for n, v in sorted(by_turn.items())},
            "ttft_s_p50_turns_2_on": _p50(later),
            "ttft_s_p95_turns_2_on": later[min(len(later) - 1, round(0.95 * (len(later) - 1)))] if later else None,
            **{k: sum(t[k] for t in turns) for k in ("prompt_tokens", "prefilled_tokens", "completion_tokens")}}


# --- in the floor's own process -----------------------------------------------------------

class Conv:
    """One agent's conversation: its messages, its kept KV and the tokens that KV holds."""

    def __init__(self, agent: int, system: str, turns: list[str]) -> None:
        self.agent, self.turns = agent, turns
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.kv: list[Any] | None = None
        self.kv_tokens: list[int] = []
        self.ready = 0.0  # when its next turn may be sent (its previous answer's end)


class Floor:
    def __init__(self, spec: dict[str, Any]) -> None:
        try:  # the engine's CPU set-up (OpenBLAS under MLX), before MLX is imported; nothing on a GPU
            from mlxd.engine.cpu import fast_blas

            say(f"floor: {fast_blas.activate().why}")
        except Exception as exc:  # noqa: BLE001 - without mlxd, MLX as installed
            say(f"floor: no mlxd CPU set-up ({type(exc).__name__})")
        import mlx.core as mx
        from mlx_lm import load

        self.mx, self.spec = mx, spec
        self.model, self.tok = load(spec["model"])
        self.eos = set(self.tok.eos_token_ids)
        self.max_tokens, self.step = spec["max_tokens"], spec.get("prefill_step", 2048)
        self.convs = [Conv(i, s, t) for i, (s, t) in enumerate(zip(spec["systems"], spec["user_turns"]))]
        self.records: list[dict[str, Any]] = []
        self.origin, self.shared_len = 0.0, 0

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def prompt(self, conv: Conv, n: int) -> list[int]:
        """Turn n's prompt (1-based) as the engine renders it; the user message appended."""
        conv.messages.append({"role": "user", "content": conv.turns[n - 1]})
        return self.render(conv.messages)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def answered(self, conv: Conv, tokens: list[int]) -> None:
        text = self.tok.decode([t for t in tokens if t not in self.eos])
        conv.messages.append({"role": "assistant", "content": text})

    def record(self, conv: Conv, n: int, t0: float, ttft: float | None, prompt: int, kept: int, prefilled: int,
               completion: int) -> None:
        if n == 1 and conv.agent == 0 and self.shared_len:  # the shared prefix prefilled once, in its first turn
            kept, prefilled = kept - self.shared_len, prefilled + self.shared_len
        rec = dict(agent=conv.agent, turn=n, t0=t0, ttft_s=ttft, end_s=self.now(), prompt_tokens=prompt,
                   cached_tokens=kept, prefilled_tokens=prefilled, completion_tokens=completion)
        self.records.append(rec)
        say(f"   agent {conv.agent} turn {n}: {prompt} prompt tokens ({kept} kept, {prefilled} prefilled), TTFT "
            f"{ttft if ttft is None else round(ttft, 2)} s, {completion} tokens, ended at {rec['end_s']:.1f} s")

    def fill(self, kv: list[Any], tokens: list[list[int]]) -> None:
        """Prefill rows of equal length into `kv`, --prefill-step tokens a forward."""
        x = self.mx.array(tokens)
        for a in range(0, x.shape[1], self.step):
            self.model(x[:, a:a + self.step], cache=kv)
            self.mx.eval([c.state for c in kv])

    def shared_kv(self, prompts: list[list[int]]) -> tuple[list[Any] | None, list[int]]:
        """With shared_prefix: the first prompts' common prefix prefilled once (its KV and tokens)."""
        from mlx_lm.models.cache import make_prompt_cache

        if not self.spec.get("shared_prefix") or len(prompts) < 2:
            return None, []
        n = min([common_prefix(prompts[0], p) for p in prompts[1:]] + [len(p) - 1 for p in prompts])
        if n < 1:
            return None, []
        kv = make_prompt_cache(self.model)
        self.fill(kv, [prompts[0][:n]])
        self.shared_len = n
        return kv, prompts[0][:n]

    def copy_kv(self, kv: list[Any], rows: int = 1) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        out = []
        for c in kv:  # rows copies of each row (of a batch of one)
            out.append(KVCache())
            out[-1].keys, out[-1].values = (self.mx.concatenate([a[..., :c.offset, :]] * rows)
                                            for a in (c.keys, c.values))
            out[-1].offset = c.offset
        return out

    def warm_up(self, rows: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        kv = make_prompt_cache(self.model)
        self.fill(kv, [[7 + i for i in range(32)]] * rows)
        self.mx.eval(self.model(self.mx.array([[5]] * rows), cache=kv))

    # -- the floors --

    def plain(self) -> None:
        mx, b = self.mx, len(self.convs)
        from mlx_lm.models.cache import make_prompt_cache

        kv = make_prompt_cache(self.model)
        for n in range(1, len(self.convs[0].turns) + 1):
            t0 = self.now()
            fulls = [self.prompt(c, n) for c in self.convs]
            if n == 1:
                shared, shared_tokens = self.shared_kv(fulls)
                if shared is not None:
                    kv = self.copy_kv(shared, b)
                    for c in self.convs:
                        c.kv_tokens = list(shared_tokens)
            kept = min(min(common_prefix(f, c.kv_tokens), len(f) - 1) for f, c in zip(fulls, self.convs))
            for c in kv:
                c.trim(c.offset - kept)
            rows = equalize([f[kept:] for f in fulls])
            if len(rows[0]) > 1:
                self.fill(kv, [r[:-1] for r in rows])
            y = mx.argmax(self.model(mx.array([r[-1:] for r in rows]), cache=kv)[:, -1, :], axis=-1)
            mx.eval(y)
            ttft = self.now() - t0
            fed = [f[:kept] + r for f, r in zip(fulls, rows)]
            answers: list[list[int]] = [[] for _ in range(b)]
            done = [False] * b

            def forward(y: Any) -> Any:  # the next tokens, started (as generate_step, decode runs ahead)
                nxt = mx.argmax(self.model(y[:, None], cache=kv)[:, -1, :], axis=-1)
                mx.async_eval(nxt)
                return nxt

            nxt = forward(y)
            while True:
                for i, t in enumerate(y.tolist()):  # y is in the KV now: fed, whether or not the row goes on
                    fed[i].append(t)
                    if not done[i]:
                        answers[i].append(t)
                        done[i] = t in self.eos or len(answers[i]) >= self.max_tokens
                if all(done):
                    break
                y, nxt = nxt, forward(nxt)
            for c, f, a, full in zip(self.convs, fed, answers, fulls):
                c.kv_tokens = f[:kv[0].offset]
                self.answered(c, a)
                self.record(c, n, t0, ttft, len(full), kept, len(rows[0]), len(a))

    def serial(self) -> None:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        shared, shared_tokens = self.shared_kv([self.render(c.messages + [{"role": "user", "content": c.turns[0]}])
                                                for c in self.convs])  # timed: agent 0's first TTFT holds it
        for conv in self.convs:
            conv.kv = self.copy_kv(shared) if shared is not None else make_prompt_cache(self.model)
            conv.kv_tokens = list(shared_tokens)
        for n in range(1, len(self.convs[0].turns) + 1):
            for conv in self.convs:
                t0 = conv.ready
                full = self.prompt(conv, n)
                kept = min(common_prefix(full, conv.kv_tokens), len(full) - 1)
                for c in conv.kv:
                    c.trim(c.offset - kept)
                tokens: list[int] = []
                ttft = None
                for tok, _ in generate_step(self.mx.array(full[kept:]), self.model, prompt_cache=conv.kv,
                                            max_tokens=self.max_tokens, prefill_step_size=self.step):
                    ttft = self.now() - t0 if ttft is None else ttft
                    tokens.append(tok)
                    if tok in self.eos:
                        break
                conv.kv_tokens = (full + tokens)[:conv.kv[0].offset]
                self.answered(conv, tokens)
                self.record(conv, n, t0, ttft, len(full), kept, len(full) - kept, len(tokens))
                conv.ready = self.now()

    def batch(self) -> None:
        from mlx_lm.generate import BatchGenerator

        b = len(self.convs)
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in self.eos], max_tokens=self.max_tokens,
                             completion_batch_size=b, prefill_batch_size=b, prefill_step_size=self.step)
        live: dict[int, dict[str, Any]] = {}

        def submit(conv: Conv, n: int, full: list[int], t0: float | None = None) -> None:
            kept = min(common_prefix(full, conv.kv_tokens), len(full) - 1)
            for c in conv.kv or []:
                c.trim(c.offset - kept)
            (uid,) = gen.insert([full[kept:]], caches=[conv.kv], all_tokens=[list(full[:kept])])
            live[uid] = dict(conv=conv, n=n, t0=self.now() if t0 is None else t0, full=full, kept=kept, ttft=None,
                             tokens=[])

        fulls = [self.prompt(c, 1) for c in self.convs]
        shared, shared_tokens = self.shared_kv(fulls)  # timed: the first turns' clock starts before it
        for conv, full in zip(self.convs, fulls):
            if shared is not None:
                conv.kv, conv.kv_tokens = self.copy_kv(shared), list(shared_tokens)
            submit(conv, 1, full, 0.0)
        try:
            while live:
                for r in gen.next()[1]:
                    s = live[r.uid]
                    s["ttft"] = self.now() - s["t0"] if s["ttft"] is None else s["ttft"]
                    s["tokens"].append(r.token)
                    if r.finish_reason is None:
                        continue
                    del live[r.uid]
                    conv, n = s["conv"], s["n"]
                    conv.kv, conv.kv_tokens = r.prompt_cache, list(r.all_tokens)
                    self.answered(conv, s["tokens"])
                    self.record(conv, n, s["t0"], s["ttft"], len(s["full"]), s["kept"], len(s["full"]) - s["kept"],
                                len(s["tokens"]))
                    if n < len(conv.turns):
                        submit(conv, n + 1, self.prompt(conv, n + 1))
        finally:
            gen.close()

    def run(self, floor: str) -> dict[str, Any]:
        self.warm_up(len(self.convs) if floor != "serial" else 1)
        self.mx.reset_peak_memory()
        self.origin = time.perf_counter()
        getattr(self, floor)()
        return {"floor": floor, "title": TITLES[floor], "status": "ok", "summary": summarize(self.records),
                "mlx_peak_bytes": self.mx.get_peak_memory(), "device": str(self.mx.default_device()),
                "turns": sorted(self.records, key=lambda t: (t["agent"], t["turn"]))}


def floor_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--floor", choices=FLOORS, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    say(f"floor {args.floor} ({TITLES[args.floor]}): loading {spec['model']}")
    try:
        doc = Floor(spec).run(args.floor)
    except (RuntimeError, MemoryError, ValueError) as exc:
        if not any(w in str(exc).lower() for w in OOM_WORDS):
            raise
        say(f"floor {args.floor}: {OOM}: {exc}")
        doc = {"floor": args.floor, "title": TITLES[args.floor], "status": OOM, "error": str(exc)[:500]}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if doc["status"] == "ok" else 3


# --- agents_load's side: each floor in a process of its own, its memory from outside --------

def run_floors(floors: list[str], spec: dict[str, Any], work: Path, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Each floor in its own process, one after another, polled from outside
    (concurrency.MemoryWatch: nvidia-smi where it works, else RSS)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from concurrency import MemoryWatch, gpu_used_bytes

    work.mkdir(parents=True, exist_ok=True)
    (work / "floors_spec.json").write_text(json.dumps(spec))
    results: dict[str, dict[str, Any]] = {}
    for floor in floors:
        out = work / f"floor_{floor}.json"
        out.unlink(missing_ok=True)
        baseline = gpu_used_bytes()
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--spec",
                                 str(work / "floors_spec.json"), "--floor", floor, "--out", str(out)],
                                stderr=subprocess.PIPE, text=True)
        tail: deque[str] = deque(maxlen=40)

        def echo(stream: Any = proc.stderr, keep: deque[str] = tail) -> None:
            for line in stream:
                keep.append(line)
                sys.stderr.write(line)

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        with MemoryWatch(proc.pid, baseline) as watch:
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                tail.append(f"timed out after {timeout_s:.0f} s\n")
            except BaseException:  # interrupted: the floor goes with the benchmark
                proc.kill()
                raise
        reader.join(5)
        if out.is_file():
            doc = json.loads(out.read_text())
        else:
            text = "".join(tail)
            status = OOM if any(w in text.lower() for w in OOM_WORDS) else f"failed (exit status {rc})"
            doc = {"floor": floor, "title": TITLES[floor], "status": status, "error": text[-1500:]}
        doc["memory"] = watch.result()
        results[floor] = doc
        say(f"floor {floor}: {doc['status']}" + (f", {doc['summary']['turns_per_minute']:.1f} turns/min"
                                                   if doc["status"] == "ok" else ""))
    return results


if __name__ == "__main__":
    import os

    code = floor_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # MLX's CUDA backend can abort in its static destructors
