"""mlxd.devkit: what tests and benchmarks share -- a free port, polling with a
deadline, an engine (or any server) started and stopped by pid, the mlxd
stack in a throw-away home, and the Ollama stand-in (a test double). Never imported by the product (core, engine, supervisor, gateway,
launchd)."""
