"""mlxd's configuration: one TOML file, validated with pydantic.

`$MLXD_HOME/mlxd.toml` (default home `~/.mlxd`) is the single source of truth;
generated configs (supervisord, LiteLLM, launchd) are derived from it. A
missing file means the defaults: the default model (SmolLM2-135M-Instruct once
set-up fetched it, else the built-in demo model) behind every alias.

Environment overrides (each documented in README.md):
  MLXD_HOME          state directory (default ~/.mlxd)
  MLXD_CONFIG        config file path (default $MLXD_HOME/mlxd.toml)
  MLXD_ENGINE_HOST   engine bind address
  MLXD_ENGINE_PORT   engine port
  MLXD_GATEWAY_HOST  gateway bind address
  MLXD_GATEWAY_PORT  gateway port
  MLXD_OLLAMA_URL    Ollama's address
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlxd import default_model
from mlxd.paths import StatePaths, write_atomic

REQUIRED_ALIASES = ("fast", "default", "coding", "reasoning")
DEMO_MODEL_ID = "demo"
# A model id is a plain name: never a path, so a request cannot point the
# engine at arbitrary files (ids are looked up in the config, nothing else).
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"


class ConfigError(ValueError):
    """The config file is unreadable or invalid; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SOURCES = ("path", "repo", "gguf", "from_ollama", "demo")  # where a model comes from: exactly one per model
LOCAL_ENGINE = "local"  # in a model's `hosts`: this machine's engine ([engine] host and port)


def engine_host_url(entry: str, local_url: str) -> str:
    """A `hosts` entry -> the engine's base URL (pure): "local" is this
    machine's engine; "host:port" is plain HTTP; a full http(s):// URL is
    used as it is (an engine behind a TLS reverse proxy)."""
    if entry == LOCAL_ENGINE:
        return local_url
    if entry.startswith(("http://", "https://")):
        return entry.rstrip("/")
    return "http://" + entry


def host_entry_problem(entry: str) -> str | None:
    """Why a `hosts` entry is unusable, or None (pure)."""
    from urllib.parse import urlsplit

    if entry == LOCAL_ENGINE:
        return None
    url = urlsplit(engine_host_url(entry, ""))
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None or url.path not in ("", "/") or url.query or url.username:
        return f"{entry!r} is not \"local\", \"host:port\" or \"http(s)://host:port\""
    return None


class ModelSpec(Strict):
    """One MLX model. Exactly one of path / repo / gguf / demo says where it is."""

    path: str | None = None  # a local model folder
    repo: str | None = None  # a Hugging Face repo id, e.g. mlx-community/...-4bit
    gguf: str | None = None  # a local .gguf file (llama, qwen2, qwen3; F32/F16/BF16/Q4_0/Q4_1/Q8_0), converted once
    from_ollama: str | None = None  # an Ollama model name (qwen3:4b): its GGUF from Ollama's store, and its fallback
    demo: Literal["a", "b", "vision"] | None = None  # a built-in demo model variant ("vision": a tiny VLM)
    ollama: str | None = None  # the Ollama model the gateway falls back to
    context_tokens: int | None = Field(default=None, gt=0)  # KV allowance override
    # Requests generated at once for this model; None: [engine] max_concurrency.
    max_concurrency: int | None = Field(default=None, ge=1, le=64)
    # Its KV cache's precision; None: the [engine] settings of the same names.
    kv_bits: Literal[4, 8, 16] | None = None
    kv_group_size: Literal[32, 64, 128] | None = None
    quantized_kv_start: int | None = Field(default=None, ge=0)
    # The engines that serve it: "local" (this machine's) and/or "host:port" of
    # other Macs running mlxd with the same model id. Several: LiteLLM balances.
    hosts: list[str] = Field(default_factory=lambda: [LOCAL_ENGINE], min_length=1)

    @property
    def fallback_ollama(self) -> str | None:
        """The Ollama model that answers when the engine cannot."""
        return self.ollama or self.from_ollama

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSpec":
        given = [k for k in SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(SOURCES)} (got {given or 'none'})")
        for entry in self.hosts:
            problem = host_entry_problem(entry)
            if problem:
                raise ValueError(f"hosts: {problem}")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError("hosts: an engine is listed twice")
        return self


