"""The KV cache a request decodes into (engine/cache/kv_cache.py), in-process on
demo model a: allocated once at the admitted length (memory flat while it
generates, where mlx-lm's growing cache climbs a staircase), quantised at
kv_bits 8 and 4 from the first position or from quantized_kv_start, and
the copies the prompt cache keeps (fitted) and continues (packed)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

GENERATED = 700  # past two of mlx-lm's 256-position growth steps


@pytest.fixture(scope="module")
def demo(demo_models):
    from mlx_lm.utils import load

    return load(str(demo_models.a))


def _generate(model, tokenizer, prompt: list[int], kv, layout, max_tokens: int) -> tuple[list[int], list[int]]:
    """(tokens, MLX active memory after each) of a greedy generation into `kv`."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    quantize = ({"kv_bits": layout.bits, "kv_group_size": layout.group_size,
                 "quantized_kv_start": layout.quantized_start} if layout.quantized else {})
    tokens, active = [], []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=kv, **quantize):
        tokens.append(r.token)
        active.append(mx.get_active_memory())
    return tokens, active


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode("A supervised engine keeps serving when one part fails. " * 12)


def test_a_request_allocated_at_admission_holds_its_memory_flat(demo):
    """Allocated once for prompt + max_tokens: active memory after the first
    token never grows (goal: <= 1 %); mlx-lm's own cache grows by a step's
    KV at every 256 positions. Same tokens either way."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.cache.kv_cache import make_kv
    from mlxd.memory_estimate import KVLayout

    model, tokenizer = demo
    prompt = _prompt(tokenizer)
    mx.clear_cache()
    grown, grown_memory = _generate(model, tokenizer, prompt, make_prompt_cache(model), KVLayout(), GENERATED)
    kv = make_kv(model, len(prompt) + GENERATED, KVLayout())
    flat, flat_memory = _generate(model, tokenizer, prompt, kv, KVLayout(), GENERATED)
    assert flat == grown
    step_bytes = sum(c.nbytes for c in kv) * 256 // kv[0].keys.shape[2]  # one growth step's KV, every layer
    assert max(flat_memory) - flat_memory[0] <= 0.01 * flat_memory[0]
    assert max(flat_memory) - flat_memory[0] < step_bytes // 2
    assert max(grown_memory) - grown_memory[0] >= 2 * step_bytes  # the staircase: two more steps at least


def _shape(model, kv) -> dict:
    """The config fields the memory estimate reads, from the loaded model."""
    args = model.args
    return {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
            "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
            "torch_dtype": "float32" if kv[0].keys[1].dtype.size == 4 else "float16"}


@pytest.mark.parametrize("bits,start", [(8, 0), (4, 0), (8, 100)])
def test_quantised_kv_takes_its_share_of_the_memory(demo, bits, start):
    """kv_bits 8 / 4: every plain layer ends quantised (from the first
    position, or once it holds `start`), allocated once at the admitted
    length, at the bytes the memory estimate counts; what the prompt cache
    keeps is cut to the positions held, and a later turn's copy has room
    for its own."""
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxd.engine.model.prefill import prefill
    from mlxd.engine.cache.kv_cache import fitted, fitted_bytes, make_kv, packed
    from mlxd.engine.model.prefill_pace import PrefillPace
    from mlxd.memory_estimate import KVLayout, kv_allocated_tokens, kv_cache_bytes

    model, tokenizer = demo
    prompt = _prompt(tokenizer)
    layout = KVLayout(bits, 32, start)
    capacity = len(prompt) + 40
    kv = make_kv(model, capacity, layout)
    prefill(model, kv, prompt[:-1], PrefillPace(512, 5.0), lambda: None, None, layout)
    tokens, _ = _generate(model, tokenizer, prompt[-1:], kv, layout, 40)
    assert len(tokens) == 40
    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits and c.group_size == 32 for c in kv)
    assert {c.keys[0].shape[2] for c in kv} == {kv_allocated_tokens(capacity)}
    shape = _shape(model, kv)
    assert sum(c.nbytes for c in kv) == kv_cache_bytes(shape, kv_allocated_tokens(capacity), layout=KVLayout(bits, 32))
    held = kv[0].offset
    kept = fitted(kv)
    assert [type(c) for c in kept] == [QuantizedKVCache] * len(kv)  # mlx-lm's class: the disk file names it
    assert {c.keys[0].shape[2] for c in kept} == {held}
    assert sum(c.nbytes for c in kept) == fitted_bytes(kv) == kv_cache_bytes(shape, held, layout=KVLayout(bits, 32))
    again = packed(kept, 300)
    assert {c.keys[0].shape[2] for c in again} == {kv_allocated_tokens(held + 300)}
    assert all(c.offset == held for c in again)


def test_kv_at_16_bits_is_fitted_and_packed_as_mlx_lm_holds_it(demo):
    """The model's dtype: fitted copies are mlx-lm's KVCache of just the
    positions held (not the request's whole allocation); a branch packed
    from one is a copy (the entry stays as it was)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxd.engine.cache.kv_cache import fitted, make_kv, packed
    from mlxd.memory_estimate import KVLayout

    model, tokenizer = demo
    prompt = _prompt(tokenizer)
    kv = make_kv(model, len(prompt) + 500, KVLayout())
    _generate(model, tokenizer, prompt, kv, KVLayout(), 8)
    kept = fitted(kv)
    assert [type(c) for c in kept] == [KVCache] * len(kv)
    assert {c.keys.shape[2] for c in kept} == {kv[0].offset} and kv[0].keys.shape[2] > kv[0].offset
    branch = packed(kept, 64, shared=True)
    branch[0].keys[..., 0, :] = 0
    assert mx.any(kept[0].keys[..., 0, :] != 0).item()


def test_coarse_steps_allocate_and_pack_buffers_of_few_lengths(demo):
    """KVLayout.coarse_steps (MLX's CUDA backend): a request's buffer, and a
    cached turn's packed for the next, come in coarse steps, the lengths
    admission counts; the same tokens as whole steps of 256."""
    from mlxd.engine.cache.kv_cache import fitted, make_kv, packed
    from mlxd.memory_estimate import KVLayout, kv_allocated_tokens

    model, tokenizer = demo
    prompt = _prompt(tokenizer) * 20  # past 2,048 tokens, where coarse steps leave whole steps of 256
    capacity = len(prompt) + 300
    assert kv_allocated_tokens(capacity, coarse=True) != kv_allocated_tokens(capacity)
    coarse = make_kv(model, capacity, KVLayout(coarse_steps=True))
    whole = make_kv(model, capacity, KVLayout())
    assert _generate(model, tokenizer, prompt, coarse, KVLayout(), 8)[0] == \
        _generate(model, tokenizer, prompt, whole, KVLayout(), 8)[0]
    assert {c.keys.shape[2] for c in coarse} == {kv_allocated_tokens(capacity, coarse=True)}
    held = coarse[0].offset
    again = packed(fitted(coarse), 3000, coarse=True)
    assert {c.keys.shape[2] for c in again} == {kv_allocated_tokens(held + 3000, coarse=True)}
    assert packed(again, 100, coarse=True)[0] is again[0]  # a coarse buffer with room: continued as it is


def test_decoding_through_the_dequantised_view_matches_quantised_attention(demo):
    """Where MLX has no kernel for attention over quantised KV (its CUDA
    backend), the engine decodes through DequantizedView: the same KV, the
    same answer as mlx-lm's quantised attention where that runs (here)."""
    from mlxd.engine.model.prefill import prefill
    from mlxd.engine.cache.kv_cache import make_kv, prefill_views, quantized_decode_works
    from mlxd.engine.model.prefill_pace import PrefillPace
    from mlxd.memory_estimate import KVLayout

    model, tokenizer = demo
    layout = KVLayout(8, 32, 0)
    assert quantized_decode_works(model, layout)  # MLX's CPU backend has the kernels
    prompt = _prompt(tokenizer)
    answers, held = [], []
    for through_view in (False, True):
        kv = make_kv(model, len(prompt) + 24, layout)
        prefill(model, kv, prompt[:-1], PrefillPace(512, 5.0), lambda: None, None, layout)
        tokens, _ = _generate(model, tokenizer, prompt[-1:], prefill_views(kv) if through_view else kv,
                              KVLayout() if through_view else layout, 24)
        answers.append(tokens)
        held.append(kv[0].offset)
    assert answers[0] == answers[1]
    assert held[0] == held[1] > len(prompt)  # the view wrote into the layers themselves
