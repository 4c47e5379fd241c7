"""mlxd.devkit: what tests and benchmarks share -- a free port, polling with a
deadline, an engine (or any server) started and stopped by pid, the mlxd
stack in a throw-away home, the tiny fine-tuned test models, GGUF fixtures
and the Ollama stand-in (a test double). Never imported by the product (core,
engine, supervisor, gateway, launchd). Its map, every file one line, is
devkit/README.md."""
