"""mlxd's configuration: one TOML file, validated with pydantic.

`$MLXD_HOME/mlxd.toml` (default home `~/.mlxd`) is the single source of truth;
generated configs (supervisord, LiteLLM, launchd) are derived from it. A
missing file means the defaults: the default model (SmolLM2-135M-Instruct once
set-up fetched it, else the built-in demo model) behind every alias.

Import it from here (`from mlxd.config import Config, load_config`); it lives in
  config_sections.py   the file's sections: each setting with its description
  config_engine.py     the [engine] section and its subsections, the same way
  config_schema.py     the whole document: models, aliases, cross-section checks
  config_loading.py    finding and reading the file, the environment overrides
                       (ENV_OVERRIDES, their one list), validation messages
  config_reference.py  text generated from the schema: docs/CONFIG.md
                       (`mlxd config reference`) and the first-run file
"""

from __future__ import annotations

from pathlib import Path

from mlxd.config_loading import (CONFIG_ENV, ENV_OVERRIDES, ConfigError, EnvOverride, apply_env_overrides,
                                 config_path, default_home, load_config, parse_config)
from mlxd.config_reference import default_config_text, env_help, reference_markdown
from mlxd.config_schema import DEMO_MODEL_ID, MODEL_ID_PATTERN, REQUIRED_ALIASES, Config, connect_host, default_models
from mlxd.config_engine import EngineConfig, ImagesConfig, PromptCacheConfig, RanksConfig
from mlxd.config_sections import (LOCAL_ENGINE, SOURCES, EmbeddingSpec, GatewayConfig, ModelSpec, RerankerSpec, Strict,
                                  SupervisorConfig, engine_host_url, host_entry_problem, is_loopback)
from mlxd.paths import write_atomic

__all__ = ["CONFIG_ENV", "DEFAULT_CONFIG_TEXT", "DEMO_MODEL_ID", "ENV_OVERRIDES", "LOCAL_ENGINE", "MODEL_ID_PATTERN",
           "REQUIRED_ALIASES", "SOURCES", "Config", "ConfigError", "EmbeddingSpec", "EngineConfig", "RerankerSpec", "EnvOverride", "GatewayConfig",
           "ImagesConfig", "ModelSpec", "PromptCacheConfig", "RanksConfig", "Strict", "SupervisorConfig",
           "apply_env_overrides", "config_path", "connect_host", "default_home", "default_models", "engine_host_url",
           "env_help", "host_entry_problem", "is_loopback", "load_config", "parse_config", "reference_markdown",
           "write_default_config"]

# The file `mlxd up` writes on first run (generated: config_reference.py).
DEFAULT_CONFIG_TEXT = default_config_text()


def write_default_config(path: Path) -> bool:
    """Write the commented default config if there is none; True if written.
    Atomically: a torn file would exist, so it would never be rewritten."""
    if path.exists():
        return False
    write_atomic(path, DEFAULT_CONFIG_TEXT)
    return True
