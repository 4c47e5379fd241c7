"""The serving plan decided at a model's load (engine/model/serving_plan.py) and
the memory ledger (engine/core/memory_ledger.py), as tables."""

from __future__ import annotations

import pytest

from mlxd.engine.model.errors import EngineError
from mlxd.engine.core.memory_ledger import MemoryLedger, ModelFigures
from mlxd.engine.core.scheduler import Pending, Row, Step, next_step
from mlxd.engine.model.serving_plan import BATCH, VISION, serving_plan
from mlxd.memory_estimate import KVLayout, kv_allocated_tokens, kv_cache_bytes

Q4 = KVLayout(bits=4)


@pytest.mark.parametrize("configured, vision, rank_group, apart, batching, kv, concurrency, decoder, why", [
    (1, False, False, True, "auto", KVLayout(), 1, BATCH, None),  # one at a time: a batch of one
    (4, False, False, True, "auto", KVLayout(), 4, BATCH, None),
    (4, False, False, False, "auto", KVLayout(), 1, BATCH, "cannot be split by rows"),  # a forward a row: no faster
    (4, False, False, False, "always", KVLayout(), 4, BATCH, None),  # ... batched anyway, as configured
    (4, True, False, False, "auto", KVLayout(), 1, VISION, "vision"),
    (4, False, True, True, "auto", KVLayout(), 1, BATCH, "rank group"),
    (4, False, False, True, "auto", Q4, 4, BATCH, None),  # rows keep their own quantised caches
    (1, True, False, False, "auto", KVLayout(), 1, VISION, None),  # nothing lowered: no reason to give
], ids=["single", "batched", "forward-a-row", "forward-a-row-always", "vision", "rank-group", "kv-bits",
        "vision-single"])
def test_serving_plan(configured, vision, rank_group, apart, batching, kv, concurrency, decoder, why):
    plan = serving_plan("m", configured, vision=vision, rank_group=rank_group, kv=kv, cpu_float32=False,
                        rows_apart=apart, batching=batching)
    assert (plan.max_concurrency, plan.decoder, plan.rows_apart) == (concurrency, decoder, apart)
    assert (plan.reason is None) if why is None else (why in plan.reason)
    assert plan.prompt_cache is (not vision and not rank_group)  # mlx-vlm's generation and a rank group: none of ours


@pytest.mark.parametrize("speedup, concurrency, why", [
    (None, 4, None),      # not measured (batching = "always"): as configured
    (2.6, 4, None),       # a large model on a GPU: four rows a step cost little more than one
    (1.0, 4, None),       # as many tokens a second either way: the batch, for its first tokens
    (0.85, 1, "batched step decodes 0.85x"),  # a small model on the CPU: one at a time is faster
])
def test_the_plan_serves_one_at_a_time_where_the_batch_is_slower(speedup, concurrency, why):
    plan = serving_plan("m", 4, vision=False, rank_group=False, kv=KVLayout(), cpu_float32=True,
                        rows_apart=True, batch_speedup=speedup)
    assert (plan.max_concurrency, plan.decoder) == (concurrency, BATCH)
    assert (plan.reason is None) if why is None else (why in plan.reason)
    assert plan.batch_speedup == speedup


MB = 2**20
CONFIG = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64, "num_attention_heads": 4,
          "hidden_size": 256, "torch_dtype": "float16"}


def ledger(budget_mb: int = 110, weights_mb: int | None = 100) -> MemoryLedger:
    out = MemoryLedger(budget_mb * MB)
    out.set_model(ModelFigures(None if weights_mb is None else weights_mb * MB, CONFIG, KVLayout()))
    return out


def test_a_request_decoded_alone_holds_its_grant_and_the_cache_gets_the_rest():
    led = ledger()
    assert led.cache_room() == 10 * MB
    led.grant_alone("a", 1000)
    need = kv_cache_bytes(CONFIG, kv_allocated_tokens(1000))
    assert need > 0 and led.cache_room() == 10 * MB - need
    led.keep_alone({"b"})  # "a" joined the batch: its grant goes
    assert led.cache_room() == 10 * MB
    led.grant_alone("a", 1000)
    led.release("a")
    assert led.cache_room() == 10 * MB


