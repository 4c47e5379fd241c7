"""The MLX engine: an OpenAI-compatible server over mlx-lm.

Entry point: `mlxd engine` -> mlxd.engine.main.run_engine. Where things are:

  server.py      the FastAPI app and `Engine`, which wires the parts below
  relay.py       the request flow: admit, wait, answer as JSON or SSE
  lifecycle.py   start, drain on SIGTERM, exit on an MLX error
  health.py      GET /health; metrics.py: GET /metrics
  worker.py      the one thread that owns the model and every MLX call
  worker_state.py  what it publishes: phase, requests held, memory
  lone_turns.py  its turns serving one request alone (stream_generate)
  batched_turns.py  its turns with max_concurrency > 1; batch.py: the batch
                 (mlx-lm's BatchGenerator; a request alone decodes solo)
  generation.py  one job's tokenize/decode on the resident model
  kv_cache.py    a request's KV: allocated once at its admitted length, quantised (kv_bits)
  jobs.py, events.py  a job, and the events the worker sends its handler

Decisions live in small pure modules: admission.py (queue), scheduler.py
(the batched worker's next step, memory admission), model_cache.py
(which model to load/unload), faults.py (fault injection), request_schema.py
(request validation, shared with the gateway; response_builder.py builds the
answers); the heavy-model estimate is mlxd.models / mlxd.memory_estimate
(core/), shared with the gateway without MLX, as is the error contract
(mlxd.api_errors).
"""
