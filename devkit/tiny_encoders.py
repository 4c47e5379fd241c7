"""Tiny random-weight sentence-transformers folders, one per pooling: the
encoder's pooling and normalisation checked against sentence-transformers on
the same weights (tests/engine/test_pooling.py; the reference vectors are
bench/pooling_reference.py's).

Each folder is complete as sentence-transformers saves one: config.json,
model.safetensors (float32, seeded numpy, so two builds hold the same bytes),
the tokenizer, modules.json, 1_Pooling/config.json, sentence_bert_config.json
(and 2_Normalize/ where listed) -- or none of the sentence-transformers files,
for the defaults of a plain folder. BERT's tokenizer is all-MiniLM-L6-v2's
(the default embedding model's folder) cut to its first 3,000 pieces and its
one-character continuations; Qwen3's is a byte-level BPE of a few hundred
merges trained here on a fixed text, appending <|endoftext|> to every input
and padding on the left as Qwen3-Embedding's does. Numpy, safetensors and
tokenizers only: the reference's virtualenv (PyTorch, sentence-transformers)
builds them too.

CROSS_KINDS are cross-encoders (one-label ...ForSequenceClassification
folders, as sentence-transformers' CrossEncoder loads them) for
tests/engine/test_cross_encoder.py against bench/rerank_reference.py's
scores: BERT (the same encoder weights as the BERT kinds, a pooler and a
classifier added, the tokenizer cut at 128) with no activation named
(Sigmoid), with Identity in config.json (sentence-transformers 4 and 5, as
ms-marco-MiniLM's) and in config_sentence_transformers.json (6); and XLM-R
(bge-reranker's architecture) on a unigram vocabulary made from BERT's
pieces.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 53


@dataclass(frozen=True)
class Kind:
    arch: str  # "bert" or "qwen3"
    pooling: str | None  # 1_Pooling's mode; None: no sentence-transformers files at all
    normalize: bool  # a Normalize module in modules.json


KINDS = {
    "bert-mean-normalize": Kind("bert", "mean", True),  # all-MiniLM-L6-v2's
    "bert-cls": Kind("bert", "cls", False),  # BGE's pooling, here without Normalize
    "bert-max": Kind("bert", "max", False),
    "bert-mean-sqrt-len": Kind("bert", "mean_sqrt_len_tokens", False),
    "bert-weightedmean": Kind("bert", "weightedmean", True),
    "bert-plain": Kind("bert", None, False),  # a plain transformers folder
    "qwen3-lasttoken-normalize": Kind("qwen3", "lasttoken", True),  # Qwen3-Embedding's
    "qwen3-plain": Kind("qwen3", None, False),
}


@dataclass(frozen=True)
class CrossKind:
    arch: str  # "bert" (BertForSequenceClassification) or "xlmr" (XLMRobertaForSequenceClassification)
    activation_fn: str | None  # the activation the folder names; None: none (sentence-transformers' Sigmoid)
    written_in: str | None = None  # where: "config.json" (sentence-transformers 4 and 5) or
    # "config_sentence_transformers.json" (6, with modules.json, as its CrossEncoder.save_pretrained writes)


IDENTITY_FN = "torch.nn.modules.linear.Identity"
CROSS_KINDS = {  # one label each; sentence-transformers' CrossEncoder loads them (its tokenizer truncates at 128)
    "bert-cross-encoder": CrossKind("bert", None),  # a plain transformers folder, as bge-reranker's: Sigmoid
    "bert-cross-encoder-identity": CrossKind("bert", IDENTITY_FN, "config.json"),  # ms-marco-MiniLM's: raw logits
    "bert-cross-encoder-identity-st6": CrossKind("bert", IDENTITY_FN, "config_sentence_transformers.json"),
    "xlmr-cross-encoder": CrossKind("xlmr", None),  # bge-reranker's architecture: Sigmoid
}
CROSS_MAX_LENGTH = 128  # the cross-encoders' tokenizer limit: long pairs are cut (longest_first)
# The head: the scales of the pooler's (XLM-R: the head's dense) and the classifier's weights, and a bias that
# centres these seeded weights' logits near 0, so that they span several units (about -6 to 7 on the test's pairs)
# and sigmoid scores spread over (0, 1).
CROSS_HEAD = {"bert": {"pooler": 0.5, "classifier": 1.0, "bias": 2.9},
              "xlmr": {"pooler": 0.5, "classifier": 1.5, "bias": 8.1}}
# XLM-R's: a SentencePiece-like unigram vocabulary made here from BERT's pieces (cased letters added), positions
# offset by the padding id (so the tokenizer's 128 needs 130).
XLMR = {"positions": CROSS_MAX_LENGTH + 2, "specials": ("<s>", "<pad>", "</s>", "<unk>"), "mask": "<mask>"}

BERT = {"hidden": 32, "layers": 2, "heads": 4, "intermediate": 64, "positions": 512, "kept": 3000}
QWEN3 = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "positions": 512,
         "merges": 400}
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = ("An agent stores what it learned in a vector database, and finds it again by meaning. "
          "The capital of France is Paris; the river is the Seine. def add(a, b): return a + b  # sum\n"
          "Embeddings map sentences to vectors: similar sentences, nearby vectors. 0123456789 "
          "Déjà vu, naïve café, crème brûlée, 東京, Москва, emoji 🚀. ") * 4


def build(kind: str, dest: Path, minilm: Path | None = None) -> Path:
    """The folder of `kind` (KINDS or CROSS_KINDS) at dest, replaced if
    there; BERT's tokenizer from `minilm` (default: the default embedding
    model's folder)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if kind in CROSS_KINDS:
        cross = CROSS_KINDS[kind]
        _bert(dest, minilm, cross) if cross.arch == "bert" else _xlmr(dest, cross, minilm)
        if cross.written_in == "config_sentence_transformers.json":
            _cross_st_files(dest, cross)
        return dest
    spec = KINDS[kind]
    hidden = _bert(dest, minilm) if spec.arch == "bert" else _qwen3(dest)
    if spec.pooling is not None:
        _st_files(dest, spec, hidden)
    return dest


