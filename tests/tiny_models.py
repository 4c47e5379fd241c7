"""Tiny random-weight mlx-lm models for in-process tests of the CPU path's
layouts (tests/engine/test_cpu_*.py, tests/bench/test_cpu_arms.py): float32,
seeded, so two builds hold the same weights."""

from __future__ import annotations

from typing import Any


def tiny_llama(tied: bool, intermediate: int = 128, vocab: int = 97) -> Any:
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=intermediate,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                           tie_word_embeddings=tied)
    mx.random.seed(7)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def tiny(arch: str, tied: bool = True, intermediate: int = 256) -> Any:
    """A llama or qwen2 model of 2 layers, 4 query and 2 KV heads."""
    import mlx.core as mx
    from mlx_lm.models import llama, qwen2

    common = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=intermediate, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=101, tie_word_embeddings=tied)
    mx.random.seed(11)
    if arch == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", rope_theta=100000.0, **common))
    else:
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", max_position_embeddings=512, rope_theta=1e6,
                                            **common))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def decode(model: Any, cache: list, prompt: list[int], steps: int) -> list:
    """The prompt's logits, then `steps` greedy one-token steps' logits."""
    import mlx.core as mx

    logits = [model(mx.array([prompt]), cache=cache)[:, -1]]
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        logits.append(model(token[:, None], cache=cache)[:, -1])
    mx.eval(logits)
    return logits


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """`n` tokens of mlx-lm's own greedy decoding of `prompt` (generate_step)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


def batch_decode(model: Any, prompts: list[list[int]], n: int, proposer: Any = None, target: Any = None,
                 **batch: Any) -> tuple[list[list[int]], list[Any], list[Any]]:
    """Each prompt's `n` tokens from mlxd's batch step (engine/model/row_batch.py), the rows decoded
    together: (tokens, each row's SpecStats, each row's KV). `proposer(prompt, kv)`: a row's proposer."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.model.row_batch import RowBatch

    rows = RowBatch(model, frozenset(), **batch)
    uids, kvs = [], []
    for prompt in prompts:
        kv = make_prompt_cache(model)
        model(mx.array([prompt[:-1]], dtype=mx.int32), cache=kv)
        kvs.append(kv)
        uids.append(rows.insert(prompt[-1], kv, n, prompt[:-1], None, [], target,
                                proposer(prompt, kv) if proposer is not None else None))
    out: dict[int, list[int]] = {u: [] for u in uids}
    stats: dict[int, Any] = {}
    while rows.rows:
        for t in rows.next():
            out[t.uid].append(t.token)
            if t.finish_reason is not None:
                stats[t.uid] = t.speculation
    return [out[u] for u in uids], [stats.get(u) for u in uids], kvs
