"""The MLX engine: an OpenAI-compatible server over mlx-lm.

Entry point: `mlxd engine` -> mlxd.engine.server.main. One worker thread
(worker.py) owns every MLX call; HTTP handlers (server.py) talk to it through
queues. Decisions live in small pure modules: admission.py (queue),
model_cache.py (which model to load/unload), memory_estimate.py (heavy-model
exclusion), faults.py (fault injection), protocol.py (request validation).
"""
