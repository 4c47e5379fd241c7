"""The MLX engine: an OpenAI-compatible server over mlx-lm.

Entry point: `mlxd engine` -> mlxd.engine.main.run_engine. One worker thread
owns the model and every MLX call, stepping the engine's core; HTTP handlers
put a job on the admission queue and wait on its events. Every file, one line each (a test,
tests/layout/test_component_maps.py, keeps this list whole):

HTTP and the process
  main.py                 `mlxd engine`: config, demo models, memory budget, uvicorn
  server.py               the FastAPI app and `Engine`, which wires the parts below
  relay.py                one request: admit, wait for the worker, answer as JSON or SSE
  lifecycle.py            start the worker, drain on SIGTERM, exit on an MLX error
  health.py               GET /health: the engine's state and the stuck verdict
  metrics.py              GET /metrics (Prometheus, read from published snapshots)
  faults.py               fault injection (crash, hang, MLX error) for tests; off by default

A request in, an answer out
  request_schema.py       the OpenAI request models (pydantic; shared with the gateway)
  jobs.py                 a request turned into a job: what to generate, where its events go
  request_metadata.py     agents' per-request metadata removed before the chat template (pure)
  images.py               where an image_url may come from (pure), and its bytes
  quarantine.py           refuses requests the crash listener quarantined
  admission.py            the bounded FIFO in front of the worker (429, 503; pure policy)
  events.py               what the worker tells a job's handler, and the channel it goes through
  response_builder.py     the answers in OpenAI's shape: whole bodies, SSE chunks, usage
  responses_api.py        the Responses API's request and its chat translation (pure; shared with the gateway)
  responses_builder.py    the Responses API's answers: the response object and its streamed events
  responses_store.py      stored responses for previous_response_id: one file each, bounded
  errors.py               EngineError: status, code, message; rendered in one place

The core: one step loop (docs/DESIGN.md, "The engine's core")
  worker.py               the one thread that owns the model and every MLX call: the loop around the core
  engine_core.py          EngineCore: a step at a time, the scheduler's decision done; owns the table, ledger, cache
  scheduler.py            the core's next step and the batch's memory admission (pure)
  request_table.py        every request the core holds, one status each (waiting, prefilling, decoding)
  worker_state.py         what the core publishes to other threads: phase, requests held, memory
  memory_ledger.py        who holds the memory budget: weights, requests' KV, the prompt cache's room
  device_memory.py        the process's device memory from outside (nvidia-smi), what MLX's limit leaves for it
  runner.py               the resident model and its decoders: every MLX call the core makes
  serving_plan.py         how the resident model is served, decided at its load (pure)
  decoding.py             the two decoders behind one interface: a request admitted, a step, those that ended
  one_row.py              one request decoded alone, as mlx-lm decodes one (generate_step; mlx-vlm's for images)
  many_rows.py            many requests decoded as one batch (mlx-lm's BatchGenerator), joining rows prefilled alone
  ranks.py                a rank group: one model sharded over processes (mlx.launch)

The model
  model_registry.py       which models exist and where they live (configured names only)
  model_cache.py          one model resident: which to unload, then load (pure)
  model_load.py           a model into memory: mlx-lm, mlx-vlm, a rank's shard; its KV layout
  fast_blas.py            Linux: OpenBLAS under MLX's CPU backend, chosen before MLX loads
  cpu_linear.py           the CPU's float32 path: Linear and Embedding weights held transposed (optionally in blocks on 2 streams)
  cpu_decode.py           the CPU's float32 path: a decoded token in a quarter of the MLX ops (RoPE, RMSNorm, attention, MLP)
  gguf_convert.py         a GGUF file -> an MLX model folder, converted once
  demo_model.py           the tiny random-weight demo models, built locally
  demo_text.py            their chat templates and tokenizer corpus (data)

Generation
  generation.py           one job's prompt tokenized, and its answer relayed from the tokens a decoder gives
  prompt_tokens.py        chat prompts tokenized piece by piece, not whole every turn
  prefill.py              a prompt into its KV at the engine's pace; recomputed spans
  prefill_pace.py         each prefill step's size from the measured speed (pure)
  sampling.py             a request's sampler and logits processors
  grammar.py              what binds an answer: a JSON schema, a forced tool call, as a grammar (pure)
  constrained.py          that grammar applied token by token (llguidance), a logits processor
  tool_prompt.py          tools written into the prompt where the chat template drops them

Parsing what the model writes
  stop_matcher.py         stop strings over streamed text (pure)
  answer_parts.py         an answer split into reasoning, content and tool calls
  tool_calls.py           tool-call bodies in OpenAI's shape

KV and the prompt cache
  kv_cache.py             a request's KV: allocated once at its admitted length, quantised (kv_bits)
  batch_kv.py             the batch's KV, allocated when rows join
  prompt_cache.py         the prompt cache's memory and disk tiers (the worker's)
  prompt_cache_policy.py  its decisions (pure) and what it hands out (Fetched)
  reuse.py                a turn's reuse plan: which entry, how deep, continue or branch (pure)
  cache_keys.py           agent-safe keys: which conversation a request continues
  kv_files.py             the disk tier: one safetensors file per entry, written atomically
  kv_writer.py            the disk tier's writer thread: files staged by the worker, written off its thread

The heavy-model estimate is mlxd.models / mlxd.memory_estimate (core/),
shared with the gateway without MLX, as is the error contract
(mlxd.api_errors).
"""
