"""The engine's HTTP side: the FastAPI app, one request's relay, the answers in OpenAI's shape
(and Anthropic's, on /v1/messages).

It puts a job on the core's admission queue (engine/core/) and turns the job's events into
JSON or SSE; it never touches MLX. Every file, one line each:

  server.py               the FastAPI app and `Engine`, which wires the parts below
  relay.py                one request: admit, wait for the worker, answer as JSON or SSE
  request_job.py          a request turned into a job: what can be refused before the worker (model, size, images)
  lifecycle.py            start the worker, drain on SIGTERM, exit on an MLX error
  health.py               GET /health: the engine's state and the stuck verdict
  metrics.py              GET /metrics (Prometheus, read from published snapshots)
  request_schema.py       the OpenAI request models (pydantic; shared with the gateway), how their errors read
  request_fields.py       the field types and validators the request models share: bounds, Unsupported, reasoning
  request_limits.py       every request field's limits as one table (docs/LIMITS.md), from the models' schemas
  chat_messages.py        a chat request's messages: text and image parts, tool calls, tools, as templates take them
  request_metadata.py     agents' per-request metadata removed before the chat template (pure)
  set_aside.py            hosted tools no local model can run, out of the body and named in a header (pure + ASGI)
  images.py               where an image_url may come from (pure), and its bytes
  quarantine.py           refuses requests the crash listener quarantined
  response_builder.py     the answers in OpenAI's shape: whole bodies, SSE chunks, usage
  responses_api.py        the Responses API's request: its tools, formats, controls (pure; shared with the gateway)
  responses_items.py      the Responses API's input items: messages, earlier calls and outputs, reasoning (pure)
  responses_to_chat.py    a Responses request as a chat request, its errors renamed, an answer as a message (pure)
  responses_builder.py    the Responses API's answers: the response object and its streamed events
  responses_store.py      stored responses for previous_response_id: one file each, bounded
  messages_api.py         Anthropic's Messages API request and its chat translation (pure; shared with the gateway)
  messages_builder.py     the Messages API's answers: the message and its streamed events, Anthropic's errors
  embeddings_api.py       POST /v1/embeddings: its model and dimensions decided (pure), the answer's formats
  rerank_api.py           POST /v1/rerank (and /rerank, /v2/rerank): its reranker decided (pure), the answer
"""
