"""mlxd: dependable local MLX serving.

Components live in top-level folders and are imported under this namespace:
mlxd.engine (engine/), mlxd.gateway (gateway/), mlxd.supervisor (supervisor/),
mlxd.launchd (launchd/), the `mlxd` command mlxd.cli (cli/) and what tests and
benchmarks share, mlxd.devkit (devkit/). This package (core/) holds what the
components share, without MLX. Every file, one line each (a test,
tests/layout/test_component_maps.py, keeps this list whole):

The config
  config.py             the one import for the config: `Config`, `load_config`, the first-run file
  config_sections.py    the file's sections (pydantic): each setting with its description
  config_engine.py      the [engine] section and its subsections (pydantic), the same way
  config_schema.py      the whole document: models, aliases, cross-section checks (pure)
  config_loading.py     finding and reading the file, the MLXD_* overrides, validation messages
  config_reference.py   text generated from the schema: docs/CONFIG.md, `--help`, the first-run file
  toml_text.py          TOML text from values: the one writer of mlxd.toml that code builds

Models and memory
  models.py             where each configured model lives and whether it fits the budget (no MLX)
  model_list.py         the configured models at a glance, one row each (`mlxd models`, the status page)
  memory_estimate.py    the heavy-model estimate: weights + KV against the budget (pure)
  moe_expert_bytes.py   a MoE's 16-bit routed experts, counted at float32 on MLX's CPU backend (pure)
  default_model.py      the real default model, SmolLM2-135M-Instruct, fetched at set-up
  default_embedding.py  the default embedding model, all-MiniLM-L6-v2, fetched at set-up
  durations.py          durations as Ollama writes them ("5m", "1h30m", seconds; negative: never) (pure)
  gguf.py               GGUF files without MLX: header, what MLX can load, the mlx-lm config (pure)
  ollama_store.py       Ollama's own model store, read-only: the GGUF behind a model name

State and contracts between processes
  paths.py              $MLXD_HOME's layout (`StatePaths`); atomic writes, folders built once
  records.py            files one process writes and another reads, one frozen dataclass each
  standby.py            the standby engine's handover: messages and descriptors over a unix socket
  reports.py            what one process tells another over HTTP or stdout (EngineHealth, ...)
  exit_codes.py         exit codes: the engine's, read by the crash listener and the scripts
  api_errors.py         the error contract the engine and the gateway share: type by status, codes
  keyfile.py            key files: generated on first use, 0600, compared in constant time
  host_check.py         the Host header check of every port mlxd opens (DNS rebinding)
  probe.py              one HTTP GET of a JSON document that never raises (the health probes)
"""

import time as _time

__version__ = "0.1.0"
# When this process started running mlxd code (before any heavy import): the
# engine reports it so that recovery time can be split into spawn and load.
STARTED_AT = _time.time()