class PromptCacheConfig(Strict):
    """Prefix reuse across requests (engine/prompt_cache.py): the KV of earlier
    prompts, in memory and on disk under $MLXD_HOME/state/kv."""

    enabled: bool = True
    # Memory for cached KV. None: half of what the resident model's estimate
    # (weights + KV for context_tokens) leaves of the memory budget.
    memory_gib: float | None = Field(default=None, ge=0)
    disk: bool = True  # evicted entries (and the last one, when idle) go to disk; survives engine restarts
    disk_gib: float = Field(default=8.0, ge=0)
    max_read_s: float = Field(default=5.0, gt=0)  # never read an entry expected to take longer than this
    # Agent-safe keys: volatile text ignored when matching a conversation to its
    # entry (the model always sees the original tokens). Off unless named here.
    normalize: list[Literal["iso_timestamps", "clock_times", "uuids", "request_ids"]] = Field(default_factory=list)
    # Approximate reuse (opt-in): past a changed span (a clock, an id) the cached
    # KV is kept and only the changed tokens are recomputed, so the model sees KV
    # computed from the old value there. Exact reuse stops at the first change.
    approximate: bool = False


class ImagesConfig(Strict):
    """Images in requests to vision models (engine/images.py)."""

    # Folders that file:///... image URLs may name (links resolved first); empty: none.
    local_dirs: list[str] = Field(default_factory=list)
    max_per_request: int = Field(default=8, ge=1)
    max_bytes: int = Field(default=20 * 2**20, gt=0)  # one encoded image
    max_pixels: int = Field(default=50_000_000, gt=0)  # one decoded image (width x height)


