"""A request's KV and the prompt cache: its memory and disk tiers, its pure decisions.

Owned by the core (engine/core/engine_core.py), which gives the cache its room from the
memory ledger. Every file, one line each:

  kv_cache.py             a request's KV: allocated once at its admitted length, quantised (kv_bits)
  prompt_cache.py         the prompt cache's memory and disk tiers (the worker's): store, checkpoint, evict
  prompt_cache_policy.py  its decisions (pure) and what it hands out (Fetched)
  cache_entries.py        what it holds: an entry in memory, a write of one under way
  cache_fetch.py          a turn's cached prefix handed out: from memory, or read from disk if worth it
  cache_writes.py         its writes under way: handed to the writer's thread, collected when done
  disk_speeds.py          the disk's and the prefill's measured speeds a disk read is judged by, kept on disk
  reuse_reports.py        what each recent conversation reused, and where and why reuse stopped
  reuse.py                a turn's reuse plan: which entry, how deep, continue or branch (pure)
  cache_keys.py           agent-safe keys: which conversation a request continues
  kv_files.py             the disk tier: its folder and index, a manifest per entry over shared blocks
  kv_format.py            the disk tier's files: a manifest or a whole file, parsed and checked (pure)
  kv_blocks.py            a conversation's KV as content-addressed blocks of 256 tokens (pure names)
  kv_writer.py            the disk tier's writer thread: files staged by the worker, written off its thread
"""
