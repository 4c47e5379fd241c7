"""The MLX engine: an OpenAI-compatible server over mlx-lm.

Entry point: `mlxd engine` -> mlxd.engine.main.run_engine. One worker thread
owns the model and every MLX call, stepping the engine's core; HTTP handlers
put a job on the admission queue and wait on its events. Every file, one line
each (a test, tests/layout/test_component_maps.py, keeps these lists whole):

  main.py                 `mlxd engine`: config, demo models, memory budget, BLAS, uvicorn

Its parts, a folder each (each folder's __init__.py names its files, one line each):
  api/     the HTTP side: the FastAPI app, one request's relay, /health, /metrics, the answers' shapes
  core/    the step loop: the worker thread, EngineCore, the scheduler, the request table, the memory
           ledger; the admission queue in front
  model/   the resident model: the runner (every MLX call), its serving plan, the two decoders, a
           request's tokens and generation, grammars, tool calls; load, registry, demo models; a
           job, its events and errors
  cache/   a request's KV and the prompt cache (memory and disk tiers, reuse plans)
  cpu/     the Linux CPU path: OpenBLAS, the float32 layout and decode (entered only from the load)

The parts are floors, each importing only those below it: api/ over core/
over model/ over cache/ and cpu/ (docs/DESIGN.md, "The engine's floors";
tests/layout/test_engine_floors.py). What a request is and what it is told
(model/job.py, model/events.py, model/errors.py) are on the model floor, so
every floor above uses them; only model/ and cache/ and cpu/ import MLX, and
only on the worker thread.

The heavy-model estimate is mlxd.models / mlxd.memory_estimate (core/),
shared with the gateway without MLX, as is the error contract
(mlxd.api_errors).
"""
