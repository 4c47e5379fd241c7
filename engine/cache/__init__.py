"""A request's KV and the prompt cache: its memory and disk tiers, its pure decisions.

Owned by the core (engine/core/engine_core.py), which gives the cache its room from the
memory ledger. Every file, one line each:

  kv_cache.py             a request's KV: allocated once at its admitted length, quantised (kv_bits)
  batch_kv.py             the batch's KV, allocated when rows join
  prompt_cache.py         the prompt cache's memory and disk tiers (the worker's)
  prompt_cache_policy.py  its decisions (pure) and what it hands out (Fetched)
  reuse.py                a turn's reuse plan: which entry, how deep, continue or branch (pure)
  cache_keys.py           agent-safe keys: which conversation a request continues
  kv_files.py             the disk tier: a manifest per entry over shared blocks, written atomically
  kv_blocks.py            a conversation's KV as content-addressed blocks of 256 tokens (pure names)
  kv_writer.py            the disk tier's writer thread: files staged by the worker, written off its thread
"""
