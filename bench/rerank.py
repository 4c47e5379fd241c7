#!/usr/bin/env python3
"""Rerank (issue 53): mlxd's /v1/rerank against sentence-transformers on the
same weights, side by side in one run on this machine, and the memory a
resident cross-encoder takes, measured from outside.

- Order: the hand-written sets of tests/rerank_sets.py (the relevant
  document first in each?), through a real engine's default reranker
  (all-MiniLM-L6-v2's cosine) and a cross-encoder folder (--cross-encoder;
  default: devkit.tiny_encoders' BERT cross-encoder, random weights: its
  order means nothing, its fidelity does).
- Fidelity: Spearman's rank correlation of mlxd's scores with
  sentence-transformers' (`SentenceTransformer.similarity` for the default,
  `CrossEncoder.predict` for the cross-encoder), every (query, document) pair
  pooled, and the largest difference of a score.
- Speed: documents a second, one query against --documents passages of an
  agent's memory, best of --rounds, mlxd over HTTP (one request) against
  sentence-transformers in a process of --reference-python.
- Memory: the engine's RSS with the chat and embedding models, then with
  the cross-encoder resident too, against the cross-encoder's weights and the
  engine's budget (its /health).

  .venv/bin/python bench/rerank.py --reference-python /tmp/st/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from benchkit import RESULTS, machine_info, md_table, say, start_engine, stop_all_children, write_json  # noqa: E402
from embeddings import corpus  # noqa: E402
from rerank_sets import RANKING_SETS  # noqa: E402

from mlxd import default_embedding  # noqa: E402

REFERENCE_SCRIPT = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from sentence_transformers import CrossEncoder, SentenceTransformer
jobs = json.load(open(args["jobs"]))
out = {}
bi = SentenceTransformer(args["minilm"], device="cpu")
ce = CrossEncoder(args["cross"], device="cpu")
def bi_scores(q, docs):
    e = bi.encode([q] + docs, batch_size=32)
    return bi.similarity(e[:1], e[1:])[0].tolist()
def ce_scores(q, docs):
    return [float(x) for x in ce.predict([(q, d) for d in docs], batch_size=32)]
for name, fn in (("minilm", bi_scores), ("cross", ce_scores)):
    out[name] = [fn(q, docs) for q, docs in jobs["sets"]]
    fn(jobs["speed_query"], jobs["speed_docs"][:32])  # warm
    times = []
    for _ in range(args["rounds"]):
        t = time.perf_counter(); fn(jobs["speed_query"], jobs["speed_docs"]); times.append(time.perf_counter() - t)
    out[name + "_seconds"] = times
json.dump(out, open(args["out"], "w"))
"""


