#!/usr/bin/env python3
"""Embeddings (issue 38): mlxd's /v1/embeddings against the reference
implementation of its default embedding model, sentence-transformers on the
same weights (all-MiniLM-L6-v2), side by side in one run on this machine.

Arms, alternated round by round over the same corpus (agents' memory
chunks: sentences to paragraphs, 5 to ~250 tokens, some past the model's
256-token limit):
- mlxd: a real `mlxd engine` process, the corpus posted as /v1/embeddings
  requests of --batch inputs each (truncate: true, as sentence-transformers
  cuts at 256 tokens), one request at a time, as an indexing agent sends them;
- sentence-transformers: `SentenceTransformer(folder).encode(request)` for the
  same requests of --batch inputs (a server answering the same calls; its own
  batch_size within a request --reference-batch), in a
  process of --reference-python (a virtualenv with sentence-transformers and
  PyTorch: not mlxd's dependencies), on the CPU with PyTorch's default threads
  (all cores) or --reference-threads.
Reported: inputs/s and tokens/s of each arm (the engine's own usage count),
the ratio, and the cosine of every input's two vectors (min and mean).

--beside: the embedding model resident beside the chat model (the default
one), measured from outside: the engine's RSS with the chat model alone and
with the encoder loaded too, the encoder's load, and a streamed chat answer
alone against the same answer while embedding requests of --batch inputs
arrive back to back (its tokens/s and its longest pause between tokens), and
those requests' latency. What a swap (one model at a time) would cost
instead is a reload of the chat model for every switch: /health's
last_load_s.

  python3 -m venv /tmp/st && /tmp/st/bin/pip install torch==2.13.0 sentence-transformers
  .venv/bin/python bench/embeddings.py --reference-python /tmp/st/bin/python
  .venv/bin/python bench/embeddings.py --beside                      # no reference needed
  .venv/bin/python bench/embeddings.py --reference-python /tmp/st/bin/python \\
      --write-reference tests/engine/data/minilm_reference.json    # the test's vectors, from the reference
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import RESULTS, machine_info, md_table, say, start_engine, stop_all_children, write_json  # noqa: E402

from mlxd import default_embedding  # noqa: E402

WORDS = ("the agent stored a note about the repository build failing on the release branch because a test "
         "timed out while the cache was warming and the user asked to retry later with more memory for the "
         "model server running on a laptop").split()
# The test's fixed inputs (tests/engine/data/): plain, Unicode, code, a word, one past the 256-token limit.
FIXTURE_TEXTS = ["The capital of France is Paris.", "An agent stores what it learned in a vector database.",
                 "Déjà vu: naïve café owners serve crème brûlée — ünïcödé and emoji 🚀.",
                 "def add(a, b):\n    return a + b  # a Python function", "short",
                 " ".join(f"word{i}" for i in range(400))]

REFERENCE_SCRIPT = r"""
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
import sentence_transformers
args = json.loads(sys.argv[1])
if args["threads"]:
    torch.set_num_threads(args["threads"])
model = SentenceTransformer(args["folder"], device="cpu")
texts = json.load(open(args["corpus"]))
model.encode(texts[:args["batch"]], batch_size=args["inner"])  # warm
out = []
for _ in range(args["rounds"]):
    started = time.perf_counter()
    vectors = [v for i in range(0, len(texts), args["batch"])
               for v in model.encode(texts[i:i + args["batch"]], batch_size=args["inner"]).tolist()]
    out.append(time.perf_counter() - started)
json.dump({"seconds": out, "vectors": vectors, "threads": torch.get_num_threads(),
           "version": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}"},
          open(args["out"], "w"))
