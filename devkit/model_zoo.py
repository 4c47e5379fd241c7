"""A zoo of tiny random-weight models, one per mlx-lm architecture mlxd
serves, for the zoo test (tests/engine/test_model_zoo.py).

Each is a real mlx-lm architecture at a tiny size (hidden 64, 2 layers or
the fewest its layer pattern allows), with seeded random weights stored as
bfloat16 -- as real checkpoints are, so the CPU backend's dtype limits
(gather_mm is float32-only there) are met as a user meets them -- and one
shared byte-level BPE tokenizer of 1024 tokens (the demo model's, with
gpt-oss's harmony markers added). Every model uses the demo's ChatML
template, which renders tools, except `gpt_oss_harmony`, whose template is a
small harmony one (gpt-oss's own format). Built once per folder, atomically
(mlxd.paths.build_folder_once), like the demo models.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Callable

from mlxd.paths import build_folder_once

BUILD_VERSION = 6
STAMP = ".mlxd-zoo.json"
VOCAB = 1024
SEED = 4321
# Qwen2's tokenizer class (transformers picks it by model_type) adds <|endoftext|> where the vocab lacks it:
# a tokenizer longer than the model's logits. Real Qwen vocabularies hold it; so does the zoo's.
EXTRA_TOKENS = ["<|endoftext|>"]
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]

# Shared shape pieces: hidden 64, 2 query heads of 32 and 1 KV head (32: the smallest head 8-bit KV's groups fit).
_ATTN = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
             vocab_size=VOCAB, max_position_embeddings=4096)
_DENSE = dict(_ATTN, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
_MAMBA = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, conv_kernel=4, n_groups=1)

# model_type -> its config.json's shape (beside the tokenizer's ids). Names are mlx-lm's module names.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(_DENSE),
    "qwen2": dict(_DENSE),
    "qwen3": dict(_DENSE),
    "olmo2": dict(_DENSE),
    "olmo3": dict(_DENSE, sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
    "ministral3": dict(_DENSE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "llama_4_scaling_beta": 0.1,
                                                "original_max_position_embeddings": 4096}),
    "mistral3": {"text_config": dict(_DENSE, model_type="ministral3",
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "llama_4_scaling_beta": 0.1,
                                                      "original_max_position_embeddings": 4096})},
    "gemma3_text": dict(_DENSE, query_pre_attn_scalar=32, sliding_window=64, sliding_window_pattern=2,
                        rms_norm_eps=1e-6),
    "gemma3": {"text_config": dict(_DENSE, model_type="gemma3_text", query_pre_attn_scalar=32, sliding_window=64,
                                   sliding_window_pattern=2, rms_norm_eps=1e-6), "vocab_size": VOCAB},
    "qwen3_moe": dict(_DENSE, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                      moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3_next": dict(_DENSE, num_hidden_layers=2, full_attention_interval=2, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
                       partial_rotary_factor=0.25, norm_topk_prob=True),
    "glm4_moe": dict(_DENSE, moe_intermediate_size=32, norm_topk_prob=True, n_group=1, topk_group=1,
                     n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
                     first_k_dense_replace=1, rope_scaling=None, use_qk_norm=True, attention_bias=False,
                     partial_rotary_factor=0.5),
    "deepseek_v3": dict(_DENSE, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32,
                        num_key_value_heads=2),
    "gpt_oss": dict(_DENSE, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"], intermediate_size=64),
    "falcon_h1": dict(_DENSE, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
                      mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=1, embedding_multiplier=1.0,
                      lm_head_multiplier=1.0, key_multiplier=1.0, attention_out_multiplier=1.0,
                      attention_in_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5,
                      ssm_in_multiplier=1.0, ssm_out_multiplier=1.0),
    "lfm2": dict(_DENSE, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 full_attn_idxs=[1], layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=8, head_dim=16, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, expand=2, state_size=16,
                   num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                   use_conv_bias=True, tie_word_embeddings=False, time_step_limit=[0.0, float("inf")],
                   time_step_rank=4, max_position_embeddings=4096),
    "nemotron_h": dict(_ATTN, **_MAMBA, attention_bias=False, mamba_proj_bias=False, mlp_bias=False,
                       layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hybrid_override_pattern="M*E-", num_hidden_layers=4,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1,
                       n_routed_experts=4, n_shared_experts=1, topk_group=1, num_experts_per_tok=2,
                       norm_topk_prob=True, routed_scaling_factor=1.0, time_step_limit=[0.0, float("inf")],
                       tie_word_embeddings=False),
    "granitemoehybrid": dict(_ATTN, num_hidden_layers=2, attention_bias=False, embedding_multiplier=1.0,
                             attention_multiplier=0.25, logits_scaling=1.0, residual_multiplier=1.0,
                             layer_types=["mamba", "attention"], rms_norm_eps=1e-5, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
                             mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True, tie_word_embeddings=False),
}
# A zoo model's name -> (its architecture, its chat template: "chatml" or "harmony").
MODELS: dict[str, tuple[str, str]] = {**{arch: (arch, "chatml") for arch in ARCHITECTURES},
                                      "gpt_oss_harmony": ("gpt_oss", "harmony")}

HARMONY_TEMPLATE = """{#- A small harmony template (gpt-oss's format): enough for its markers and its tools. -#}
<|start|>system<|message|>You are a tiny test model.
Reasoning: low

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
{%- set ns = namespace(developer='') -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}{%- set ns.developer = messages[0].content -%}{%- endif -%}
{%- if ns.developer or tools -%}
<|start|>developer<|message|>{% if ns.developer %}# Instructions

{{ ns.developer }}
{% endif %}{% if tools %}
# Tools

## functions

namespace functions {
{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}
// {{ f.description }}
type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions{% endif %}<|end|>
{%- endif -%}
{%- for message in messages -%}
{%- if not (loop.first and message.role in ['system', 'developer']) -%}
{%- set content = message.content if message.content is not none else '' -%}
{%- if message.role == 'user' -%}
<|start|>user<|message|>{{ content }}<|end|>
{%- elif message.role == 'assistant' -%}
{%- if content -%}<|start|>assistant<|channel|>final<|message|>{{ content }}<|end|>{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set tc = call.function if call.function is defined else call -%}
<|start|>assistant to=functions.{{ tc.name }}<|channel|>commentary json<|message|>{% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments | tojson }}{% endif %}<|call|>
{%- endfor -%}
{%- elif message.role == 'tool' -%}
<|start|>functions.{{ message.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ content }}<|end|>
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


def _config(model_type: str, ids: dict[str, int], eos: str) -> dict[str, Any]:
    shape = json.loads(json.dumps(ARCHITECTURES[model_type]))  # a deep copy
    for section in (shape, shape.get("text_config")):
        if section is not None and "vocab_size" not in section and model_type not in ("gemma3",):
            section["vocab_size"] = VOCAB
    return {"architectures": [f"{model_type}"], "model_type": model_type, **shape, "torch_dtype": "bfloat16",
            "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids[eos], "pad_token_id": ids["<|pad|>"]}


def _instantiate(config: dict[str, Any]) -> Any:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def _write_weights(folder: Path, config: dict[str, Any], eos_ids: list[int]) -> None:
    """Seeded N(0, 0.02) weights (norms at 1), bfloat16, in mlx-lm's own names.
    The EOS row of the embedding and the head is 0, so greedy decoding
    (almost) never ends an answer early: tests reach max_tokens."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    weights = {}
    for name, param in sorted(tree_flatten(_instantiate(config).parameters())):
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight") or name.endswith(("D", "A_log")):
            arr = np.ones(param.shape, np.float32)
        else:
            rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
            arr = rng.standard_normal(param.shape, np.float32) * 0.02
        if arr.ndim == 2 and arr.shape[0] == VOCAB:  # the embedding or the head
            arr[eos_ids] = 0.0
        weights[name] = mx.array(arr).astype(mx.bfloat16)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _build_into(folder: Path, name: str) -> None:
    from mlxd.engine.model.demo_model import BOS, IM_END, IM_START, PAD, SPECIAL_TOKENS, _train_tokenizer
    from mlxd.engine.model.demo_text import CHAT_TEMPLATE

    model_type, template = MODELS[name]
    tok = _train_tokenizer(VOCAB, SPECIAL_TOKENS + HARMONY_TOKENS + EXTRA_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + HARMONY_TOKENS}
    harmony = template == "harmony"
    eos = "<|return|>" if harmony else IM_END
    config = _config(model_type, ids, eos)
    if harmony:  # a call ends a harmony turn too
        config["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"]]
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": config["eos_token_id"],
                                                    "pad_token_id": ids[PAD]})
    specials = [IM_START, *HARMONY_TOKENS] if harmony else [IM_START]
    _write_json(folder / "special_tokens_map.json", {"bos_token": BOS, "eos_token": eos, "pad_token": PAD,
                                                     "additional_special_tokens": specials})
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": eos, "pad_token": PAD,
        "additional_special_tokens": specials, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": HARMONY_TEMPLATE if harmony else CHAT_TEMPLATE})
    eos_ids = config["eos_token_id"]
    _write_weights(folder, config, eos_ids if isinstance(eos_ids, list) else [eos_ids])
    _write_json(folder / STAMP, _stamp(name))  # last: marks the build complete


def _stamp(name: str) -> dict:
    model_type, template = MODELS[name]
    return {"zoo_build": BUILD_VERSION, "name": name, "template": template, "config": ARCHITECTURES[model_type]}


def _complete(folder: Path, name: str) -> bool:
    try:
        return json.loads((folder / STAMP).read_text(encoding="utf-8")) == json.loads(json.dumps(_stamp(name)))
    except (OSError, ValueError):
        return False


def build_zoo_model(dest: Path, name: str) -> Path:
    """Builds (once) the zoo model `name` (a key of MODELS) into `dest`; returns dest."""
    build_folder_once(Path(dest), lambda folder: _build_into(folder, name), complete=lambda f: _complete(f, name))
    return Path(dest)


def build_zoo(root: Path, names: list[str] | None = None, say: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Every zoo model (or those named) under `root`: name -> folder."""
    out = {}
    for name in names or list(MODELS):
        out[name] = build_zoo_model(Path(root) / name, name)
        if say is not None:
            say(f"zoo model {name}: {out[name]}")
    return out
