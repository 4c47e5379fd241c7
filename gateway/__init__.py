"""The gateway: our key guard and engine fast path in front of LiteLLM's
proxy, with model aliases and the Ollama fallback.

Entry point: `mlxd gateway` -> mlxd.gateway.main.run_gateway. Every file,
one line each (a test, tests/layout/test_component_maps.py, keeps this list
whole):

  main.py            `mlxd gateway`: the key, heavy models, litellm.yaml, then LiteLLM's proxy
  app.py             the ASGI app: our key check (401 in OpenAI's shape) in front of LiteLLM
  keys.py            the gateway key: generated on first run, 0600, rotatable, never logged
  health.py          the open health routes (ours and LiteLLM's), answered without a key
  fastpath.py        the engine fast path: light-model requests relayed past LiteLLM's chunk work
  hangup.py          a client that hangs up cancels its request, upstream to the engine too
  stored_responses.py  GET/DELETE /v1/responses/{id}: the engine's stored responses, the caller's own
  rerank.py            POST /v1/rerank: checked, then LiteLLM's rerank route; a 503 that says Ollama has none
  openapi.py         GET /openapi.json: the gateway's API document, the engine's cut to what it serves
  routing.py         the fast path's decisions (pure): refused, to LiteLLM or to the engine
  litellm_config.py  LiteLLM's proxy config, generated from mlxd's: model groups, Ollama fallbacks
  errors.py          the one way the gateway answers an error (OpenAI's shape, raw ASGI)
  status_page.py     the status page: /ui's static files (open, no data) and /mlxd/status, its keyed JSON
  status_history.py  the status page's last hour: memory, requests and tok/s sampled from the engine's /health
"""