def test_the_batch_rows_are_counted_at_their_peak():
    led = ledger(budget_mb=200)
    led.hold_rows([Row(100, 100), Row(10, 20)])
    # each row its own length and what it may still generate, in whole steps of 256 positions: nothing padded
    kv = (256 + 256) * kv_cache_bytes(CONFIG, 1)
    assert led.cache_room() == 100 * MB - kv
    led.hold_rows([])
    assert led.cache_room() == 100 * MB


@pytest.mark.parametrize("tokens, refused", [(1000, False), (10**6, True)])
def test_a_request_that_cannot_fit_alone_is_refused_with_a_400(tokens, refused):
    led = ledger()
    if refused:
        with pytest.raises(EngineError) as e:
            led.grant_alone("a", tokens)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        assert led.cache_room() == 10 * MB  # nothing was granted
    else:
        led.grant_alone("a", tokens)
        assert led.cache_room() < 10 * MB


@pytest.mark.parametrize("outside_mb, limit_mb", [(0, 110), (8, 100), (80, 55)])  # 8 MB + 25 % to grow; floor: half
def test_memory_held_outside_mlx_lowers_the_limit_and_the_room(outside_mb, limit_mb):
    led = ledger()
    changed = led.lower_limit(outside_mb * MB)
    assert led.limit_bytes == limit_mb * MB
    assert changed == (None if limit_mb == 110 else limit_mb * MB)
    assert led.memory.budget_bytes == limit_mb * MB  # the batch's admission counts at the limit too
    assert led.cache_room() == max(0, (limit_mb - 100) * MB)


def test_a_model_of_unknown_size_leaves_the_cache_its_own_budget():
    led = ledger(weights_mb=None)
    led.grant_alone("a", 10**6)  # nothing to go by: never refused on memory
    assert led.cache_room() is None


@pytest.mark.parametrize("rows, pending, step", [
    ([Row(10, 10, alone=True)], Pending(True, Row(10, 10)), Step.DECODE),   # nobody joins a request decoded alone
    ([Row(10, 10, alone=True)], None, Step.DECODE),                         # nor is taken meanwhile
    ([Row(10, 10)], Pending(True, Row(10, 10)), Step.ADMIT),
])
def test_a_request_decoded_alone_is_joined_by_nobody(rows, pending, step):
    assert next_step(pending, True, rows, 4, ledger(budget_mb=200).memory) is step


@pytest.mark.parametrize("job, batched", [
    ({}, True),
    ({"seed": 7}, False),               # its answer must be the same every time: decoded alone
    ({"images": (b"png",)}, False),
    ({"alone": True}, False),           # in flight at a crash with others: a retry alone is evidence either way
    ({"model": "other"}, False),        # not the resident model
], ids=["plain", "seed", "image", "crash-suspect", "other-model"])
def test_what_the_batch_takes(job, batched):
    from types import SimpleNamespace

    from mlxd.engine.model.job import Job, SamplingParams
    from mlxd.engine.model.runner import ModelRunner

    runner = ModelRunner(SimpleNamespace(), SimpleNamespace(), 1000, 512, 5.0, heartbeat=lambda *_: None)
    runner.plan = serving_plan("m", 4, vision=False, rank_group=False, kv=KVLayout(), cpu_float32=False, rows_apart=True)
    j = Job(id="j", kind="completion", model_id=job.get("model", "m"), params=SamplingParams(16, seed=job.get("seed")),
            channel=None, deadline_s=60.0, prompt=[1, 2], images=job.get("images", ()), alone=job.get("alone", False))
    assert runner.can_batch(j) is batched


@pytest.mark.parametrize("on_cpu, batching, concurrency", [
    (True, "auto", 1),      # the CPU: one at a time serves more (measured in every run, whatever the probe says)
    (True, "always", 4),    # ... batched anyway, as configured
    (False, "auto", 4),     # a GPU: the probe decides
])
def test_auto_serves_one_at_a_time_on_the_cpu(on_cpu, batching, concurrency):
    plan = serving_plan("m", 4, vision=False, rank_group=False, kv=KVLayout(), cpu_float32=on_cpu, rows_apart=True,
                        batch_speedup=2.0, batching=batching, on_cpu=on_cpu)
    assert plan.max_concurrency == concurrency
    assert (plan.reason is None) == (concurrency == 4) and (concurrency == 4 or "on the CPU" in plan.reason)
