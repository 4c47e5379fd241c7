"""Tiny random-weight demo models that mlx-lm loads like any real checkpoint.

Why: tests and the "no model configured" default need a model, and nothing may be
downloaded (no Hugging Face, no Mac). So mlxd *builds* one: a real mlx-lm
architecture (``llama``) with seeded random weights, a byte-level BPE tokenizer
trained locally on a small corpus, and a ChatML chat template (both in
engine/model/demo_text.py).
The folder is a plain model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, ...), loaded by ``mlx_lm.utils.load``.
It generates nonsense, quickly, which is enough to exercise every protocol,
queue, cache, crash and fallback path for real, on any machine.

Builds are deterministic (same variant -> byte-identical files), idempotent (a
stamp file marks a complete build) and atomic (built in a temporary sibling
folder, then renamed into place: mlxd.paths.build_folder_once).
``write_heavy_model_description`` writes only the config.json of a huge model,
for heavy-model exclusion tests.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxd.paths import build_folder_once

from .demo_text import CHAT_TEMPLATE, CORPUS, THINKING_CHAT_TEMPLATE, VISION_CHAT_TEMPLATE

BUILDER_VERSION = 1
STAMP = ".mlxd-demo.json"
BOS, IM_START, IM_END, PAD = "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, IM_START, IM_END, PAD]  # ids 0..3, in this order
THINK, END_THINK = "<think>", "</think>"  # ids 4, 5 in a thinking variant's tokenizer
# A vision variant's image tokens (Qwen2-VL's names, which its processor looks for).
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Files a build writes; an unstamped folder holding only these may be replaced.
_OUR_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json", "preprocessor_config.json",
              "processor_config.json", STAMP}


@dataclass(frozen=True)
class DemoSpec:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    seed: int
    max_position_embeddings: int
    dtype: str  # an mlx.core dtype name: "float32", "bfloat16", "float16"
    # The model's embedding/lm_head rows when larger than the tokenizer's vocab (0: the
    # same), so a real checkpoint's shape (e.g. Llama 3's 128256) is read per token.
    # The extra lm_head rows are zero and so never win a greedy pick (see _write_weights).
    model_vocab_size: int = 0
    # A reasoning model's tokenizer and template: <think> and </think> are special
    # tokens, and the template's `enable_thinking` switch opens the block (true) or
    # writes it empty (false), as Qwen3's does.
    thinking: bool = False
    # A vision-language model: mlx-vlm's ``qwen2_vl`` architecture (a small ViT whose
    # patches are merged into image tokens) around the text model, with Qwen2-VL's
    # image processor settings; loaded by ``mlx_vlm.load``.
    vision: bool = False


VARIANTS: dict[str, DemoSpec] = {
    # The default: ~2.9M params (11.6 MB), several hundred tokens/s on 2 CPU cores.
    "a": DemoSpec(256, 4, 512, 4, 2, 1024, 1234, 4096, "float32"),
    # A second, distinct model: other seed, ~3.5x the weight bytes.
    "b": DemoSpec(384, 6, 1024, 6, 2, 1024, 5678, 8192, "float32"),
    # Benchmark sizes, built on demand, never by the service or the tests:
    # "c": Qwen2.5-0.5B's layer shapes (24 x 896, GQA 14/2, MLP 4864) on the llama
    # architecture, ~0.36B params: a real-model workload that still decodes at
    # several tokens per second on 2 CPU cores.
    "c": DemoSpec(896, 24, 4864, 14, 2, 1024, 4242, 32768, "float32"),
    # "8b": Llama 3.1 8B's shapes exactly (32 x 4096, GQA 32/8, MLP 14336, vocab
    # 128256), bfloat16, 16 GB: for GPU runs (mlx-cuda).
    "8b": DemoSpec(4096, 32, 14336, 32, 8, 1024, 8008, 131072, "bfloat16", 128256),
    # "a" as a reasoning model (for the reasoning tests).
    "think": DemoSpec(256, 4, 512, 4, 2, 1024, 1234, 4096, "float32", thinking=True),
    # A very small reasoning model, the base that devkit/agent_model.py fine-tunes at
    # test set-up (a training step must take a fraction of a second on 2 CPU cores).
    "agent": DemoSpec(64, 2, 128, 4, 2, 1024, 77, 4096, "float32", thinking=True),
    # A very small vision-language model (qwen2_vl): the service's `demo = "vision"`,
    # and the base that devkit/vision_model.py fine-tunes at test set-up.
    "vision": DemoSpec(64, 2, 128, 4, 2, 1024, 2468, 4096, "float32", vision=True),
}

# The vision variant's tower (Qwen2-VL's layout at a tiny size) and image sizes: 14-pixel
# patches, 2x2 of them merged into one image token, so one token per 28x28 pixels,
# from 4 tokens (56x56 and smaller) to 256 (448x448 and larger, scaled down).
VISION_TOWER = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
                "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
VISION_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 448 * 448}


def _train_tokenizer(vocab_size: int, special_tokens: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens or SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # The corpus is fed line by line in a fixed order; ties in pair counts are
    # broken deterministically by the trainer, so the result is byte-identical.
    tok.train_from_iterator(CORPUS.strip().splitlines(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # the model's vocab must match exactly
        raise RuntimeError(f"demo tokenizer reached {tok.get_vocab_size()} tokens, "
                           f"wanted {vocab_size}: enlarge the corpus")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(  # prepend BOS, as Llama 3 does
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def _model_config(spec: DemoSpec, ids: dict[str, int]) -> dict:
    shape = {k: v for k, v in asdict(spec).items()
             if k not in ("seed", "dtype", "model_vocab_size", "thinking", "vision")}
    shape["vocab_size"] = spec.model_vocab_size or spec.vocab_size
    if spec.vision:
        head_dim = spec.hidden_size // spec.num_attention_heads
        third = head_dim // 2 // 3  # mRoPE: time, height, width sections of half the head
        return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", **shape,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "rope_scaling": {"type": "mrope", "mrope_section": [head_dim // 2 - 2 * third, third, third]},
                "vision_config": {**VISION_TOWER, "hidden_size": spec.hidden_size},
                "image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
                "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
                "torch_dtype": spec.dtype, "bos_token_id": ids[BOS], "eos_token_id": ids[IM_END],
                "pad_token_id": ids[PAD]}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False,  # own lm_head, so the EOS row can be zeroed
            "torch_dtype": spec.dtype, "bos_token_id": ids[BOS],
            "eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]}


# Above this many parameters weights come from mx.random (on the default device,
# a GPU under mlx-cuda): numpy would take minutes for an 8B model. Still seeded, so
# rebuilds match on the same backend; the small variants stay numpy-exact everywhere.
_NUMPY_MAX_PARAMS = 50_000_000


def _write_weights(path: Path, config: dict, spec: DemoSpec, eos_id: int) -> None:
    import numpy as np
    # Instantiating the real class gives exactly the names and shapes mlx-lm (or
    # mlx-vlm) expects (its own random init is lazy and never evaluated).
    if spec.vision:
        from mlx_vlm.models import qwen2_vl

        args = qwen2_vl.ModelConfig.from_dict(dict(config))
        args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
        args.text_config = qwen2_vl.TextConfig.from_dict(args.text_config)
        model = qwen2_vl.Model(args)
        head = "language_model.lm_head.weight"
    else:
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs.from_dict(config))
        head = "lm_head.weight"
    params = sorted(tree_flatten(model.parameters()))
    use_numpy = sum(p.size for _, p in params) <= _NUMPY_MAX_PARAMS
    dtype = getattr(mx, spec.dtype)
    weights = {}
    for name, param in params:
        # One RNG stream per tensor, seeded by (variant seed, name): independent of order.
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
            arr = mx.ones(param.shape, dtype)
        elif use_numpy:  # HF-style init: N(0, 0.02) keeps activations in a sane range
            rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
            arr = mx.array((rng.standard_normal(param.shape, np.float32) * 0.02).astype(np.float32))
        else:
            key = mx.random.key((spec.seed << 32) | zlib.crc32(name.encode()))
            arr = mx.random.normal(param.shape, dtype, scale=0.02, key=key)
        if name == head:
            # EOS logit is exactly 0 while the others spread around 0, so across
            # ~1000 tokens some logit is almost always higher: greedy decoding
            # practically never stops on EOS and tests can rely on reaching max_tokens.
            # Rows past the tokenizer's vocab (model_vocab_size) are 0 for the same
            # reason: greedy never picks a token the tokenizer cannot decode.
            arr[eos_id] = 0.0
            arr[spec.vocab_size:] = 0.0
        weights[name] = arr.astype(dtype)
        if not use_numpy:
            mx.eval(weights[name])  # one tensor at a time keeps the peak low
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _stamp(variant: str, spec: DemoSpec) -> dict:
    return {"builder_version": BUILDER_VERSION, "variant": variant, "seed": spec.seed,
            "spec": asdict(spec)}


def _is_complete(dest: Path, stamp: dict) -> bool:
    try:
        found = json.loads((dest / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return found == stamp and (dest / "model.safetensors").is_file()


def _build_into(folder: Path, variant: str, spec: DemoSpec, say: Callable[[str], None]) -> None:
    say(f"demo model {variant}: training tokenizer (vocab {spec.vocab_size})")
    extra = ([THINK, END_THINK] if spec.thinking else []) + (VISION_TOKENS if spec.vision else [])
    tok = _train_tokenizer(spec.vocab_size, SPECIAL_TOKENS + extra)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + extra}
    config = _model_config(spec, ids)
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {
        "bos_token_id": ids[BOS], "eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]})
    _write_json(folder / "special_tokens_map.json", {
        "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
        "additional_special_tokens": [IM_START, *extra]})
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": IM_END,
        "pad_token": PAD, "additional_special_tokens": [IM_START, *extra],
        "model_max_length": spec.max_position_embeddings, "clean_up_tokenization_spaces": False,
        "chat_template": (VISION_CHAT_TEMPLATE if spec.vision else
                          THINKING_CHAT_TEMPLATE if spec.thinking else CHAT_TEMPLATE)})
    if spec.vision:  # Qwen2-VL's image processor settings, read by mlx-vlm's processor
        _write_json(folder / "preprocessor_config.json", {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
            "patch_size": VISION_TOWER["patch_size"], "temporal_patch_size": VISION_TOWER["temporal_patch_size"],
            "merge_size": VISION_TOWER["spatial_merge_size"], **VISION_PIXELS,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]})
        _write_json(folder / "processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    say(f"demo model {variant}: writing weights ({spec.num_hidden_layers} layers, "
        f"hidden {spec.hidden_size}, {spec.dtype})")
    _write_weights(folder / "model.safetensors", config, spec, ids[IM_END])
    _write_json(folder / STAMP, _stamp(variant, spec))  # last: marks the build complete


def _replaceable(folder: Path) -> bool:
    """A folder a build may replace: one holding only files a build writes."""
    return {p.name for p in folder.iterdir()} <= _OUR_FILES


def build_demo_model(dest: Path, variant: str = "a", *,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Builds (once) the demo model `variant` into folder `dest`; returns dest.

    Returns at once when dest holds a complete build of this variant (stamp file).
    Otherwise builds into a temporary sibling folder and renames it into place
    (mlxd.paths.build_folder_once), so a crash never leaves a half model that looks
    complete, and concurrent builders do not corrupt each other (a loser discards
    its own copy). A stale or unstamped build at dest is replaced; a folder holding
    anything else raises FileExistsError.
    """
    dest = Path(dest)
    spec = VARIANTS[variant]  # KeyError names the unknown variant
    stamp = _stamp(variant, spec)
    say = progress or (lambda _msg: None)
    if build_folder_once(dest, lambda folder: _build_into(folder, variant, spec, say),
                         complete=lambda folder: _is_complete(folder, stamp), replaceable=_replaceable):
        say(f"demo model {variant}: ready at {dest}")
    return dest


