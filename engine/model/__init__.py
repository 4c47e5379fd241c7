"""The resident model: its load, its serving plan, its decoder and a request's generation.

The runner (runner.py) is the core's one way to MLX. What a request is (job.py) and what it
is told (events.py, errors.py) are here, below the core and the HTTP side that both use
them. Every file, one line each:

  runner.py               the resident model and its decoders: every MLX call the core makes
  mlx_memory.py           MLX's memory figures as the runner reads them
  job.py                  a request as the worker serves it: what to generate, where its events go
  events.py               what the worker tells a job's handler, and the channel it goes through
  errors.py               EngineError: status, code, message; rendered in one place
  faults.py               fault injection (crash, hang, MLX error) for tests; off by default
  serving_plan.py         how the resident model is served, decided at its load (pure)
  decoding.py             the decoder as the runner drives it: a request admitted, a step, those that ended
  decoder_rows.py         what the decoder holds and hands back: a request admitted, one that ended, its sampling
  batch_decoder.py        every text request decoded as one batch (one alone: a batch of one), joining rows prefilled
  row_batch.py            the batch's step: rows of any length, each over its own cache, every feature a per-row part
  row_proposals.py        what a row proposes for a verify step: prompt lookup, a draft model
  speculative.py          prompt lookup's pure parts: the n-gram index, how many to propose, the acceptance rule
  draft_model.py          a draft model: its tokenizer check, its one KV, kept for the next turn
  vision_row.py           a vision model's request, decoded by mlx-vlm's generation
  row_attention.py        a step's attention row by row without a mask; checked exact per model at load
  row_segments.py         decode tokens and joining prompts' chunks in one forward (RoPE and attention by segment)
  batch_probe.py          whether a batched step decodes more tokens a second than one row, timed at load
  cascade_attention.py    rows over a shared prompt prefix: its KV held once, read once a step, merged exactly
  generation.py           one job's prompt tokenized, and its answer relayed from the tokens a decoder gives
  model_registry.py       which models exist and where they live (configured names only)
  model_cache.py          one model resident: which to unload, then load (pure)
  model_load.py           a model into memory: mlx-lm, mlx-vlm, a rank's shard; its KV layout
  ranks.py                a rank group: one model sharded over processes (mlx.launch)
  prompt_tokens.py        chat prompts tokenized piece by piece, not whole every turn
  prefill.py              a prompt into its KV at the engine's pace; recomputed spans
  prefill_pace.py         each prefill step's size from the measured speed (pure)
  sampling.py             a request's sampler and logits processors
  grammar.py              what binds an answer (a JSON schema, a forced tool call), its rules, the first call bodies (pure)
  tool_formats.py         how a model writes its tool calls, which formats a grammar binds, a model's format (pure)
  answer_grammar.py       an answer's whole grammar: the rules and the model's call format, every format's body (pure)
  call_grammars.py        the tool-call bodies of Kimi K2, Gemma 4, FunctionGemma, pythonic, MiniMax as grammars (pure)
  harmony.py              gpt-oss's harmony: its channels split, its calls bound and read (pure)
  constrained.py          that grammar applied token by token (llguidance), a logits processor
  tool_prompt.py          tools written into the prompt where the chat template drops them
  stop_matcher.py         stop strings over streamed text (pure)
  context_overflow.py     a conversation over the model's context: refused, or its oldest whole turns dropped (pure)
  answer_parts.py         an answer split into reasoning, content and tool calls
  tool_calls.py           tool-call bodies in OpenAI's shape
  call_repair.py          malformed tool calls seen in the field, repaired before they are given up as text (pure)
  encoder.py              an embedding model: its load, limits, inputs' tokens and batched forwards
  reranker.py             rerankers' models and forwards: a cross-encoder, an embedding model's cosine, a chat
                          model's yes/no
  rerank_decisions.py     the rerankers' decisions (pure): results' order, a cross-encoder's limit and activation
  gguf_convert.py         a GGUF file -> an MLX model folder, converted once
  demo_model.py           the tiny random-weight demo models, built locally
  demo_text.py            their chat templates and tokenizer corpus (data)
"""