def weights_sha256(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(dest: Path, tensors: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})


class _Weights:
    """Seeded float32 tensors, drawn in the order asked (one generator a folder)."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(SEED)
        self.tensors: dict[str, Any] = {}

    def normal(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self.tensors[name] = (self.rng.standard_normal(shape) * scale).astype(self.np.float32)

    def around_one(self, name: str, size: int) -> None:  # a norm's weight: not all ones, so it matters
        self.tensors[name] = (1.0 + self.rng.standard_normal(size) * 0.1).astype(self.np.float32)


def _st_files(dest: Path, spec: Kind, hidden: int) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if spec.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (dest / "2_Normalize").mkdir()
    _write_json(dest / "modules.json", modules)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    named = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "weightedmean": "weightedmean_tokens"}
    chosen = named.get(spec.pooling or "", spec.pooling)
    _write_json(dest / "1_Pooling" / "config.json",
                {"word_embedding_dimension": hidden, **{f"pooling_mode_{m}": m == chosen for m in modes},
                 "include_prompt": True})
    _write_json(dest / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    _write_json(dest / "config_sentence_transformers.json",
                {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine",
                 "model_type": "SentenceTransformer"})


def _cross_config(architecture: str, cross: CrossKind) -> dict[str, Any]:
    """A one-label classifier's config.json keys, as transformers saves them
    (and the activation where sentence-transformers 4 and 5 wrote it)."""
    out: dict[str, Any] = {"architectures": [architecture], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
                           "classifier_dropout": None}
    if cross.written_in == "config.json":
        out["sentence_transformers"] = {"activation_fn": cross.activation_fn, "version": "5.1.1"}
    return out


def _cross_st_files(dest: Path, cross: CrossKind) -> None:
    """What sentence-transformers 6's CrossEncoder.save_pretrained adds: one
    Transformer module (a sequence classifier's logits) and the activation in
    config_sentence_transformers.json."""
    _write_json(dest / "modules.json", [{"idx": 0, "name": "0", "path": "",
                                         "type": "sentence_transformers.base.modules.transformer.Transformer"}])
    _write_json(dest / "sentence_bert_config.json",
                {"transformer_task": "sequence-classification",
                 "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                 "module_output_name": "scores"})
    _write_json(dest / "config_sentence_transformers.json",
                {"__version__": {"sentence_transformers": "6.3.0"}, "activation_fn": cross.activation_fn,
                 "default_prompt_name": None, "model_type": "CrossEncoder", "prompts": {}})


def _bert(dest: Path, minilm: Path | None, cross: CrossKind | None = None) -> int:
    if minilm is None:
        from mlxd import default_embedding

        minilm = default_embedding.folder()
    lines = (minilm / "vocab.txt").read_text(encoding="utf-8").split("\n")
    lines = [t for t in lines if t]
    kept = lines[:BERT["kept"]]
    kept += [t for t in lines[BERT["kept"]:] if t.startswith("##") and len(t) == 3]  # every "##x": no [UNK] in words
    vocab = {t: i for i, t in enumerate(kept)}
    (dest / "vocab.txt").write_text("\n".join(kept) + "\n", encoding="utf-8")
    tokenizer = json.loads((minilm / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["model"]["vocab"] = vocab
    tokenizer["truncation"] = tokenizer["padding"] = None
    _write_json(dest / "tokenizer.json", tokenizer)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, dest / name)
    h, n = BERT["hidden"], len(vocab)
    config = {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": n, "hidden_size": h,
        "num_hidden_layers": BERT["layers"], "num_attention_heads": BERT["heads"],
        "intermediate_size": BERT["intermediate"], "hidden_act": "gelu", "max_position_embeddings": BERT["positions"],
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0, "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
        "torch_dtype": "float32"}
    if cross is not None:
        tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
        _write_json(dest / "tokenizer_config.json", {**tokenizer_config, "model_max_length": CROSS_MAX_LENGTH})
        config = {**config, **_cross_config("BertForSequenceClassification", cross)}
    _write_json(dest / "config.json", config)
    prefix = "" if cross is None else "bert."  # a ...ForSequenceClassification's names, as transformers saves them
    w = _Weights()
    w.normal(prefix + "embeddings.word_embeddings.weight", n, h, scale=0.5)
    w.normal(prefix + "embeddings.position_embeddings.weight", BERT["positions"], h, scale=0.5)
    w.normal(prefix + "embeddings.token_type_embeddings.weight", 2, h, scale=0.5)
    w.around_one(prefix + "embeddings.LayerNorm.weight", h)
    w.normal(prefix + "embeddings.LayerNorm.bias", h)
    _encoder_layers(w, prefix, h)
    if cross is None:
        w.normal("pooler.dense.weight", h, h)
        w.normal("pooler.dense.bias", h)
    else:  # the pooler (tanh of [CLS]) and the one-label classifier, scaled so that the logits span several units
        head = CROSS_HEAD["bert"]
        w.normal(prefix + "pooler.dense.weight", h, h, scale=head["pooler"])
        w.normal(prefix + "pooler.dense.bias", h)
        w.normal("classifier.weight", 1, h, scale=head["classifier"])
        w.normal("classifier.bias", 1)
        w.tensors["classifier.bias"] += w.np.float32(head["bias"])
    _save(dest, w.tensors)
    return h


def _encoder_layers(w: _Weights, prefix: str, h: int) -> None:
    """BERT's (and XLM-R's) layers, drawn in BERT's order."""
    for i in range(BERT["layers"]):
        p = f"{prefix}encoder.layer.{i}."
        for name, rows, cols in (("attention.self.query", h, h), ("attention.self.key", h, h),
                                 ("attention.self.value", h, h), ("attention.output.dense", h, h),
                                 ("intermediate.dense", BERT["intermediate"], h),
                                 ("output.dense", h, BERT["intermediate"])):
            w.normal(p + name + ".weight", rows, cols, scale=0.3)
            w.normal(p + name + ".bias", rows)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w.around_one(p + norm + ".weight", h)
            w.normal(p + norm + ".bias", h)


