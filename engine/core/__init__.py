"""The engine's core: one step loop (docs/DESIGN.md, "The engine's core").

The worker thread steps `EngineCore`, which owns the request table, the memory ledger,
the prompt cache and a runner (engine/model/runner.py); the queues in front of it live here
too. What a request is (a job) and what it is told (events, errors) are the model floor's
(engine/model/), which generates it. Every file, one line each:

  worker.py               the one thread that owns the model and every MLX call: the loop around the core
  engine_core.py          EngineCore: a step at a time, the scheduler's decision done; owns the table, ledger, cache
  scheduler.py            the core's next step and the batch's memory admission (pure)
  request_table.py        every request the core holds, one status each (waiting, prefilling, decoding)
  worker_state.py         what the core publishes to other threads: phase, requests held, memory
  memory_ledger.py        who holds the memory budget: weights, requests' KV, the prompt cache's room
  device_memory.py        the process's device memory from outside (nvidia-smi), what MLX's limit leaves for it
  admission.py            the bounded FIFO in front of the worker (429, 503; pure policy)
  embedding_queue.py      embedding requests' own short line, served between the steps
  embedding_turn.py       the embedding request under way: its turn between the steps, its forwards, its answer
  side_jobs.py            the side jobs: an embedding request, several joined into one run, a rerank request
  prompt_turns.py         a request's turn through the prompt cache: fetched, checkpointed, stored
  held_answers.py         answers' ends held until their prompt is on disk, sent from the step (never waited under it)
  backend_limit.py        a backend's capability limit met by a forward: the requests told, the model reloaded
  residency.py            the resident model's load, unload and preload; MLX's memory limit and figures
  inflight_record.py      the crash journal's in-flight record: the running requests, written off the step's thread
  keep_alive.py           idle unload: when an idle model is given back, and its unload
"""
