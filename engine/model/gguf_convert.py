"""A GGUF file -> an MLX model folder that mlx-lm loads, once, into a cache.

MLX reads GGUF itself (`mx.load(path, return_metadata=True)`): F32/F16/BF16
tensors as they are, Q4_0/Q4_1/Q8_0 as MLX affine-quantized weights of group
size 32 (uint32 weights, float16 scales and biases) -- the exact layout of
an MLX-quantized model, so nothing is dequantized or re-quantized. What is
left is naming (llama.cpp's tensor names -> mlx-lm's, mlxd.gguf), the config
(from the header's metadata, mlxd.gguf.mlx_config plus the quantization the
arrays show), and the tokenizer (a `tokenizers` BPE built from the header's
vocabulary and merges, with the chat template from the metadata).

The cache folder is named by the file's stem and mlxd.gguf.cache_key (size,
mtime, hash of its start). It is built in a hidden temp folder and renamed
into place whole (mlxd.paths.build_folder_once), so a conversion killed at
any moment leaves no folder that looks complete; the next conversion removes
the leftovers of dead ones.
Runs on the engine's worker thread (it makes MLX arrays).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mlxd import gguf
from mlxd.paths import build_folder_once, remove_dead_temps

from .errors import EngineError

log = logging.getLogger("mlxd.engine.gguf")
GROUP_SIZE = 32  # every GGUF type MLX loads quantized has blocks of 32

# The pre-tokenizer split rule per tokenizer.ggml.pre (llama.cpp's names).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_RULES = {"qwen2": _QWEN2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3}
SPECIAL_TOKEN_TYPES = (3, 4)  # control, user-defined


def cached_model_dir(gguf_path: Path, cache_root: Path) -> Path:
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", gguf_path.stem)[:80]
    return cache_root / f"{stem}-{gguf.cache_key(gguf_path)}"


def quantization_config(arrays: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry for these (already renamed) arrays: the
    most common bit width, and every module that differs (pure)."""
    bits = {}
    for name, arr in arrays.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            bits[module] = arrays[module + ".weight"].shape[-1] // arr.shape[-1]
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    config.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in sorted(bits.items()) if b != common})
    return config


def tokenizer_files(header: gguf.GGUFHeader) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json from the header (byte-level BPE)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = header.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    rule = SPLIT_RULES.get(str(meta.get("tokenizer.ggml.pre", "")))
    if rule is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(rule), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif meta.get("tokenizer.ggml.pre") == "smollm":  # digits one by one, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(token_types) if t in SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and token("bos") is not None
    if add_bos:
        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokens.index(bos))])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "add_bos_token": add_bos,
        "model_max_length": int(header.meta("context_length", 4096)),
    }
    if meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(tokenizer_config, indent=1)}


# What a conversion writes: a folder holding only these may be replaced.
_OUR_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}


def convert_gguf(gguf_path: Path, cache_root: Path, say: Callable[[str], None] = log.info) -> Path:
    """The MLX model folder for `gguf_path`, converting it on first use.
    Raises EngineError 400 `model_unsupported` for what MLX cannot serve."""
    try:
        header = gguf.read_header(gguf_path)
    except gguf.GGUFError as exc:
        raise EngineError(400, str(exc), code="model_unsupported", param="model") from None
    problem = gguf.unsupported(header)
    if problem is not None:
        raise EngineError(400, f"{gguf_path.name}: {problem}", code="model_unsupported", param="model")
    target = cached_model_dir(gguf_path, cache_root)
    if not _converted(target):
        remove_dead_temps(cache_root)  # any file's: a conversion killed mid-way, of this file or another
    started = time.monotonic()
    if build_folder_once(target, lambda folder: _convert_into(folder, gguf_path, header, say), complete=_converted,
                         replaceable=lambda folder: {p.name for p in folder.iterdir()} <= _OUR_FILES):
        say(f"converted {gguf_path.name} in {time.monotonic() - started:.1f}s into {target}")
    return target


def _converted(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _convert_into(folder: Path, gguf_path: Path, header: gguf.GGUFHeader, say: Callable[[str], None]) -> None:
    """The conversion itself, into the empty `folder`."""
    size_mib = gguf_path.stat().st_size / 2**20
    say(f"converting {gguf_path.name} ({size_mib:.0f} MiB, {header.architecture}) to MLX: reading tensors")
    try:
        loaded = mx.load(str(gguf_path), format="gguf")  # Ollama's blobs have no extension
    except (RuntimeError, ValueError, OSError) as exc:  # a damaged data section, a tensor MLX cannot read
        raise EngineError(400, f"{gguf_path.name}: MLX cannot read its tensors: {exc}", code="model_unsupported",
                          param="model") from None
    arrays = {}
    for name, arr in loaded.items():
        mapped = gguf.mlx_tensor_name(name)
        if mapped is None:
            log.warning("%s: tensor %s has no place in mlx-lm's %s; skipped", gguf_path.name, name,
                        header.architecture)
            continue
        arrays[mapped] = arr
    config = gguf.mlx_config(header)
    quantization = quantization_config(arrays)
    if quantization is not None:
        config["quantization"] = quantization
    say(f"converting {gguf_path.name}: writing {len(arrays)} tensors")
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    say(f"converting {gguf_path.name}: building the tokenizer")
    for name, text in tokenizer_files(header).items():
        (folder / name).write_text(text)