def _bert_pieces(minilm: Path | None) -> list[str]:
    if minilm is None:
        from mlxd import default_embedding

        minilm = default_embedding.folder()
    return [t for t in (minilm / "vocab.txt").read_text(encoding="utf-8").split("\n") if t]


def xlmr_tokenizer(minilm: Path | None = None) -> Any:
    """XLM-R's tokenizer as transformers builds XLMRobertaTokenizer (a
    unigram model, whitespace then "▁" pre-tokenised, <s> A </s></s> B </s>),
    its pieces BERT's first ones: a word "▁w" (and "w" inside a word) scored
    by rank, every single character below them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [t for t in _bert_pieces(minilm)[:BERT["kept"]] if not (t.startswith("[") and t.endswith("]"))]
    vocab: list[tuple[str, float]] = [(t, 0.0) for t in XLMR["specials"]]
    seen = {t for t, _ in vocab}

    def add(piece: str, score: float) -> None:
        if piece and piece not in seen:
            seen.add(piece)
            vocab.append((piece, score))

    for i, t in enumerate(pieces):
        word = t.removeprefix("##")
        if len(word) == 1:
            add(word, -12.0)
            add("\u2581" + word, -12.5)
        elif t.startswith("##"):
            add(word, -6.0 - i / 1000)
        else:
            add("\u2581" + word, -4.0 - i / 1000)
            add(word, -7.0 - i / 1000)
    for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ\u2581":
        add(c, -12.0)
        add("\u2581" + c, -12.5)
    vocab.append((XLMR["mask"], 0.0))
    tok = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="\u2581",
                                                                          prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*XLMR["specials"],
                                                                                     XLMR["mask"])])
    return tok


def _xlmr(dest: Path, cross: CrossKind, minilm: Path | None = None) -> int:
    tok = xlmr_tokenizer(minilm)
    tok.save(str(dest / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    _write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "XLMRobertaTokenizer", "model_max_length": CROSS_MAX_LENGTH, "bos_token": "<s>",
        "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "mask_token": "<mask>", "add_prefix_space": True, "clean_up_tokenization_spaces": True})
    h = BERT["hidden"]
    _write_json(dest / "config.json", {
        "model_type": "xlm-roberta", "vocab_size": n, "hidden_size": h, "num_hidden_layers": BERT["layers"],
        "num_attention_heads": BERT["heads"], "intermediate_size": BERT["intermediate"], "hidden_act": "gelu",
        "max_position_embeddings": XLMR["positions"], "type_vocab_size": 1, "layer_norm_eps": 1e-5,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
        "torch_dtype": "float32", **_cross_config("XLMRobertaForSequenceClassification", cross)})
    w = _Weights()
    p = "roberta."
    w.normal(p + "embeddings.word_embeddings.weight", n, h, scale=0.5)
    w.normal(p + "embeddings.position_embeddings.weight", XLMR["positions"], h, scale=0.5)
    w.normal(p + "embeddings.token_type_embeddings.weight", 1, h, scale=0.5)
    w.around_one(p + "embeddings.LayerNorm.weight", h)
    w.normal(p + "embeddings.LayerNorm.bias", h)
    _encoder_layers(w, p, h)
    head = CROSS_HEAD["xlmr"]  # RobertaClassificationHead: dense, tanh, out_proj, on <s>
    w.normal("classifier.dense.weight", h, h, scale=head["pooler"])
    w.normal("classifier.dense.bias", h)
    w.normal("classifier.out_proj.weight", 1, h, scale=head["classifier"])
    w.normal("classifier.out_proj.bias", 1)
    w.tensors["classifier.out_proj.bias"] += w.np.float32(head["bias"])
    _save(dest, w.tensors)
    return h


def qwen3_tokenizer() -> Any:
    """The byte-level BPE: trained on CORPUS, <|endoftext|> appended to every input."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                            trainers)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + QWEN3["merges"], initial_alphabet=alphabet,
                                  special_tokens=[], show_progress=False, min_frequency=1)
    tok.train_from_iterator([CORPUS], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    eos = tok.token_to_id(QWEN_SPECIAL[0])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        processors.TemplateProcessing(single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
                                      special_tokens=[(QWEN_SPECIAL[0], eos)])])
    return tok


