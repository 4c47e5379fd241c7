"""The gateway: our key guard and engine fast path in front of LiteLLM's
proxy, with model aliases and the Ollama fallback (entry point: main.py)."""
