"""Several engines behind one gateway (issue 15): aggregate throughput with
N = 1, 2, 3 engines, and what a host that dies mid-run costs.

Every engine is a real `mlxd engine` on its own loopback port and home (a
stand-in for another Mac running mlxd); the gateway is a real `mlxd gateway`
whose one model lists them all in `hosts`, so LiteLLM's router spreads the
requests (gateway/litellm_config.py); the Ollama stand-in is the fallback.

Throughput: for each N, 2N closed-loop clients send non-streamed requests
(`max_tokens` tokens each, distinct prompts) for `--seconds`; the figure is
completion tokens / wall time, and the ratio is against N = 1 in the same
run. Which host served each request comes from LiteLLM's
`x-litellm-model-api-base` response header.

Kill: with the largest N, the clients (half of them streaming) run while one
engine is SIGKILLed and, later, restarted on its port. Counted: requests
lost (an error, or a stream cut after content), answers from Ollama, the
requests that paid a failed attempt on the dead host
(`x-litellm-attempted-retries` or `-fallbacks` > 0) and when, and the time from the
restarted engine answering /health to its first request through the gateway.

    .venv/bin/python bench/hosts.py                 # ~3 min on 2 cores
    .venv/bin/python bench/hosts.py --engines 1,2 --seconds 10
Ranks (`--ranks`): the same model in one engine process and in a rank
group of two (mlx.launch, ring backend, loopback; engine/model/ranks.py), one
streamed request at a time, alternating: decode tok/s of each, and the
ratio. On CPU both ranks share this machine's cores.

    .venv/bin/python bench/hosts.py --ranks --variant c
Results: bench/results/hosts.json (every request).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (RESULTS, BenchError, Server, demo_model, machine_info, say, spawn,  # noqa: E402
                      stop_all_children, stop_child, write_json)
from benchkit import start_engine as start_engine_alone  # noqa: E402

from mlxd.devkit.engine_process import MLXD, mlxd_env  # noqa: E402

from mlxd.devkit.ollama_standin import start_standin  # noqa: E402
from mlxd.devkit.ports import free_port, free_port_run  # noqa: E402
from mlxd.toml_text import dumps  # noqa: E402

OLLAMA_MODEL = "llama3.2:3b"
STANDIN_MARK = "[ollama-standin:"
PROMPT = "Tell me about the weather in the mountains in spring, in some detail."


@dataclass
class Request:
    client: int
    stream: bool
    t_start: float
    t_end: float = 0.0
    outcome: str = "failed"  # ok | ollama | failed | stream_cut
    tokens: int = 0
    host: str | None = None  # the engine that answered (LiteLLM's header)
    retries: int = 0  # failed attempts before the answer
    error: str | None = None


def engine_config(model: Path) -> dict[str, Any]:
    return {"engine": {"stuck_grace_s": 600}, "models": {"bench": {"path": model}}, "aliases": {"default": "bench"}}


def start_engine(home: Path, model: Path, port: int, name: str) -> Server:
    return start_engine_alone(home, engine_config(model), home / f"engine-{time.time_ns()}.log", name, port=port)


def start_gateway(home: Path, model: Path, engine_ports: list[int], ollama_url: str, cooldown_s: float) -> Server:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (home / "mlxd.toml").write_text(dumps({
        "engine": {"port": free_port()},
        "gateway": {"port": port, "ollama_url": ollama_url, "host_cooldown_s": cooldown_s},
        "models": {"bench": {"path": model, "ollama": OLLAMA_MODEL,
                             "hosts": [f"127.0.0.1:{p}" for p in engine_ports]}},
        "aliases": {"default": "bench"}}))
    return spawn("mlxd gateway", [*MLXD, "gateway"], mlxd_env(home), home / "gateway.log", port, "/mlxd/health")


def one_request(session: requests.Session, url: str, key: str, client: int, n: int, stream: bool,
                max_tokens: int) -> Request:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"{PROMPT} (client {client}, question {n})"}]}
    r = Request(client, stream, time.monotonic())
    try:
        resp = session.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=300,
                            headers={"Authorization": f"Bearer {key}"})
        r.host = resp.headers.get("x-litellm-model-api-base")
        # a failed attempt is retried, or failed over to another host of the group (a fallback hop)
        r.retries = sum(int(resp.headers.get(h) or 0) for h in ("x-litellm-attempted-retries",
                                                                "x-litellm-attempted-fallbacks"))
        if resp.status_code != 200:
            r.error = f"{resp.status_code}: {resp.text[:200]}"
        elif not stream:
            doc = resp.json()
            text = doc["choices"][0]["message"]["content"] or ""
            r.tokens = doc.get("usage", {}).get("completion_tokens", 0)
            r.outcome = "ollama" if text.startswith(STANDIN_MARK) else "ok"
        else:
            text, done, finished = "", False, False
            for line in resp.iter_lines():
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        r.error = str(chunk["error"])[:200]
                        continue
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        text += piece
                        r.tokens += bool(piece)
                        finished = finished or choice.get("finish_reason") is not None
            if done and finished and r.error is None:
                r.outcome = "ollama" if text.startswith(STANDIN_MARK) else "ok"
            else:
                r.outcome = "stream_cut" if text else "failed"
    except (requests.RequestException, ValueError, KeyError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"[:200]
        r.outcome = "stream_cut" if stream and r.tokens else "failed"
    r.t_end = time.monotonic()
    return r


def drive(url: str, key: str, clients: int, seconds: float, max_tokens: int, stream_every: int,
          during=None) -> list[Request]:
    """`clients` closed-loop clients for `seconds`; `during(t0)` runs meanwhile (the kill)."""
    done: list[Request] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(k: int) -> None:
        session, n = requests.Session(), 0
        while time.monotonic() - t0 < seconds:
            stream = stream_every > 0 and (k + n) % stream_every == 0
            r = one_request(session, url, key, k, n, stream, max_tokens)
            with lock:
                done.append(r)
            n += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    if during is not None:
        during(t0)
    for t in threads:
        t.join()
    for r in done:
        r.t_start, r.t_end = r.t_start - t0, r.t_end - t0
    return done


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def throughput(reqs: list[Request]) -> dict:
    served = [r for r in reqs if r.outcome == "ok"]
    wall = max(r.t_end for r in reqs) - min(r.t_start for r in reqs)
    tokens = sum(r.tokens for r in served)
    hosts: dict[str, int] = {}
    for r in served:
        hosts[r.host or "?"] = hosts.get(r.host or "?", 0) + 1
    return {"requests": len(reqs), "served_by_mlx": len(served), "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2), "per_host": hosts,
            "not_ok": {o: sum(r.outcome == o for r in reqs) for o in ("ollama", "failed", "stream_cut")}}


def run(args: argparse.Namespace) -> dict:
    label, model = demo_model(args.variant)
    root = Path(tempfile.mkdtemp(prefix="mlxd-bench-hosts-"))
    doc: dict = {"machine": machine_info(), "model": label, "settings": vars(args), "throughput": {}, "kill": {}}
    with start_standin(models=(OLLAMA_MODEL,)) as standin:
        for n in args.engines:
            ports = [free_port() for _ in range(n)]
            engines = [start_engine(root / f"n{n}-e{i}", model, p, f"engine {i}") for i, p in enumerate(ports)]
            for e in engines:
                e.wait_ready(180)
            gateway = start_gateway(root / f"n{n}-gw", model, ports, standin.url, args.cooldown)
            gateway.wait_ready(180)
            key = (root / f"n{n}-gw" / "key").read_text().strip()
            say(f"N = {n}: warming up")
            drive(gateway.url, key, 2 * n, 2, args.max_tokens, 0)
            say(f"N = {n}: {2 * n} clients for {args.seconds:.0f} s")
            cpu_before = {name: cpu_s(s.proc.pid) for name, s in (("gateway", gateway), *(
                (f"engine {i}", e) for i, e in enumerate(engines)))}
            reqs = drive(gateway.url, key, 2 * n, args.seconds, args.max_tokens, 0)
            t = throughput(reqs)
            # Where the cores went: each process's CPU seconds over the run's wall time.
            cores = {name: round((cpu_s(s.proc.pid) - cpu_before[name]) / t["wall_s"], 2) for name, s in (
                ("gateway", gateway), *((f"engine {i}", e) for i, e in enumerate(engines)))}
            doc["throughput"][n] = {**t, "clients": 2 * n, "cores_used": cores}
            say(f"N = {n}: {doc['throughput'][n]}")
            if n == max(args.engines) and n > 1:
                doc["kill"] = kill_run(gateway, key, engines, ports, root / f"n{n}-e1", model, args)
            for s in [gateway, *engines]:
                stop_child(s.proc)
    base = doc["throughput"].get(1, {}).get("tok_s")
    for n, t in doc["throughput"].items():
        t["vs_one_engine"] = round(t["tok_s"] / base, 3) if base else None
    doc["requests_note"] = "every request of the kill run is in kill.requests"
    return doc


def kill_run(gateway: Server, key: str, engines: list[Server], ports: list[int], home: Path, model: Path,
             args: argparse.Namespace) -> dict:
    victim = engines[1]
    victim_base = f"http://127.0.0.1:{ports[1]}/v1"
    marks: dict[str, float] = {}

    def during(t0: float) -> None:
        time.sleep(args.kill_at)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        marks["killed"] = time.monotonic() - t0
        say(f"kill: engine 1 SIGKILLed at {marks['killed']:.1f} s")
        time.sleep(max(0.0, args.restart_at - (time.monotonic() - t0)))
        back = start_engine(home, model, ports[1], "engine 1 (restarted)")
        marks["restarted"] = time.monotonic() - t0
        back.wait_ready(180)
        marks["healthy_again"] = time.monotonic() - t0
        engines[1] = back
        say(f"kill: engine 1 healthy again at {marks['healthy_again']:.1f} s")

    clients = 2 * len(engines)
    reqs = drive(gateway.url, key, clients, args.kill_seconds, args.max_tokens, 2, during)
    killed, healthy = marks["killed"], marks.get("healthy_again")
    during_outage = [r for r in reqs if r.t_end > killed and (healthy is None or r.t_start < healthy)]
    paid = sorted(round(r.t_start - killed, 2) for r in during_outage if r.retries > 0)
    served_after = sorted(r.t_end for r in reqs if r.host == victim_base and r.outcome == "ok"
                          and healthy is not None and r.t_start >= marks["restarted"])
    return {
        "clients": clients, "marks_s": {k: round(v, 2) for k, v in marks.items()},
        "requests": len(reqs),
        "lost": sum(r.outcome == "failed" for r in reqs),
        "streams_cut": sum(r.outcome == "stream_cut" for r in reqs),
        "answered_by_ollama": sum(r.outcome == "ollama" for r in reqs),
        "in_flight_on_victim_at_kill": sum(r.t_start < killed < r.t_end for r in reqs if r.host == victim_base),
        "paid_a_failed_attempt_s_after_kill": paid,
        "return_s": round(served_after[0] - healthy, 2) if served_after else None,
        "all": [asdict(r) for r in reqs],
    }


def decode_tok_s(url: str, max_tokens: int) -> float:
    """One streamed request: (content chunks - 1) / (last - first chunk)."""
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    times = []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: {") and (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get(
                    "content"):
                times.append(time.monotonic())
    if len(times) < 3:
        raise BenchError(f"only {len(times)} content chunks from {url}")
    return (len(times) - 1) / (times[-1] - times[0])


def ranks_run(args: argparse.Namespace) -> dict:
    from mlxd.config import RanksConfig
    from mlxd.supervisor.rank_group import launch_argv

    label, model = demo_model(args.variant)
    root = Path(tempfile.mkdtemp(prefix="mlxd-bench-ranks-"))
    single = start_engine(root / "one", model, free_port(), "one-process engine")
    home = root / "group"
    config = engine_config(model)
    config["engine"]["ranks"] = {"hosts": ["127.0.0.1", "127.0.0.1"]}
    ring = RanksConfig(hosts=["127.0.0.1", "127.0.0.1"], starting_port=free_port_run(2))  # rank r binds port + r
    group = start_engine_alone(home, config, home / "group.log", "rank group",
                               launcher=launch_argv(ring, sys.executable))
    single.wait_ready(300)
    group.wait_ready(300)
    samples: dict[str, list[float]] = {"one process": [], "2 ranks": []}
    for url in (single.url, group.url):  # warm-up
        decode_tok_s(url, 8)
    for rnd in range(args.rounds):
        for name, server in (("one process", single), ("2 ranks", group)):
            samples[name].append(decode_tok_s(server.url, args.max_tokens))
            say(f"round {rnd}: {name}: {samples[name][-1]:.2f} tok/s")
    stop_child(group.proc)
    stop_child(single.proc)
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    return {"machine": machine_info(), "model": label, "settings": vars(args), "decode_tok_s": samples,
            "median": med, "ratio_2_ranks": round(med["2 ranks"] / med["one process"], 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--seconds", type=float, default=20.0, help="each throughput run")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--variant", default="a", help="demo model variant")
    p.add_argument("--cooldown", type=float, default=5.0, help="gateway.host_cooldown_s")
    p.add_argument("--kill-seconds", type=float, default=30.0)
    p.add_argument("--kill-at", type=float, default=8.0)
    p.add_argument("--restart-at", type=float, default=16.0)
    p.add_argument("--ranks", action="store_true", help="one process vs a 2-rank group instead")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or RESULTS / ("ranks.json" if args.ranks else "hosts.json")
    try:
        doc = ranks_run(args) if args.ranks else run(args)
    except BenchError as exc:
        say(f"hosts: {exc}")
        return 1
    finally:
        stop_all_children()
    write_json(args.out, doc)
    if args.ranks:
        print(f"decode tok/s, medians of {args.rounds}: {doc['median']}; 2 ranks / one process = "
              f"{doc['ratio_2_ranks']}")
        return 0
    for n, t in doc["throughput"].items():
        print(f"N={n}: {t['tok_s']} tok/s ({t['vs_one_engine']}x one engine), {t['clients']} clients, "
              f"per host {t['per_host']}, not ok {t['not_ok']}, cores used {t['cores_used']}")
    k = {key: v for key, v in doc["kill"].items() if key != "all"}
    print("kill:", json.dumps(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
