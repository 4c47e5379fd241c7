"""Reading the config: where it is, the MLXD_* environment overrides, and
validation errors in the config's own words.

ENV_OVERRIDES is the one list of the variables that change the config mlxd
runs with; docs/CONFIG.md, `mlxd --help`, what `mlxd up` remembers
(cli/started_with.py) and what a launchd/systemd unit carries
(launchd/common.py) are all read from it.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from mlxd.config_engine import EngineConfig
from mlxd.config_schema import Config, GatewayConfig, ModelSpec, SupervisorConfig


class ConfigError(ValueError):
    """The config file is unreadable or invalid; the message names the key."""


@dataclass(frozen=True)
class EnvOverride:
    """One MLXD_* variable that changes the config mlxd runs with."""

    name: str
    setting: str | None  # the setting it replaces ("engine.port"); None: it says where the config is
    what: str = ""  # for those that are not a setting: what they choose


ENV_OVERRIDES = (
    EnvOverride("MLXD_HOME", None, "the state directory (default `~/.mlxd`; `--home` sets it)"),
    EnvOverride("MLXD_CONFIG", None, "the config file (default `$MLXD_HOME/mlxd.toml`; `--config` sets it)"),
    EnvOverride("MLXD_ENGINE_HOST", "engine.host"),
    EnvOverride("MLXD_ENGINE_PORT", "engine.port"),
    EnvOverride("MLXD_GATEWAY_HOST", "gateway.host"),
    EnvOverride("MLXD_GATEWAY_PORT", "gateway.port"),
    EnvOverride("MLXD_OLLAMA_URL", "gateway.ollama_url"),
)
# Those that choose the config within a home: the file and the settings.
# `mlxd up` remembers them and a launchd/systemd unit carries them (the home
# is where both of those live, so it is never among them).
CONFIG_ENV = tuple(v.name for v in ENV_OVERRIDES if v.name != "MLXD_HOME")


def default_home() -> Path:
    return Path(os.environ.get("MLXD_HOME") or Path.home() / ".mlxd").expanduser()


def config_path(home: Path | None = None) -> Path:
    env = os.environ.get("MLXD_CONFIG")
    return Path(env).expanduser() if env else (home or default_home()) / "mlxd.toml"


def apply_env_overrides(data: dict, env: dict[str, str]) -> dict:
    """Return a copy of the TOML document with MLXD_* overrides applied."""
    settings = [(v.name, *v.setting.split(".")) for v in ENV_OVERRIDES if v.setting]
    data = {**data, **{section: dict(data.get(section, {})) for _, section, _ in settings}}
    for name, section, key in settings:
        if name in env:
            data[section][key] = env[name]
    return data


def _known_keys(loc: tuple) -> list[str]:
    """The settings allowed where an unknown key `loc` was found."""
    sections: dict[str, type[BaseModel]] = {"engine": EngineConfig, "supervisor": SupervisorConfig,
                                            "gateway": GatewayConfig}
    if len(loc) == 1:
        return [k for k in Config.model_fields if k != "home"]
    if len(loc) == 2 and loc[0] in sections:
        return list(sections[loc[0]].model_fields)
    if len(loc) == 3 and loc[0] == "models":
        return list(ModelSpec.model_fields)
    return []


def _describe(err: dict) -> str:
    """One line for one pydantic error, in the config's own words."""
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _known_keys(loc), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"  {key}: unknown setting{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a whole-config check: its message names the keys
        return f"  {msg}"
    return f"  {key}: {msg}" + (f" (got {err['input']!r})" if err["type"] not in ("value_error", "missing")
                                 and not isinstance(err.get("input"), dict) else "")


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"] + [_describe(err) for err in exc.errors()]
    lines.append(f"  Fix: edit {source} (every setting: `mlxd config reference`), then `mlxd config validate`.")
    return "\n".join(lines)


def parse_config(data: dict, home: Path, source: str = "<dict>") -> Config:
    """Validate a parsed TOML document (pure: no file or environment access)."""
    try:
        return Config(home=home, **data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None
    except TypeError as exc:  # e.g. a top-level key given twice
        raise ConfigError(f"invalid config {source}: {exc}") from None


def load_config(path: Path | None = None, home: Path | None = None) -> Config:
    """Read the config file (defaults when it does not exist) plus env overrides."""
    home = home or default_home()
    path = path or config_path(home)
    data: dict = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}\n"
                              f"  Fix: correct that line (TOML: https://toml.io), or move the file away to use "
                              f"the defaults.") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return parse_config(apply_env_overrides(data, dict(os.environ)), home, str(path))