def write_heavy_model_description(dest: Path, *, params_billion: float = 70,
                                  quant_bits: int | None = None) -> Path:
    """Writes only a config.json (no weights, no tokenizer) of a llama model of about
    `params_billion` parameters: the nearest Llama 3 shape, with the layer count fitted
    (70 -> hidden 8192, 79 layers, intermediate 28672, 64/8 heads, vocab 128256: 69.7e9),
    optionally with an mlx-community style "quantization" entry. Returns dest."""
    vocab = 128256
    shapes = {1.2: (2048, 8192, 32), 8.0: (4096, 14336, 32), 70.6: (8192, 28672, 64),
              405.0: (16384, 53248, 128)}  # Llama 3 sizes: (hidden, intermediate, heads)
    nearest = min(shapes, key=lambda b: abs(math.log(b / max(params_billion, 0.01))))
    hidden, inter, heads = shapes[nearest]
    kv_dim = 8 * (hidden // heads)  # 8 kv heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden  # embeddings, lm_head, final norm
    layers = max(1, round((params_billion * 1e9 - fixed) / per_layer))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": 8, "vocab_size": vocab,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128009,
    }
    if quant_bits is not None:
        config["quantization"] = {"group_size": 64, "bits": quant_bits}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "config.json", config)
    return dest
