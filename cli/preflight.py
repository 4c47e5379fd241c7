"""Checks `mlxd up` makes before starting anything, so that a mistake is one
clear line with its fix instead of a crash loop or a long wait.

Each check returns problems as (what is wrong, how to fix it); an empty
list means go. They read the machine (sockets, files) but change nothing.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from mlxd import gguf
from mlxd.config import Config
from mlxd.models import gguf_file
from mlxd.ollama_store import OllamaModelNotFound


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"mlxd: {self.what}\n  Fix: {self.fix}"


def _port_holder(port: int) -> str:
    """'pid N (command)' of the process listening on `port`, when we may see it."""
    import psutil

    try:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    cmd = " ".join(psutil.Process(c.pid).cmdline())[:80]
                except psutil.Error:
                    cmd = "?"
                return f"pid {c.pid} ({cmd})"
    except (psutil.Error, OSError):
        pass
    return "another program"


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def port_problems(config: Config) -> list[Problem]:
    wanted = [("engine", config.engine.host, config.engine.port, "[engine] port", "MLXD_ENGINE_PORT")]
    if config.gateway.enabled:
        wanted.append(("gateway", config.gateway.host, config.gateway.port, "[gateway] port", "MLXD_GATEWAY_PORT"))
    problems = []
    for name, host, port, setting, env in wanted:
        try:
            free = port_free(host, port)
        except OSError as exc:  # e.g. an address this machine does not have
            problems.append(Problem(f"the {name} cannot bind {host}:{port}: {exc.strerror}",
                                    f"set {name}.host in mlxd.toml to an address of this machine"))
            continue
        if not free:
            problems.append(Problem(f"port {port} (the {name}'s) is already in use by {_port_holder(port)}",
                                    f"stop that program, or choose another port: {setting} in mlxd.toml "
                                    f"(or {env}=...)"))
    return problems


def _gguf_problems(model_id: str, path: Path) -> list[Problem]:
    if not path.is_file():
        return [Problem(f"models.{model_id}.gguf: {path} does not exist",
                        f"point [models.{model_id}] gguf at a .gguf file")]
    try:
        problem = gguf.unsupported(gguf.read_header(path))
    except gguf.GGUFError as exc:
        problem = str(exc)
    if problem is None:
        return []
    return [Problem(f"models.{model_id}.gguf: {problem}",
                    f"use another GGUF of this model, or remove [models.{model_id}] (Ollama can still serve it)")]


@dataclass(frozen=True)
class FolderFacts:
    """What a configured model folder holds, as far as serving it goes."""

    is_dir: bool
    has_config: bool  # config.json
    has_weights: bool  # *.safetensors, as mlx-lm and mlx-vlm load them


def read_folder_facts(folder: Path) -> FolderFacts:
    is_dir = folder.is_dir()
    return FolderFacts(is_dir, is_dir and (folder / "config.json").is_file(),
                       is_dir and any(folder.glob("*.safetensors")))


def folder_problem(model_id: str, folder: Path, facts: FolderFacts, too_large: bool) -> Problem | None:
    """What keeps a model folder from being served, or None (pure). A model
    too large for this machine's memory is never loaded here (its aliases go
    to Ollama), so it needs its config.json, for that estimate, but no weights."""
    setting = f"models.{model_id}.path"
    if not facts.is_dir:
        return Problem(f"{setting}: {folder} does not exist",
                       f"point [models.{model_id}] path at an MLX model folder (config.json and *.safetensors), "
                       f"or use repo = \"org/name\" for a Hugging Face model")
    if not facts.has_config:
        return Problem(f"{setting}: {folder} has no config.json, so it is not a model folder",
                       f"point [models.{model_id}] path at the folder that holds config.json and the "
                       f"*.safetensors weights")
    if not facts.has_weights and not too_large:
        return Problem(f"{setting}: {folder} has config.json but no *.safetensors weights",
                       f"finish the download or conversion into that folder (e.g. `mlx_lm.convert`), or point "
                       f"[models.{model_id}] path at the folder that holds the weights")
    return None


def _too_large_to_load(config: Config, model_id: str) -> bool:
    """Whether the engine refuses this model as too large even for all of
    physical memory ($MLXD_MEMORY_TOTAL_BYTES where set): an upper bound of
    the engine's own budget (Metal's working set is smaller), read without
    importing MLX, so no model the engine could load is excused."""
    from mlxd.models import model_info, system_memory_budget

    budget, _ = system_memory_budget(config.engine.memory_fraction, device_total=lambda: None)
    return not model_info(config, model_id, budget).verdict.allowed


def problems_of_model(config: Config, model_id: str) -> list[Problem]:
    """What keeps one configured model from being served from its files:
    a missing or unservable GGUF, a model folder without what mlx-lm needs.
    `mlxd up`, `mlxd config validate` and `mlxd doctor` all ask this."""
    spec = config.models[model_id]
    if spec.gguf is not None or spec.from_ollama is not None:
        try:
            return _gguf_problems(model_id, gguf_file(spec))  # type: ignore[arg-type]
        except OllamaModelNotFound as exc:
            return [Problem(f"models.{model_id}.from_ollama: {exc}",
                            "pull it with Ollama, or set OLLAMA_MODELS to where Ollama keeps models")]
    if spec.path is None:
        return []
    folder = Path(spec.path).expanduser()
    facts = read_folder_facts(folder)
    too_large = facts.has_config and not facts.has_weights and _too_large_to_load(config, model_id)
    problem = folder_problem(model_id, folder, facts, too_large)
    return [problem] if problem else []


def model_problems(config: Config) -> list[Problem]:
    """Every configured model whose local folder or GGUF file is missing or
    cannot be served."""
    return [p for model_id in config.models for p in problems_of_model(config, model_id)]
