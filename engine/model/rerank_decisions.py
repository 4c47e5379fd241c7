"""The rerankers' decisions (pure, no MLX): what a request asks of a model,
the order of the results, a cross-encoder's limit and activation, the
cosine of embedded texts, and a chat model's prompt and yes/no score.
engine/model/reranker.py runs the models."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class RerankWork:
    """What a rerank request asks of a model (the engine's decision of it)."""

    query: str
    documents: list[str]
    max_tokens_per_doc: int | None = None
    instruction: str | None = None


def ranked(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Document indices, best first; ties keep the documents' order (pure)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order if top_n is None else order[:top_n]


IDENTITY = "Identity"  # sentence-transformers' activation_fn that leaves the logit as it is


def activation(config: dict, st_config: dict | None = None) -> str:
    """The activation sentence-transformers' CrossEncoder (6.3) puts on the
    logit (pure), from config.json (`config`) and
    config_sentence_transformers.json (`st_config`, None where the folder
    has none): the first of st_config's `activation_fn` (where version 6's
    save_pretrained writes it), config.json's
    `sentence_transformers.activation_fn` (versions 4 and 5, as
    ms-marco-MiniLM's) and its `sbert_ce_default_activation_function`
    (before 4); a path outside `torch.` counts as none (it is only loaded
    with trust_remote_code); none: a sigmoid, its default for one label."""
    named = (st_config or {}).get("activation_fn")
    if not str(named or "").startswith("torch."):
        saved = config.get("sentence_transformers") or {}
        named = saved["activation_fn"] if "activation_fn" in saved else config.get(
            "sbert_ce_default_activation_function")
    named = str(named or "")
    return IDENTITY if named.startswith("torch.") and named.endswith(IDENTITY) else "Sigmoid"


def pair_limit(config: dict, model_max_length: int | None) -> int:
    """The longest query-and-document pair, special tokens included (pure):
    the tokenizer's limit where it has a sane one, else the model's positions
    (XLM-R's keep two for padding)."""
    positions = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("xlm-roberta", "xlm_roberta", "roberta"):
        positions -= 2
    if model_max_length is not None and 0 < model_max_length < 1_000_000:
        return min(int(model_max_length), positions)
    return positions


def cosine_scores(vectors: Any) -> list[float]:
    """The first row's cosine to each of the others (pure)."""
    import numpy as np

    v = np.asarray(vectors, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(v, axis=1), 1e-12)
    return [float(x) for x in (v[1:] @ v[0]) / (norms[1:] * norms[0])]


# Qwen3-Reranker's prompt (its model card): a system line, the task, the query and the document, an empty
# thought; the score is p("yes") against p("no") at the answer's first token.
CHAT_SYSTEM = ("Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
               'Note that the answer can only be "yes" or "no".')
CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def chat_messages(instruction: str, query: str, document: str) -> list[dict]:
    """The conversation a chat model reads for one document (pure)."""
    return [{"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"}]


def yes_probability(logit_yes: float, logit_no: float) -> float:
    """p(yes) of the two answers alone (pure): a sigmoid of the difference."""
    return 1.0 / (1.0 + math.exp(logit_no - logit_yes))
