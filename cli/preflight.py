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


def model_problems(config: Config) -> list[Problem]:
    """Models whose local folder or GGUF file is missing or cannot be served."""
    problems = []
    for model_id, spec in config.models.items():
        if spec.gguf is not None or spec.from_ollama is not None:
            try:
                problems += _gguf_problems(model_id, gguf_file(spec))  # type: ignore[arg-type]
            except OllamaModelNotFound as exc:
                problems.append(Problem(f"models.{model_id}.from_ollama: {exc}",
                                        "pull it with Ollama, or set OLLAMA_MODELS to where Ollama keeps models"))
        if spec.path is None:
            continue
        folder = Path(spec.path).expanduser()
        if not folder.is_dir():
            problems.append(Problem(f"models.{model_id}.path: {folder} does not exist",
                                    f"point [models.{model_id}] path at an MLX model folder (config.json and "
                                    f"*.safetensors), or use repo = \"org/name\" for a Hugging Face model"))
        elif not (folder / "config.json").is_file():
            problems.append(Problem(f"models.{model_id}.path: {folder} has no config.json, so it is not a model "
                                    f"folder", f"point [models.{model_id}] path at the folder that holds "
                                    f"config.json and the *.safetensors weights"))
    return problems
