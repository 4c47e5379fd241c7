"""Rerankers: `/v1/rerank`'s models and their forwards, three kinds
(core/config_sections.py's `RerankerSpec`):

- a cross-encoder (`CrossEncoder`): a `...ForSequenceClassification`
  checkpoint with one label (BERT, XLM-R, ModernBERT: ms-marco-MiniLM,
  bge-reranker), loaded by mlx-vlm's reranker loader, the query and each
  document read together; its score is the logit through the activation
  sentence-transformers' `CrossEncoder` applies (the folder's own, else a
  sigmoid), so the numbers are the ones its users know;
- an embedding model's vectors (`CosineRun`): the query and the documents
  embedded by the resident encoder (engine/model/encoder.py), ranked by
  cosine, with no second model in memory;
- a chat model's yes/no (`ChatRerankRun`): Qwen3-Reranker's prompt, the
  model's logits of "yes" and "no" at the answer's first token.

Runs are stepped as an embedding request's (engine/core/embedding_turn.py):
a group of forwards between two decode steps of the chat requests. The
decisions (order, limits, activation) are engine/model/rerank_decisions.py's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .encoder import FORWARD_BOUNDS, EmbeddingRun, forwards_on_streams, padded, plan_batches
from .errors import EngineError
from .rerank_decisions import (CHAT_SUFFIX, IDENTITY, RerankWork, activation, chat_messages, cosine_scores, pair_limit,
                               yes_probability)

def cut_documents(tokenizer: Any, documents: list[str], limit: int | None) -> list[str]:
    """Each document cut to its first `limit` tokens (Cohere's
    max_tokens_per_doc); None: as they are."""
    if limit is None:
        return documents
    out = []
    for doc in documents:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        out.append(doc if len(ids) <= limit else tokenizer.decode(ids[:limit]))
    return out


class CrossEncoder:
    """One cross-encoder in memory: weights, tokenizer, limits."""

    def __init__(self, model_id: str, folder: Path) -> None:
        from mlx_vlm.reranker_loader import load_sequence_classification_model
        from transformers import AutoTokenizer

        started = time.monotonic()
        self.model_id = model_id
        config = json.loads((folder / "config.json").read_text())
        self.model = load_sequence_classification_model(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.max_tokens = pair_limit(config, getattr(self.tokenizer, "model_max_length", None))
        self.heads = int(config.get("num_attention_heads") or 1)
        st_path = folder / "config_sentence_transformers.json"  # where sentence-transformers 6 names it
        self.activation = activation(config, json.loads(st_path.read_text()) if st_path.is_file() else None)
        self.pad_id = self.tokenizer.pad_token_id or 0
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        self.bounds = FORWARD_BOUNDS["cpu" if on_cpu else "gpu"]
        self.streams = 1
        if on_cpu:
            from ..cpu.cpu_encoder import prepare_encoder
            from ..cpu.cpu_linear import prompt_streams, usable_cores

            prepare_encoder(self.model)  # BERT's layers: the CPU's slow exp/erf replaced (engine/cpu/)
            self.streams = prompt_streams(usable_cores())  # forwards in pairs, one per core, as the encoder's
        self.load_s = time.monotonic() - started

    def start(self, work: RerankWork) -> "CrossEncoderRun":
        if work.instruction is not None:
            raise EngineError(400, "instruction: a cross-encoder reranker takes no instruction (a chat-model "
                                   "reranker does)", code="invalid_request", param="instruction")
        documents = cut_documents(self.tokenizer, work.documents, work.max_tokens_per_doc)
        encoded = self.tokenizer([work.query] * len(documents), documents, truncation=True,
                                 max_length=self.max_tokens)
        ids = encoded["input_ids"]
        types = encoded.get("token_type_ids") or [[0] * len(row) for row in ids]
        return CrossEncoderRun(self, ids, types)

    def forward(self, ids: list[list[int]], types: list[list[int]]) -> Any:
        """One forward's scores (lazy), rows padded to the bucket of the longest."""
        width = padded(max(len(r) for r in ids))
        tokens = np.full((len(ids), width), self.pad_id, dtype=np.int32)
        segments = np.zeros((len(ids), width), dtype=np.int32)
        mask = np.zeros((len(ids), width), dtype=np.int32)
        for k, (row, seg) in enumerate(zip(ids, types)):
            tokens[k, :len(row)], segments[k, :len(row)], mask[k, :len(row)] = row, seg, 1
        logits = self.model(mx.array(tokens), attention_mask=mx.array(mask),
                            token_type_ids=mx.array(segments)).logits[:, 0]
        return logits if self.activation == IDENTITY else mx.sigmoid(logits)


