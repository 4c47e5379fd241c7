"""The gateway: a LiteLLM proxy with model aliases and the Ollama fallback.

Not built yet (issue 4); the engine is served directly until then.
"""