def minilm_sized_cross_encoder(minilm: Path, dest: Path) -> Path:
    """A cross-encoder of a real one's size (ms-marco-MiniLM-L6-v2's shape: 22.7M parameters): all-MiniLM-L6-v2's
    encoder under a seeded random classifier. Its order means nothing; its speed and memory are a real one's."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    weights = {f"bert.{k}": v for k, v in load_file(str(minilm / "model.safetensors")).items()
               if not k.endswith("position_ids")}
    rng = np.random.default_rng(53)
    weights["classifier.weight"] = rng.normal(0, 0.05, (1, 384)).astype(np.float32)
    weights["classifier.bias"] = np.zeros(1, np.float32)
    save_file(weights, str(dest / "model.safetensors"))
    config = json.loads((minilm / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm / name, dest / name)
    return dest


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def mlxd_scores(url: str, model: str, query: str, documents: list[str]) -> list[float]:
    resp = requests.post(url + "/v1/rerank", json={"model": model, "query": query, "documents": documents},
                         timeout=300)
    resp.raise_for_status()
    scores = [0.0] * len(documents)
    for r in resp.json()["results"]:
        scores[r["index"]] = r["relevance_score"]
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-python", required=True, help="a Python with sentence-transformers and torch")
    ap.add_argument("--cross-encoder", help="a cross-encoder folder; 'tiny' (devkit.tiny_encoders' BERT one), or "
                    "'minilm-sized' (the default: all-MiniLM-L6-v2's encoder under a random classifier)",
                    default="minilm-sized")
    ap.add_argument("--documents", type=int, default=256, help="passages ranked against one query, for the speed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "rerank.json")
    args = ap.parse_args()
    minilm = default_embedding.fetch(say)
    if minilm is None:
        sys.exit("the default embedding model is not fetched (./scripts/setup.sh)")
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-rerank-"))
    if args.cross_encoder == "tiny":
        from mlxd.devkit import tiny_encoders

        cross = tiny_encoders.build("bert-cross-encoder", home / "cross", minilm)
    elif args.cross_encoder == "minilm-sized":
        cross = minilm_sized_cross_encoder(minilm, home / "cross")
    else:
        cross = Path(args.cross_encoder)
    sets = [(q, docs) for q, docs, _ in RANKING_SETS]
    speed_query, speed_docs = "why did the release build fail on the laptop?", corpus(args.documents, seed=7)
    engine = start_engine(home, {"engine": {"keep_alive": "-1"}, "embeddings": {"embedding": {"path": str(minilm)}},
                                 "rerankers": {"reranker": {"embedding": "embedding"},
                                               "cross": {"path": str(cross)}}}, home / "engine.log")
    try:
        engine.wait_ready(300)
        health = lambda: requests.get(engine.url + "/health", timeout=10).json()  # noqa: E731
        import psutil

        pid = health()["pid"]
        mine: dict[str, Any] = {}
        mlxd_scores(engine.url, "reranker", *sets[0])  # the embedding model resident
        rss_before = psutil.Process(pid).memory_info().rss
        mlxd_scores(engine.url, "cross", *sets[0])  # the cross-encoder resident too
        rss_after = psutil.Process(pid).memory_info().rss
        h = health()
        for name, model in (("minilm", "reranker"), ("cross", "cross")):
            mine[name] = [mlxd_scores(engine.url, model, q, docs) for q, docs in sets]
            mlxd_scores(engine.url, model, speed_query, speed_docs[:32])
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                mlxd_scores(engine.url, model, speed_query, speed_docs)
                times.append(time.perf_counter() - started)
            mine[name + "_seconds"] = times
        with tempfile.TemporaryDirectory() as tmp:
            jobs, out = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
            jobs.write_text(json.dumps({"sets": sets, "speed_query": speed_query, "speed_docs": speed_docs}))
            subprocess.run([args.reference_python, "-c", REFERENCE_SCRIPT, json.dumps({
                "jobs": str(jobs), "out": str(out), "minilm": str(minilm), "cross": str(cross),
                "rounds": args.rounds})], check=True, env={"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                                           "PATH": "/usr/bin:/bin"})
            theirs = json.loads(out.read_text())
    finally:
        stop_all_children()
    rows, report = [], {}
    for name, label in (("minilm", "default reranker (all-MiniLM-L6-v2 cosine)"), ("cross", f"cross-encoder {cross.name}")):
        ours_flat = [s for scores in mine[name] for s in scores]
        ref_flat = [s for scores in theirs[name] for s in scores]
        first = sum(int(np.argmax(scores)) == rel for scores, (_, _, rel) in zip(mine[name], RANKING_SETS))
        rate = {"mlxd": args.documents / min(mine[name + "_seconds"]),
                "sentence-transformers": args.documents / min(theirs[name + "_seconds"])}
        report[name] = {"relevant_first": first, "sets": len(sets), "spearman_pooled": spearman(ours_flat, ref_flat),
                        "max_abs_diff": float(np.max(np.abs(np.subtract(ours_flat, ref_flat)))),
                        "documents_per_s": rate, "ratio": rate["mlxd"] / rate["sentence-transformers"]}
        rows.append([label, f"{first}/{len(sets)}", f"{report[name]['spearman_pooled']:.6f}",
                     f"{report[name]['max_abs_diff']:.1e}", f"{rate['mlxd']:.0f}", f"{rate['sentence-transformers']:.0f}",
                     f"{report[name]['ratio']:.2f}x"])
    say(md_table(["reranker", "relevant first", "Spearman vs s-t", "max |diff|", "mlxd docs/s",
                  "s-t docs/s", "ratio"], rows))
    weights = sum(f.stat().st_size for f in Path(cross).glob("*.safetensors"))
    memory = {"rss_chat_and_embedding_bytes": rss_before, "rss_with_cross_encoder_bytes": rss_after,
              "cross_encoder_weights_bytes": weights, "budget_bytes": h["memory"]["budget_bytes"],
              "reranker_model": h.get("reranker_model")}
    say(f"RSS {rss_before / 2**20:.0f} MiB with the chat and embedding models, {rss_after / 2**20:.0f} MiB with the "
        f"cross-encoder resident too (+{(rss_after - rss_before) / 2**20:.1f} MiB; its weights "
        f"{weights / 2**20:.1f} MiB); the engine's budget {memory['budget_bytes'] / 2**30:.1f} GiB")
    write_json(args.out, {"benchmark": "rerank", "machine": machine_info(), "settings": {
        "documents": args.documents, "rounds": args.rounds, "cross_encoder": str(cross)}, **report, "memory": memory})


if __name__ == "__main__":
    main()
