"""How the resident model is served, decided once when it loads (pure,
table-tested): how many requests its decoder takes at once, whether mlxd's
prompt cache serves it, how its KV holds values and whether it runs on the
CPU's float32 path. The runner (engine/model/runner.py) makes the plan at load;
the core reads its `max_concurrency`; /health and /metrics report it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.memory_estimate import KVLayout

BATCH = "batch"  # engine/model/batch_decoder.py: every text request, a lone one a batch of one
VISION = "vision"  # engine/model/vision_row.py: mlx-vlm's generation, one request at a time


@dataclass(frozen=True)
class ServingPlan:
    model_id: str
    max_concurrency: int  # requests decoded at once
    vision: bool  # mlx-vlm's model: a request's images go through its processor
    rank_group: bool  # sharded over processes (engine/model/ranks.py): every forward pass mirrored
    prompt_cache: bool  # mlxd's prompt cache serves it (not mlx-vlm's generation, not a rank group)
    kv: KVLayout  # how its requests' KV holds values (kv_bits), as this MLX can serve it
    cpu_float32: bool  # the CPU's float32 path (engine/cpu/cpu_linear.py, engine/cpu/cpu_decode.py)
    reason: str | None = None  # why max_concurrency is below what was configured
    speculative: str = "off"  # a lone request: "prompt_lookup" (speculative.py), "draft" (draft_model.py), "off"
    # Several rows in one forward, attention row by row over each row's own cache (engine/model/row_batch.py),
    # where the model was checked at load to give each row what it gets alone; else a forward a row.
    rows_apart: bool = False
    batch_speedup: float | None = None  # measured at load (engine/model/batch_probe.py); None: not measured
    # Joining prompts' chunks in the decode step's forward (engine/model/row_segments.py), checked exact at load.
    mixed_prefill: bool = False

    @property
    def decoder(self) -> str:
        return VISION if self.vision else BATCH


def speculative_mode(configured: str, *, vision: bool, rank_group: bool) -> str:
    """Speculative decoding as this model can serve it (pure): not through
    mlx-vlm's generation, not over a rank group's mirrored forwards. Over
    quantised KV it verifies as it decodes: the verified tokens' keys are
    quantised as they are written, as a plain step's are."""
    if configured == "off" or vision or rank_group:
        return "off"
    return configured


MIN_BATCH_SPEEDUP = 1.0  # a batched step must decode at least as many tokens a second as one row alone
# Measured, not assumed: four agents batched on 2 CPU cores served 0.82-0.94x the turns a minute of the same
# agents one at a time, in every run of three sessions (docs/BENCHMARKS.md), while a load-time probe of the
# forward alone said 1.2-2.6x: on the CPU a row's own work (its attention, sampling, relaying, the threads
# serving its stream) is what a step costs, not the weights the rows share.
ON_CPU = ("on the CPU a batch serves fewer tokens a second than one request at a time ([engine] batching = "
          "\"always\" batches anyway)")


def serving_plan(model_id: str, configured_concurrency: int, *, vision: bool, rank_group: bool,
                 kv: KVLayout, cpu_float32: bool, speculative: str = "off", rows_apart: bool = False,
                 batch_speedup: float | None = None, batching: str = "auto", on_cpu: bool = False,
                 mixed_prefill: bool = False) -> ServingPlan:
    """The plan for a model just loaded (pure; the first reason that holds
    limits it to one request at a time). `rows_apart`: a forward over rows
    each with its own cache gives every row what it gets alone (checked at
    load: engine/model/row_attention.py), else the batch runs a forward a
    row, no faster than one request at a time, so `batching` = "auto" serves
    one at a time; on the CPU (`on_cpu`) "auto" serves one at a time too
    (ON_CPU); `batch_speedup`:
    how many times the tokens a second of one row alone a batched step
    decodes (measured at load, engine/model/batch_probe.py; None: not
    measured, `[engine] batching = "always"`); `mixed_prefill`: a step of
    decode tokens and prompt chunks was found exact at load (kept where it batches)."""
    reason = None
    if configured_concurrency > 1:
        if rank_group:
            reason = "a rank group serves one request at a time"
        elif vision:
            reason = "a vision model is served by mlx-vlm, one request at a time"
        elif on_cpu and batching == "auto":
            reason = ON_CPU
        elif not rows_apart and batching == "auto":
            reason = ("this model's attention cannot be split by rows (it reads the keys itself): a batch runs a "
                      "forward a row, no faster than one request at a time ([engine] batching = \"always\" batches "
                      "anyway)")
        elif batch_speedup is not None and batch_speedup < MIN_BATCH_SPEEDUP:
            reason = (f"a batched step decodes {batch_speedup:.2f}x the tokens a second of one row alone on this "
                      "backend: one request at a time is faster ([engine] batching = \"always\" batches anyway)")
    return ServingPlan(model_id, 1 if reason else configured_concurrency, vision, rank_group,
                       not vision and not rank_group, kv, cpu_float32, reason,
                       speculative_mode(speculative, vision=vision, rank_group=rank_group),
                       rows_apart,
                       None if batch_speedup is None else round(batch_speedup, 3),
                       mixed_prefill and not reason)