class CrossEncoderRun:
    """A rerank request's forwards over a cross-encoder, by length."""

    def __init__(self, encoder: CrossEncoder, ids: list[list[int]], types: list[list[int]]) -> None:
        self.encoder, self.ids, self.types = encoder, ids, types
        self.tokens = sum(len(r) for r in ids)
        self.batches = plan_batches([len(r) for r in ids], encoder.heads, *encoder.bounds)
        self._scores: list[float] = [0.0] * len(ids)
        self._next = 0

    def step(self) -> bool:
        """The next group of forwards (one per stream), evaluated together; whether the request is done."""
        enc = self.encoder
        group = self.batches[self._next:self._next + enc.streams]
        self._next += len(group)
        scores = forwards_on_streams(enc.streams, [
            lambda batch=batch: enc.forward([self.ids[i] for i in batch], [self.types[i] for i in batch])
            for batch in group])
        for batch, got in zip(group, scores):
            for i, score in zip(batch, np.array(got.astype(mx.float32))):
                self._scores[i] = float(score)
        return self._next >= len(self.batches)

    def scores(self) -> list[float]:
        return self._scores


class CosineRun:
    """A rerank request over an embedding model: the query and the documents
    embedded (one EmbeddingRun), scored by cosine."""

    def __init__(self, run: EmbeddingRun) -> None:
        self.run = run
        self.tokens = run.tokens

    def step(self) -> bool:
        return self.run.step()

    def scores(self) -> list[float]:
        return cosine_scores(self.run.vectors())


def chat_prompt_tokens(tokenizer: Any, instruction: str, query: str, document: str) -> list[int]:
    """One document's prompt: the model's own chat template, its thinking
    off, the answer about to start; ChatML (Qwen's) where it has none."""
    messages = chat_messages(instruction, query, document)
    if getattr(tokenizer, "chat_template", None):
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      enable_thinking=False))
        except Exception:  # noqa: BLE001 - a template that wants other roles: ChatML below
            pass
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return tokenizer.encode(text + CHAT_SUFFIX.removeprefix("<|im_end|>\n"), add_special_tokens=False)


def yes_no_ids(tokenizer: Any) -> tuple[int, int]:
    """The token ids that start "yes" and "no" (one token each in Qwen's
    and most vocabularies), else a 400 where they cannot be told apart."""
    yes, no = (tokenizer.encode(word, add_special_tokens=False)[:1] for word in ("yes", "no"))
    if not yes or not no or yes == no:
        raise EngineError(400, "this chat model's tokenizer does not tell \"yes\" from \"no\" at their first "
                               "token: it cannot rank by them", code="invalid_request", param="model")
    return int(yes[0]), int(no[0])


class ChatRerankRun:
    """A rerank request over the resident chat model: one forward a
    document, no KV kept (a prompt of its own, read once)."""

    def __init__(self, model: Any, tokenizer: Any, work: RerankWork, instruction: str, max_tokens: int) -> None:
        self.model = model
        self.yes, self.no = yes_no_ids(tokenizer)
        documents = cut_documents(tokenizer, work.documents, work.max_tokens_per_doc)
        self.prompts = [chat_prompt_tokens(tokenizer, instruction, work.query, d) for d in documents]
        for i, p in enumerate(self.prompts):
            if len(p) > max_tokens:
                raise EngineError(400, f"documents[{i}] makes a {len(p)}-token prompt, over this engine's "
                                       f"{max_tokens}; send max_tokens_per_doc", code="context_length_exceeded",
                                  param="documents")
        self.tokens = sum(len(p) for p in self.prompts)
        self._scores: list[float] = []

    def step(self) -> bool:
        logits = self.model(mx.array(self.prompts[len(self._scores)])[None])[0, -1]
        pair = np.array(logits[mx.array([self.yes, self.no])].astype(mx.float32))
        self._scores.append(yes_probability(float(pair[0]), float(pair[1])))
        return len(self._scores) >= len(self.prompts)

    def scores(self) -> list[float]:
        return self._scores