def _qwen3(dest: Path) -> int:
    tok = qwen3_tokenizer()
    tok.save(str(dest / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    first = n - len(QWEN_SPECIAL)
    _write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 512, "padding_side": "left",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
        "added_tokens_decoder": {str(first + i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                                  "rstrip": False, "single_word": False}
                                 for i, t in enumerate(QWEN_SPECIAL)}})
    c = QWEN3
    h = c["hidden"]
    _write_json(dest / "config.json", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": n, "hidden_size": h,
        "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": c["positions"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c["layers"],
        "bos_token_id": first, "eos_token_id": first, "torch_dtype": "float32", "use_cache": True})
    w = _Weights()
    w.normal("embed_tokens.weight", n, h, scale=0.5)
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    for i in range(c["layers"]):
        p = f"layers.{i}."
        for name, rows, cols in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                                 ("self_attn.o_proj", h, q), ("mlp.gate_proj", c["intermediate"], h),
                                 ("mlp.up_proj", c["intermediate"], h), ("mlp.down_proj", h, c["intermediate"])):
            w.normal(p + name + ".weight", rows, cols, scale=0.3)
        w.around_one(p + "self_attn.q_norm.weight", c["head_dim"])
        w.around_one(p + "self_attn.k_norm.weight", c["head_dim"])
        w.around_one(p + "input_layernorm.weight", h)
        w.around_one(p + "post_attention_layernorm.weight", h)
    w.around_one("norm.weight", h)
    _save(dest, w.tensors)
    return h