"""


def corpus(n: int, seed: int = 0) -> list[str]:
    """Agents' memory chunks: 4 to ~200 words, a tenth past the model's limit."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        words = rng.randint(4, 40) if i % 3 else rng.randint(40, 200)
        if i % 10 == 9:
            words = 300
        texts.append(" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + ".")
    return texts


def reference(python: str, folder: Path, texts: list[str], batch: int, rounds: int, threads: int,
              inner: int | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        corpus_path, out = Path(tmp) / "corpus.json", Path(tmp) / "out.json"
        corpus_path.write_text(json.dumps(texts))
        args = {"folder": str(folder), "corpus": str(corpus_path), "batch": batch, "rounds": rounds,
                "threads": threads, "inner": inner or batch, "out": str(out)}
        subprocess.run([python, "-c", REFERENCE_SCRIPT, json.dumps(args)], check=True,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        return json.loads(out.read_text())


def mlxd_arm(url: str, texts: list[str], batch: int, rounds: int, clients: int = 1,
             encoding: str = "float") -> dict[str, Any]:
    """The corpus as requests of `batch` inputs, sent by `clients` clients at once (each takes the next request
    when its last is answered), the vectors as floats or as base64 (what the openai client asks for)."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import threading

    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    local = threading.local()  # a session (kept-alive connection) per client

    def post(chunk: list[str]) -> tuple[list[list[float]], int]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        resp = local.session.post(url + "/v1/embeddings", timeout=300, json={
            "model": "embedding", "input": chunk, "truncate": True, "encoding_format": encoding})
        resp.raise_for_status()
        body = resp.json()
        if encoding == "base64":
            rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in body["data"]]
        else:
            rows = [d["embedding"] for d in body["data"]]
        return rows, body["usage"]["prompt_tokens"]

    def once() -> tuple[list[list[float]], int]:
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(post, chunks))
        return [v for rows, _ in answers for v in rows], sum(t for _, t in answers)

    once()  # warm: the load, the first shapes
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        vectors, tokens = once()
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "vectors": vectors, "tokens": tokens}


def chat_stream(url: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed answer's tokens/s and its longest pause between chunks."""
    arrivals: list[float] = []
    started = time.perf_counter()
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=600, json={
            "model": "default", "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.zeros(1)
    return {"chunks": len(arrivals), "tokens_per_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
            "max_gap_ms": float(gaps.max() * 1000), "p50_gap_ms": float(np.median(gaps) * 1000),
            "ttft_s": arrivals[0] - started}


def beside(folder: Path, batch: int, max_tokens: int) -> dict[str, Any]:
    """The encoder beside the default chat model, measured from outside (see the module's doc)."""
    import threading

    import psutil

    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-beside-"))
    engine = start_engine(home, {"engine": {"keep_alive": "-1"}, "embeddings": {"embedding": {"path": str(folder)}}},
                          home / "engine.log")
    texts = corpus(batch)
    try:
        engine.wait_ready(300)
        health = lambda: requests.get(engine.url + "/health", timeout=10).json()  # noqa: E731
        pid = health()["pid"]
        chat_stream(engine.url, 8)
        rss_chat = psutil.Process(pid).memory_info().rss
        started = time.perf_counter()
        requests.post(engine.url + "/v1/embeddings", json={"model": "embedding", "input": texts, "truncate": True},
                      timeout=300).raise_for_status()
        first_embed_s = time.perf_counter() - started
        rss_both = psutil.Process(pid).memory_info().rss
        alone = chat_stream(engine.url, max_tokens)
        latencies: list[float] = []
        stop = threading.Event()

        def embed_loop() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                requests.post(engine.url + "/v1/embeddings", timeout=300,
                              json={"model": "embedding", "input": texts, "truncate": True}).raise_for_status()
                latencies.append(time.perf_counter() - t0)

        loop = threading.Thread(target=embed_loop)
        loop.start()
        try:
            with_embeddings = chat_stream(engine.url, max_tokens)
        finally:
            stop.set()
            loop.join()
        h = health()
        return {"model": h["resident_model"], "rss_chat_model_bytes": rss_chat, "rss_with_encoder_bytes": rss_both,
                "encoder_rss_bytes": rss_both - rss_chat, "first_embedding_request_s": first_embed_s,
                "chat_model_load_s": h["timings"].get("last_load_s"), "chat_alone": alone,
                "chat_with_embeddings": with_embeddings, "embedding_requests_during_chat": len(latencies),
                "embedding_latency_p50_s": float(np.median(latencies)) if latencies else None}
    finally:
        stop_all_children()


def cosines(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-python", help="a Python with sentence-transformers and torch")
    ap.add_argument("--beside", action="store_true", help="the encoder beside the default chat model (no reference)")
    ap.add_argument("--max-tokens", type=int, default=200, help="--beside: the chat answer's length")
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32, help="inputs a request (both arms)")
    ap.add_argument("--reference-batch", type=int, help="sentence-transformers' own batch_size within a request "
                    "(default: --batch); e.g. --batch 512 --reference-batch 32: the whole corpus in one call, "
                    "each arm batching it its own best way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=1, help="mlxd: clients sending the requests at once")
    ap.add_argument("--encoding", choices=("float", "base64"), default="float",
                    help="mlxd: the answer's encoding_format (the openai client asks for base64)")
    ap.add_argument("--reference-threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    ap.add_argument("--write-reference", type=Path, help="write the test fixture's vectors from the reference")
    ap.add_argument("--out", type=Path, default=RESULTS / "embeddings.json")
    args = ap.parse_args()
    folder = default_embedding.fetch(say)
    if folder is None:
        sys.exit("the default embedding model is not fetched (./scripts/setup.sh)")
    if args.beside:
        got = beside(folder, args.batch, args.max_tokens)
        a, b = got["chat_alone"], got["chat_with_embeddings"]
        say(md_table(["chat answer", "tokens/s", "p50 gap", "longest gap"], [
            ["alone", f"{a['tokens_per_s']:.1f}", f"{a['p50_gap_ms']:.1f} ms", f"{a['max_gap_ms']:.1f} ms"],
            [f"with {got['embedding_requests_during_chat']} embedding requests of {args.batch} inputs",
             f"{b['tokens_per_s']:.1f}", f"{b['p50_gap_ms']:.1f} ms", f"{b['max_gap_ms']:.1f} ms"]]))
        say(f"{got['model']}: RSS {got['rss_chat_model_bytes'] / 2**20:.0f} MiB; with the encoder "
            f"{got['rss_with_encoder_bytes'] / 2**20:.0f} MiB (+{got['encoder_rss_bytes'] / 2**20:.0f} MiB); first "
            f"embedding request (load included) {got['first_embedding_request_s']:.2f} s; embedding latency p50 during "
            f"the chat {got['embedding_latency_p50_s']:.2f} s; a chat model load {got['chat_model_load_s']} s")
        write_json(args.out.with_name("embeddings_beside.json"), {"benchmark": "embeddings --beside",
                                                                  "machine": machine_info(), **got})
        return
    if not args.reference_python:
        sys.exit("--reference-python is needed (or --beside)")
    if args.write_reference:
        ref = reference(args.reference_python, folder, FIXTURE_TEXTS, 32, 1, args.reference_threads)
        write_json(args.write_reference, {"model": "sentence-transformers/all-MiniLM-L6-v2", "reference":
                                          ref["version"] + ", CPU", "texts": FIXTURE_TEXTS,
                                          "vectors": [[round(x, 6) for x in v] for v in ref["vectors"]]})
        say(f"wrote {args.write_reference}")
        return
    texts = corpus(args.inputs)
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-embeddings-"))
    engine = start_engine(home, {"engine": {"keep_alive": "-1"}, "models": {"demo": {"demo": "a"}},
                                 "embeddings": {"embedding": {"path": str(folder)}}}, home / "engine.log")
    try:
        engine.wait_ready(120)
        runs: dict[str, list[float]] = {"mlxd": [], "sentence-transformers": []}
        mine = theirs = None
        for r in range(args.rounds):  # alternated: the machine's drift falls on both arms
            say(f"round {r + 1}/{args.rounds}: mlxd")
            mine = mlxd_arm(engine.url, texts, args.batch, 1, args.clients, args.encoding)
            runs["mlxd"] += mine["seconds"]
            say(f"round {r + 1}/{args.rounds}: sentence-transformers")
            theirs = reference(args.reference_python, folder, texts, args.batch, 1, args.reference_threads,
                               args.reference_batch)
            runs["sentence-transformers"] += theirs["seconds"]
    finally:
        stop_all_children()
    assert mine is not None and theirs is not None
    sims = cosines(mine["vectors"], theirs["vectors"])
    best = {arm: min(s) for arm, s in runs.items()}
    rate = {arm: len(texts) / s for arm, s in best.items()}
    rows = [[arm, f"{rate[arm]:.1f}", f"{mine['tokens'] / best[arm]:.0f}", f"{best[arm]:.2f} s",
             ", ".join(f"{s:.2f}" for s in runs[arm])] for arm in runs]
    say(md_table(["arm", "inputs/s (best round)", "tokens/s", "best", "rounds (s)"], rows))
    say(f"mlxd / sentence-transformers: {rate['mlxd'] / rate['sentence-transformers']:.2f}x "
        f"(torch threads {theirs['threads']}, {theirs['version']}); cosine min {sims.min():.6f}, "
        f"mean {sims.mean():.6f} over {len(texts)} inputs ({mine['tokens']} tokens)")
    write_json(args.out, {"benchmark": "embeddings", "machine": machine_info(), "settings": vars(args) | {
        "write_reference": None, "out": str(args.out)}, "seconds": runs, "inputs_per_s": rate,
        "ratio": rate["mlxd"] / rate["sentence-transformers"], "cosine_min": float(sims.min()),
        "cosine_mean": float(sims.mean()), "tokens": mine["tokens"], "reference": theirs["version"],
        "reference_threads": theirs["threads"]})


if __name__ == "__main__":
    main()