class RanksConfig(Strict):
    """A rank group (engine/ranks.py): one engine whose model is sharded over
    several processes, started together by MLX's `mlx.launch`."""

    # One IP per rank, rank 0 (this Mac, which serves HTTP) first; the same IP
    # twice runs two ranks on one Mac. Empty: one process, no sharding.
    hosts: list[str] = Field(default_factory=list)
    backend: Literal["ring", "jaccl"] = "ring"  # ring: TCP (Ethernet, Thunderbolt IP); jaccl: RDMA over Thunderbolt 5
    hostfile: str | None = None  # mlx.distributed_config's output (JACCL needs one); instead of `hosts`
    starting_port: int = Field(default=32323, ge=1024, le=65000)  # ring: first port, +1 per rank

    @model_validator(mode="after")
    def _a_group(self) -> "RanksConfig":
        if len(self.hosts) == 1:
            raise ValueError("hosts: a rank group has two ranks or more (leave it empty for one process)")
        if self.hostfile and self.hosts:
            raise ValueError("give hosts or hostfile, not both")
        if self.backend == "jaccl" and not self.hostfile:
            raise ValueError("backend = \"jaccl\" needs a hostfile (mlx.distributed_config --backend jaccl)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.hostfile)


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only (pure):
    wildcards ("0.0.0.0", "::", "") and real interfaces are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, assume the network


class EngineConfig(Strict):
    host: str = "127.0.0.1"
    # Requests must carry the key in $MLXD_HOME/engine.key (created on first start;
    # the gateway sends it). Required wherever `host` is not a loopback address.
    require_key: bool = False
    port: int = Field(default=8080, ge=1, le=65535)
    default_model: str = "default"  # alias or id preloaded at start
    # Requests generated at once. 1 (the default) is single concurrency: one
    # request holds the model, the rest wait in line. Above 1, the running
    # requests are decoded as one batch (mlx-lm's BatchGenerator), each admitted
    # only when the KV of every running request at its full length fits the
    # memory budget beside the model (docs/CONFIG.md says when it is safe).
    max_concurrency: int = Field(default=1, ge=1, le=64)
    max_queue: int = Field(default=8, ge=0)  # waiting requests beyond the running ones
    queue_timeout_s: float = Field(default=120.0, gt=0)  # longest wait for the worker
    request_deadline_s: float = Field(default=600.0, gt=0)  # wall clock per generation
    max_prompt_tokens: int = Field(default=32768, gt=0)
    max_tokens_cap: int = Field(default=8192, gt=0)  # ceiling on max_tokens
    default_max_tokens: int = Field(default=1024, gt=0)
    memory_fraction: float = Field(default=0.75, gt=0, le=1.0)
    context_tokens: int = Field(default=8192, gt=0)  # KV allowance in the estimate
    heavy_patterns: list[str] = Field(
        default_factory=lambda: ["70b", "72b", "90b", "104b", "110b", "123b", "235b", "405b", "480b", "671b"]
    )
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    stuck_grace_s: float = Field(default=30.0, gt=0)  # deadline overrun before "stuck"
    # Prompt tokens per prefill step. Every step is a heartbeat, so it must take
    # well under stuck_grace_s even on a slow machine with a big model, or a long
    # prompt is mistaken for a hang (mlx-lm's own default is 2048).
    prefill_step_size: int = Field(default=512, ge=16)
    # On the CPU backend with an optimised BLAS (Linux: engine/fast_blas.py),
    # load models whose float32 weights take at most a quarter of the memory
    # budget as float32: there a prompt runs ~15x faster than quantised.
    cpu_float32: bool = True
    # The KV cache's precision: 16 keeps the model's dtype; 8 or 4 store keys
    # and values quantised (mlx-lm's QuantizedKVCache) in groups of
    # kv_group_size values (a smaller size where a model's head is not a
    # multiple), from the request's quantized_kv_start-th position on: about
    # 1.9x / 3.5x the context in the same memory. Served alone only: mlx-lm's
    # batch has no quantised cache, so it needs max_concurrency = 1.
    kv_bits: Literal[4, 8, 16] = 16
    kv_group_size: Literal[32, 64, 128] = 64
    quantized_kv_start: int = Field(default=0, ge=0)
    # The engine's own log: "debug" adds, per request, the text on both sides
    # of where prompt-cache reuse stopped (which agent field broke it).
    log_level: Literal["debug", "info", "warning"] = "info"
    # Per-request metadata that agents write into the prompt for a hosted API's
    # own servers, removed before the chat template (engine/request_metadata.py).
    strip_metadata: list[Literal["claude_code_billing_header"]] = Field(
        default_factory=lambda: ["claude_code_billing_header"])
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
    images: ImagesConfig = ImagesConfig()
    ranks: RanksConfig = RanksConfig()

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> "EngineConfig":
        if not self.require_key and not is_loopback(self.host):
            raise ValueError(f"host = {self.host!r} lets other machines reach the engine: set require_key = true "
                             "(the gateway then sends the key in $MLXD_HOME/engine.key; copy that file to every "
                             "gateway that uses this engine)")
        return self


class SupervisorConfig(Strict):
    """Restart policy and hang detection (see supervisor/policy.py)."""

    backoff_base_s: float = Field(default=1.0, ge=0)
    backoff_cap_s: float = Field(default=60.0, ge=0)
    healthy_reset_s: float = Field(default=120.0, gt=0)
    loop_crashes: int = Field(default=5, ge=1)
    loop_window_s: float = Field(default=600.0, gt=0)
    cooldown_s: float = Field(default=300.0, ge=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_failures: int = Field(default=3, ge=1)
    start_grace_s: float = Field(default=120.0, ge=0)
    quarantine_s: float = Field(default=3600.0, ge=0)
    journal_max_bytes: int = Field(default=1_000_000, ge=10_000)


class GatewayConfig(Strict):
    """The LiteLLM proxy in front of the engine (see gateway/)."""

    host: str = "127.0.0.1"  # "0.0.0.0" (or a bridge address) for Docker agents; the key is always required
    port: int = Field(default=4000, ge=1, le=65535)
    ollama_url: str = "http://127.0.0.1:11434"
    default_ollama_model: str | None = "llama3.2:3b"  # fallback for models without their own `ollama`
    only_light: bool = False  # every alias -> the light model on MLX (see light_model)
    light_model: str | None = None  # model id; default: the first model that fits the memory budget
    busy_spill: bool = False  # a busy engine sends requests to Ollama at once instead of queueing
    engine_fast_path: bool = True  # relay light-model answers from the engine as is (gateway/fastpath.py)
    # A host that failed (refused, reset, 5xx, wrong key) is left out this long,
    # then tried again; a busy one (429) for its Retry-After.
    host_cooldown_s: float = Field(default=5.0, gt=0)
    enabled: bool = True


class Config(Strict):
    home: Path
    engine: EngineConfig = EngineConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    gateway: GatewayConfig = GatewayConfig()
    models: dict[str, ModelSpec] = Field(default_factory=lambda: default_models(default_model.gguf_path()))
    aliases: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_names(self) -> "Config":
        for name in list(self.models) + list(self.aliases):
            if not re.match(MODEL_ID_PATTERN, name):
                raise ValueError(f"model/alias name {name!r} must match {MODEL_ID_PATTERN}")
        if self.gateway.light_model is not None and self.gateway.light_model not in self.models:
            raise ValueError(f"gateway.light_model {self.gateway.light_model!r} is not under [models]")
        for alias, target in self.aliases.items():
            if target not in self.models:
                raise ValueError(f"aliases.{alias} points at {target!r}, which is not under [models]")
            if alias in self.models:
                raise ValueError(f"aliases.{alias} is also a model id; pick one")
        for name, spec in self.models.items():
            bits = spec.kv_bits or self.engine.kv_bits
            concurrency = spec.max_concurrency or self.engine.max_concurrency
            if bits < 16 and concurrency > 1:
                raise ValueError(f"model {name!r}: kv_bits = {bits} needs max_concurrency = 1 (it is {concurrency}): "
                                 "mlx-lm's batched generation has no quantised KV cache; set kv_bits = 16 for it "
                                 f"([models.{name}] kv_bits = 16) or serve it one request at a time")
            if bits < 16 and self.engine.ranks.enabled:
                raise ValueError(f"model {name!r}: kv_bits = {bits} is not supported in a rank group "
                                 "([engine.ranks]): each rank keeps its own KV cache at the model's dtype")
        return self

    def kv_settings(self, model_id: str) -> tuple[int, int, int]:
        """(kv_bits, kv_group_size, quantized_kv_start) of a model: its own, else the engine's."""
        spec, engine = self.models[model_id], self.engine
        return (spec.kv_bits or engine.kv_bits, spec.kv_group_size or engine.kv_group_size,
                engine.quantized_kv_start if spec.quantized_kv_start is None else spec.quantized_kv_start)

    @property
    def all_aliases(self) -> dict[str, str]:
        """Configured aliases plus the required ones, which default to the
        first configured model (the default model when none is configured)."""
        first = next(iter(self.models))
        merged = {a: first for a in REQUIRED_ALIASES}
        merged.update(self.aliases)
        return merged

    def resolve(self, name: str) -> str | None:
        """Alias or model id -> model id; None when unknown."""
        if name in self.models:
            return name
        return self.all_aliases.get(name)

    @property
    def paths(self) -> StatePaths:
        """Every file and folder under the state directory."""
        return StatePaths(self.home)

    @property
    def engine_url(self) -> str:
        """Where this machine reaches the engine, e.g. http://127.0.0.1:8080
        (no trailing slash; add /health or /v1)."""
        return f"http://{connect_host(self.engine.host)}:{self.engine.port}"

    def engine_urls(self, model_id: str) -> list[str]:
        """The base URLs of the engines that serve a model, in config order."""
        return [engine_host_url(h, self.engine_url) for h in self.models[model_id].hosts]

    @property
    def remote_engines(self) -> bool:
        """Whether any model is served by an engine on another host."""
        return any(h != LOCAL_ENGINE for spec in self.models.values() for h in spec.hosts)

    @property
    def gateway_url(self) -> str:
        """Where this machine reaches the gateway (add /v1 for clients)."""
        return f"http://{connect_host(self.gateway.host)}:{self.gateway.port}"


def connect_host(bind_host: str) -> str:
    """The address a local client uses for a server bound to `bind_host`:
    a wildcard bind ("0.0.0.0", "::", "") is reached over IPv4 loopback; an
    IPv6 literal is bracketed; anything else is used as it is."""
    if bind_host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def default_models(real_gguf: Path) -> dict[str, ModelSpec]:
    """With no model configured: the real default model once set-up fetched
    it (mlxd.default_model), else the random-weight demo model."""
    if real_gguf.is_file():
        return {default_model.MODEL_ID: ModelSpec(gguf=str(real_gguf), ollama=default_model.OLLAMA_TWIN)}
    return {DEMO_MODEL_ID: ModelSpec(demo="a")}


def default_home() -> Path:
    return Path(os.environ.get("MLXD_HOME") or Path.home() / ".mlxd").expanduser()


def config_path(home: Path | None = None) -> Path:
    env = os.environ.get("MLXD_CONFIG")
    return Path(env).expanduser() if env else (home or default_home()) / "mlxd.toml"


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


def apply_env_overrides(data: dict, env: dict[str, str]) -> dict:
    """Return a copy of the TOML document with MLXD_* overrides applied."""
    data = {**data, "engine": dict(data.get("engine", {}))}
    if "MLXD_ENGINE_HOST" in env:
        data["engine"]["host"] = env["MLXD_ENGINE_HOST"]
    if "MLXD_ENGINE_PORT" in env:
        data["engine"]["port"] = env["MLXD_ENGINE_PORT"]
    data["gateway"] = dict(data.get("gateway", {}))
    if "MLXD_GATEWAY_HOST" in env:
        data["gateway"]["host"] = env["MLXD_GATEWAY_HOST"]
    if "MLXD_GATEWAY_PORT" in env:
        data["gateway"]["port"] = env["MLXD_GATEWAY_PORT"]
    if "MLXD_OLLAMA_URL" in env:
        data["gateway"]["ollama_url"] = env["MLXD_OLLAMA_URL"]
    return data


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


DEFAULT_CONFIG_TEXT = """\
# mlxd configuration (written by `mlxd up` on first run). Every setting and
# its default: docs/CONFIG.md. `mlxd config validate` checks this file.
#
# No model is configured, so every alias serves the default model:
# SmolLM2-135M-Instruct (small and real), or the random-weight demo model when
# set-up could not fetch it. To serve another model:
#
# [models.qwen]
# repo = "mlx-community/Qwen3-4B-Instruct-2507-4bit"   # or: path = "/model/folder", gguf = "/file.gguf",
# ollama = "qwen3:4b"                                   #     from_ollama = "qwen3:4b"; ollama: the fallback
#
# [aliases]
# default = "qwen"
# fast = "qwen"
# coding = "qwen"
# reasoning = "qwen"

[engine]
port = 8080

[gateway]
port = 4000
"""


def write_default_config(path: Path) -> bool:
    """Write the commented default config if there is none; True if written.
    Atomically: a torn file would exist, so it would never be rewritten."""
    if path.exists():
        return False
    write_atomic(path, DEFAULT_CONFIG_TEXT)
    return True


SECTION_DOCS = {
    "engine": (
        "The MLX engine (engine/): one request at a time (by default), one model, no heavy models. "
        "`max_concurrency` above 1 (per model: `[models.ID] max_concurrency`) decodes that many requests as one "
        "batch (mlx-lm's BatchGenerator): more tokens per second in all and a short wait for each of several "
        "agents, at the price of memory. It is safe by construction: a request joins the batch only when the "
        "model, the KV of every running request at its full length (prompt + max_tokens; mlx-lm pads every row "
        "to the longest) and its own fit the memory budget, else it waits in the queue; the prompt cache gives up "
        "memory first. Raise it where several agents share the engine and the model leaves room (a small model "
        "on a large Mac); keep 1 where one agent at a time is the rule or memory is tight. Requests with a `seed` "
        "or images, and models mlx-lm cannot batch, are served alone in their turn. `strip_metadata` names "
        "the per-request metadata removed from prompts before the chat template (engine/request_metadata.py): "
        "`claude_code_billing_header` is the `x-anthropic-billing-header: cc_version=...; cch=...;` line Claude "
        "Code puts at the top of its system prompt for Anthropic's billing, which changes every request and would "
        "otherwise defeat the prompt cache; `[]` keeps prompts exactly as sent. "
        "`kv_bits` 8 or 4 (per model too) keeps the KV cache quantised (mlx-lm's QuantizedKVCache: per "
        "`kv_group_size` values a scale and a bias): about 1.9x or 3.5x the context, or the prompt cache's "
        "conversations, in the same memory, at a small cost in quality that docs/BENCHMARKS.md measures; the "
        "memory estimate, admission and the prompt cache count the quantised size, and cached entries are never "
        "reused across kv_bits. It needs max_concurrency = 1 (mlx-lm's batch has no quantised cache) and no rank "
        "group; vision models and layers mlx-lm cannot quantise (rotating windows, recurrent state) keep the "
        "model's dtype, and the engine's log says so. Every request's KV is allocated once, at the length its "
        "admission counted (prompt + max_tokens), so memory does not grow while it generates."),
    "engine.prompt_cache": (
        "The prompt cache (engine/prompt_cache.py): an agent's next turn reuses the KV of the conversation so "
        "far, from memory or, after an engine restart, from disk (`$MLXD_HOME/state/kv/`). `memory_gib` unset: "
        "half of what the resident model's estimate leaves of the memory budget (never more than that). "
        "`disk = false` keeps it in memory only; `max_read_s` bounds a disk read. `normalize` (agent-safe keys, "
        "off by default) names rules among `iso_timestamps`, `clock_times`, `uuids`, `request_ids`: text they "
        "match is ignored when telling which conversation a request continues, so a later turn replaces the "
        "earlier one's entry; the model always sees the real text and reuse stops at the first real difference. "
        "A turn that continues a conversation (its prompt holds the earlier turn's, or the same aligned with a few "
        "values changed and the earlier answer after it) replaces that conversation's entry in memory and on "
        "disk, with or without `normalize`. `approximate = true` (off by default, as it is approximate) keeps, in a later turn of "
        "the same conversation, the cached KV past a changed "
        "span of the same length (a clock, an id) and recomputes only the changed tokens and a few after each: "
        "the model then sees KV computed from the old text after the change, so answers can differ from a cold "
        "run's; docs/BENCHMARKS.md measures how often."),
    "engine.images": (
        "Images in requests to vision models (engine/images.py). `image_url` parts may be data URLs "
        "(`data:image/png;base64,...`) or, only under the folders in `local_dirs`, `file:///` URLs; the engine "
        "never fetches http(s) URLs (such a request goes on to Ollama). Limits are per image, except "
        "`max_per_request`."),
    "engine.ranks": (
        "A rank group (engine/ranks.py): the engine's model sharded over several processes with mlx-lm's tensor "
        "parallelism, started together by `mlx.launch` (the supervisor runs it as the engine; one rank dying "
        "restarts the group). Rank 0 is this Mac and serves HTTP. `hosts` are IPs (the ring backend needs them); "
        "remote ranks are started over ssh with the same Python path and the same mlxd config. "
        "docs/SCALE-OUT.md explains it."),
    "supervisor": "Crash-aware supervision (supervisor/policy.py): backoff, crash loops, hangs.",
    "gateway": "The LiteLLM gateway (gateway/): aliases, keys, the Ollama fallback.",
}


def reference_markdown() -> str:
    """docs/CONFIG.md: every setting with its type and default, from the
    pydantic models themselves (a test keeps the file current)."""
    lines = ["# mlxd configuration reference", "",
             "Generated by `mlxd config reference` from core/config.py; do not edit.",
             "The file is `$MLXD_HOME/mlxd.toml` (`MLXD_CONFIG` overrides the path). Environment overrides:",
             "`MLXD_HOME`, `MLXD_CONFIG`, `MLXD_ENGINE_HOST`, `MLXD_ENGINE_PORT`, `MLXD_GATEWAY_HOST`,",
             "`MLXD_GATEWAY_PORT`, `MLXD_OLLAMA_URL`.", ""]
    for section, model in (("engine", EngineConfig), ("engine.prompt_cache", PromptCacheConfig),
                           ("engine.images", ImagesConfig), ("engine.ranks", RanksConfig),
                           ("supervisor", SupervisorConfig), ("gateway", GatewayConfig)):
        lines += [f"## [{section}]", "", SECTION_DOCS[section], "", "| key | type | default |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            if isinstance(field.default, BaseModel):
                continue  # a section of its own
            default = field.default_factory() if field.default_factory else field.default
            ann = getattr(field.annotation, "__name__", str(field.annotation)).replace("typing.", "")
            if get_origin(field.annotation) is Literal:
                ann = " | ".join(repr(a) for a in get_args(field.annotation))
            ann = ann.replace("|", "\\|")
            lines.append(f"| `{name}` | {ann} | `{default!r}` |")
        lines.append("")
    lines += ["## [models.ID]", "", "One MLX model; exactly one of `path`, `repo`, `gguf`, `from_ollama`, `demo`.",
              "`from_ollama` finds that model's GGUF in Ollama's store (`$OLLAMA_MODELS`, default",
              "`~/.ollama/models`) and makes the same name its Ollama fallback. A GGUF is",
              "converted once into `$MLXD_HOME/models/gguf/` (tensors kept as they are: F32, F16, BF16, Q4_0,",
              "Q4_1, Q8_0; other types, architectures other than llama/qwen2/qwen3 and non-BPE tokenizers",
              "are refused with `400 model_unsupported`).", "",
              "| key | type | default |", "|---|---|---|"]
    for name, field in ModelSpec.model_fields.items():
        ann = str(field.annotation).replace("typing.", "")
        default = field.default_factory() if field.default_factory else field.default
        lines.append(f"| `{name}` | {ann} | `{default!r}` |")
    lines += ["", "`hosts` lists the engines that serve the model: `\"local\"` (this machine's engine) and",
              "`\"host:port\"` (or `\"https://host:port\"` behind a TLS reverse proxy) of other Macs running mlxd",
              "with the same model id and `engine.require_key = true`, holding this machine's `engine.key`.",
              "With several, LiteLLM's router spreads requests across them at random, sends a busy or",
              "failed host's request to another host and leaves a failed host out for `gateway.host_cooldown_s`;",
              "Ollama answers only when every host is out. docs/SCALE-OUT.md explains the set-up."]
    lines += ["", "## [aliases]", "", "`alias = \"model id\"`. `fast`, `default`, `coding` and `reasoning` always exist;",
              "unset ones point at the first model under [models] (the default model, SmolLM2-135M-Instruct or",
              "the built-in demo model, when there is none).", ""]
    return "\n".join(lines)
