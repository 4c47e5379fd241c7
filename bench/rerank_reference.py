#!/usr/bin/env python3
"""The cross-encoder test's reference (issue 53): sentence-transformers'
scores for each tiny cross-encoder of mlxd.devkit.tiny_encoders
(CROSS_KINDS: BERT with its default Sigmoid, with Identity named in
config.json as sentence-transformers 4 and 5 wrote it and in
config_sentence_transformers.json as 6 writes it, and XLM-R), and for the
default reranker (the real all-MiniLM-L6-v2: the cosine of the query's and
each document's embeddings), over the hand-written sets of
tests/rerank_sets.py plus long ones that the tokenizers cut, written to
tests/engine/data/rerank_reference.json, which
tests/engine/test_cross_encoder.py compares mlxd with.

The folders are built here (mlx's virtualenv: numpy, safetensors, tokenizers
and the default embedding model's vocabulary) into a temporary folder, then
scored by `CrossEncoder(folder, device="cpu").predict(pairs)` (its own
activation) and `SentenceTransformer(minilm, device="cpu")`'s
`similarity(query, documents)` in a process of --reference-python (a
virtualenv with sentence-transformers and PyTorch, not mlxd's
dependencies). The builder is seeded: the json keeps each folder's
model.safetensors sha256 (and the token ids of each pair as
sentence-transformers cut them), which the test checks first.

  python3 -m venv /tmp/st && /tmp/st/bin/pip install torch==2.13.0 sentence-transformers
  .venv/bin/python bench/rerank_reference.py --reference-python /tmp/st/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "engine" / "data" / "rerank_reference.json"
MINILM_KEY = "minilm-cosine"

_WORDS = ("the river carries silt from the mountains to the delta where farmers grow rice and the tide comes in "
          "twice a day while engineers measure the flow and write reports about floods drought and the old bridge")


def _long(words: int, start: int = 0) -> str:
    pool = _WORDS.split()
    return " ".join(pool[(start + i) % len(pool)] for i in range(words)).capitalize() + "."


# Pairs over the cross-encoders' 128 tokens (and MiniLM's 256): a long document beside short ones, and a long
# query with long documents (longest_first cuts both).
LONG_SETS: list[tuple[str, list[str]]] = [
    ("What carries silt to the delta?",
     [_long(300), "The river carries silt to the delta.", _long(150, 7)]),
    (_long(90, 3) + " What happens at the delta?",
     [_long(200, 11), _long(60, 5), "Rice grows in the delta."]),
]

REFERENCE_SCRIPT = r"""
import json, sys
import sentence_transformers, tokenizers, torch, transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
args = json.load(open(sys.argv[1]))
out = {"versions": {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}, "kinds": {}}
for kind, folder in args["folders"].items():
    model = CrossEncoder(folder, device="cpu")
    sets = []
    for query, documents in args["sets"]:
        pairs = [(query, d) for d in documents]
        features = model.preprocess(pairs)
        ids = [[int(t) for t, m in zip(row, mask) if m]
               for row, mask in zip(features["input_ids"].tolist(), features["attention_mask"].tolist())]
        scores = model.predict(pairs, convert_to_numpy=True)
        sets.append({"query": query, "documents": documents, "token_ids": ids,
                     "scores": [float(s) for s in scores]})
    out["kinds"][kind] = {"activation": type(model.activation_fn).__name__, "max_seq_length": model.max_seq_length,
                          "sets": sets}
model = SentenceTransformer(args["minilm"], device="cpu")
sets = []
for query, documents in args["sets"]:
    q, d = model.encode([query], convert_to_tensor=True), model.encode(documents, convert_to_tensor=True)
    sets.append({"query": query, "documents": documents,
                 "scores": [float(s) for s in model.similarity(q, d)[0].tolist()]})
out["minilm"] = {"modules": [type(m).__name__ for m in model], "similarity_fn_name": model.similarity_fn_name,
                 "max_seq_length": model.max_seq_length, "sets": sets}
json.dump(out, open(sys.argv[2], "w"))
"""


def reference_sets() -> list[tuple[str, list[str]]]:
    sys.path.insert(0, str(REPO / "tests"))
    from rerank_sets import RANKING_SETS

    return [(q, list(docs)) for q, docs, _ in RANKING_SETS] + LONG_SETS


def main(argv: list[str] | None = None) -> int:
    from mlxd import default_embedding
    from mlxd.devkit import tiny_encoders

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-python", default="/tmp/st/bin/python",
                    help="a Python with sentence-transformers and PyTorch")
    ap.add_argument("--minilm", type=Path, default=None,
                    help="all-MiniLM-L6-v2's folder (default: the default embedding model's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    minilm = args.minilm or default_embedding.folder()
    sets = reference_sets()
    with tempfile.TemporaryDirectory(prefix="rerank-reference-") as tmp:
        root = Path(tmp)
        folders = {kind: tiny_encoders.build(kind, root / kind, minilm) for kind in tiny_encoders.CROSS_KINDS}
        (root / "args.json").write_text(json.dumps({"sets": sets, "minilm": str(minilm),
                                                    "folders": {k: str(f) for k, f in folders.items()}}))
        subprocess.run([args.reference_python, "-c", REFERENCE_SCRIPT, str(root / "args.json"),
                        str(root / "out.json")], check=True)
        got = json.loads((root / "out.json").read_text())
        kinds = {kind: {"sha256": tiny_encoders.weights_sha256(folders[kind]), **got["kinds"][kind]}
                 for kind in tiny_encoders.CROSS_KINDS}
    kinds[MINILM_KEY] = {"sha256": tiny_encoders.weights_sha256(minilm), **got["minilm"]}
    about = {"written_by": "bench/rerank_reference.py",
             "reference": "CrossEncoder(folder, device='cpu').predict(pairs); for minilm-cosine "
                          "SentenceTransformer(folder, device='cpu').similarity(query, documents)",
             "builder": "mlxd.devkit.tiny_encoders", "seed": tiny_encoders.SEED, **got["versions"]}
    args.out.write_text(json.dumps({"about": about, "kinds": kinds}, ensure_ascii=False) + "\n", encoding="utf-8")
    for kind, entry in kinds.items():
        scores = [s for one in entry["sets"] for s in one["scores"]]
        cut = sum(len(row) >= entry["max_seq_length"] for one in entry["sets"] for row in one.get("token_ids", []))
        print(f"{kind:34} {entry.get('activation', entry.get('similarity_fn_name')):9} {entry['sha256'][:12]} "
              f"scores {min(scores):+.3f}..{max(scores):+.3f}" + (f", {cut} pairs cut" if "token_ids" in
                                                                    entry["sets"][0] else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
