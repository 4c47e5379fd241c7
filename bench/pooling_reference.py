#!/usr/bin/env python3
"""The pooling test's reference (issue 53): sentence-transformers' vectors
for each tiny encoder of mlxd.devkit.tiny_encoders (BERT with mean, CLS,
max, mean_sqrt_len_tokens and weightedmean pooling, with and without
Normalize; a Qwen3-Embedding-like decoder pooling its last token; folders
without sentence-transformers files), on fixed texts, written to
tests/engine/data/pooling_reference.json, which tests/engine/test_pooling.py
compares the encoder with.

The folders are built here (mlx's virtualenv: numpy, safetensors, tokenizers
and the default embedding model's vocabulary) into a temporary folder, then
encoded by `SentenceTransformer(folder, device="cpu").encode(texts)` in a
process of --reference-python (a virtualenv with sentence-transformers and
PyTorch, not mlxd's dependencies). The builder is seeded, so the test
rebuilds the same weights: the json keeps each folder's model.safetensors
sha256 (and each text's token ids), which the test checks first, so a
builder change that alters the weights fails there, loudly.

  python3 -m venv /tmp/st && /tmp/st/bin/pip install torch==2.13.0 sentence-transformers
  .venv/bin/python bench/pooling_reference.py --reference-python /tmp/st/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "engine" / "data" / "pooling_reference.json"
# Plain, longer, Unicode, code, very short, long (several forwards, padding), spaces around: lengths that differ.
TEXTS = ["The capital of France is Paris.",
         ("An agent stores what it learned in a vector database, then finds it again by meaning when a later "
          "task needs it."),
         "Déjà vu: naïve café owners serve crème brûlée — 東京, Москва, emoji 🚀.",
         "def add(a, b):\n    return a + b  # a Python function",
         "hi",
         "x",
         " ".join(f"word{i}" for i in range(60)),
         "  spaces around, and MIXED case 12345!?  "]

REFERENCE_SCRIPT = r"""
import json, sys
import sentence_transformers, tokenizers, torch, transformers
from sentence_transformers import SentenceTransformer
args = json.load(open(sys.argv[1]))
out = {"versions": {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}, "kinds": {}}
for kind, folder in args["folders"].items():
    model = SentenceTransformer(folder, device="cpu")
    ids = [model.tokenizer(t)["input_ids"] for t in args["texts"]]
    vectors = model.encode(args["texts"], convert_to_numpy=True)
    modules = [type(m).__name__ + (f"({m.pooling_mode})" if hasattr(m, "pooling_mode") else "") for m in model]
    out["kinds"][kind] = {"modules": modules, "token_ids": ids,
                          "vectors": vectors.astype("float32").tolist()}
json.dump(out, open(sys.argv[2], "w"))
"""


def main(argv: list[str] | None = None) -> int:
    from mlxd.devkit import tiny_encoders

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-python", default="/tmp/st/bin/python",
                    help="a Python with sentence-transformers and PyTorch")
    ap.add_argument("--minilm", type=Path, default=None,
                    help="all-MiniLM-L6-v2's folder, for BERT's vocabulary (default: the default embedding model's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pooling-reference-") as tmp:
        root = Path(tmp)
        folders = {kind: tiny_encoders.build(kind, root / kind, args.minilm) for kind in tiny_encoders.KINDS}
        (root / "args.json").write_text(json.dumps({"texts": TEXTS, "folders": {k: str(f) for k, f in
                                                                                  folders.items()}}))
        subprocess.run([args.reference_python, "-c", REFERENCE_SCRIPT, str(root / "args.json"),
                        str(root / "out.json")], check=True)
        got = json.loads((root / "out.json").read_text())
        kinds = {kind: {"weights_sha256": tiny_encoders.weights_sha256(folders[kind]), "texts": TEXTS,
                        **got["kinds"][kind]} for kind in tiny_encoders.KINDS}
    about = {"written_by": "bench/pooling_reference.py", "reference": "SentenceTransformer(folder, device='cpu')"
             ".encode(texts)", "builder": "mlxd.devkit.tiny_encoders", "seed": tiny_encoders.SEED, **got["versions"]}
    args.out.write_text(json.dumps({"about": about, "kinds": kinds}, ensure_ascii=False) + "\n", encoding="utf-8")
    for kind, entry in kinds.items():
        print(f"{kind:28} {' > '.join(entry['modules']):56} {entry['weights_sha256'][:12]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
