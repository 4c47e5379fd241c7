"""`mlxd doctor`: is this machine ready to run mlxd? Each check says pass,
warn or fail, with a fix hint. Nothing is changed."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from mlxd import exit_codes
from mlxd.config import Config, config_path
from mlxd.paths import StatePaths
from mlxd.probe import get_json

from .preflight import Problem, problems_of_model

PACKAGES = ("mlx", "mlx-lm", "mlx-vlm", "litellm", "supervisor", "fastapi", "uvicorn")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass / warn / fail
    detail: str
    fix: str = ""


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check("python", "pass" if ok else "fail", f"{platform.python_version()} at {sys.executable}",
                 "" if ok else "install Python 3.11 or newer")


def check_packages() -> Check:
    found, missing = [], []
    for p in PACKAGES:
        try:
            found.append(f"{p} {metadata.version(p)}")
        except metadata.PackageNotFoundError:
            missing.append(p)
    if missing:
        return Check("packages", "fail", "missing: " + ", ".join(missing), "run ./scripts/setup.sh")
    return Check("packages", "pass", ", ".join(found))


def check_backend(config: Config) -> Check:
    try:
        import mlx.core as mx

        from mlxd.models import system_memory_budget

        backend = "Metal" if mx.metal.is_available() else ("CUDA" if getattr(mx, "cuda", None)
                                                              and mx.cuda.is_available() else "CPU")
        budget, source = system_memory_budget(config.engine.memory_fraction)
    except Exception as exc:  # noqa: BLE001 - a broken mlx install is what we report
        return Check("mlx backend", "fail", f"mlx does not load: {exc}", "reinstall: ./scripts/setup.sh")
    status = "pass" if backend == "Metal" or sys.platform != "darwin" else "warn"
    return Check("mlx backend", status, f"{backend}; model memory budget {budget / 2**30:.1f} GiB "
                 f"({config.engine.memory_fraction:.0%} of {source})",
                 "" if status == "pass" else "on a Mac, MLX should use Metal: check `pip show mlx-metal`")


def blas_check(platform_name: str, choice: dict | None, error: str = "") -> Check | None:
    """The CPU's BLAS line (pure): only on Linux, where MLX's CPU wheel
    brings the slow reference BLAS (engine/cpu/fast_blas.py)."""
    if not platform_name.startswith("linux"):
        return None
    if choice is None:
        return Check("cpu blas", "warn", f"cannot tell which BLAS MLX uses: {error}", "run ./scripts/setup.sh")
    if choice.get("fast"):
        return Check("cpu blas", "pass", choice.get("why", ""))
    return Check("cpu blas", "warn", "MLX's CPU backend would use its reference BLAS: prompts ~15x slower",
                 fix_of_blas(choice.get("why", "")))


def fix_of_blas(why: str) -> str:
    return why.partition("fix: ")[2] or why


def check_cpu_blas() -> Check | None:
    """Which BLAS the engine will put under MLX: asked of a fresh Python, as
    the engine's own start does (this process may have imported MLX)."""
    if not sys.platform.startswith("linux"):
        return None
    import subprocess

    code = ("import json; from dataclasses import asdict; from mlxd.engine.cpu.fast_blas import activate; "
            "print(json.dumps(asdict(activate())))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return blas_check(sys.platform, json.loads(out.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return blas_check(sys.platform, None, str(exc))


def _port_state(host: str, port: int) -> str:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return "free"
        except OSError:
            return "in use"


def check_ports(config: Config, running: bool) -> list[Check]:
    out = []
    for name, host, port in (("engine port", config.engine.host, config.engine.port),
                             ("gateway port", config.gateway.host, config.gateway.port)):
        state = _port_state(host, port)
        if state == "free" or running:
            out.append(Check(name, "pass", f"{host}:{port} {state}{' (mlxd is running)' if running else ''}"))
        else:
            out.append(Check(name, "fail", f"{host}:{port} is taken by another program",
                             f"free it, or set a different port in {config.home / 'mlxd.toml'}"))
    return out


def check_key(paths: StatePaths) -> Check:
    if not paths.key.exists():
        return Check("gateway key", "warn", f"{paths.key} not created yet", "it is created by `mlxd up` or `mlxd key`")
    mode = os.stat(paths.key).st_mode & 0o777
    if mode & 0o077:
        return Check("gateway key", "fail", f"{paths.key} has mode {mode:o}", f"chmod 600 {paths.key}")
    return Check("gateway key", "pass", f"{paths.key} (mode 600)")


def check_ollama(config: Config) -> Check:
    url = config.gateway.ollama_url.rstrip("/") + "/api/version"
    status, body = get_json(url, timeout=2)
    if status == 200:
        version = body.get("version", "?") if isinstance(body, dict) else "?"
        return Check("ollama", "pass", f"Ollama {version} at {config.gateway.ollama_url}")
    return Check("ollama", "warn", f"no answer at {config.gateway.ollama_url}: no fallback while the engine is down",
                 "install and start Ollama (https://ollama.com), then `ollama pull "
                 f"{config.gateway.default_ollama_model or 'llama3.2:3b'}`")


def files_check(model_id: str, problems: list[Problem], config_file: Path) -> Check | None:
    """A model's failed check where its files are missing or unservable
    (the problems `mlxd config validate` reports), naming the file to edit;
    None when there are none (pure)."""
    if not problems:
        return None
    return Check(f"model {model_id}", "fail", "; ".join(p.what for p in problems),
                 f"edit {config_file}: " + "; ".join(p.fix for p in problems)
                 + f" -- or remove [models.{model_id}] (and its aliases); then `mlxd config validate`")


def check_models(config: Config, config_file: Path, problems: dict[str, list[Problem]]) -> list[Check]:
    try:
        from mlxd.models import model_info, system_memory_budget

        budget = system_memory_budget(config.engine.memory_fraction)[0]
    except Exception as exc:  # noqa: BLE001
        return [Check("models", "fail", f"cannot estimate: {exc}")]
    out = []
    for model_id in config.models:
        failed = files_check(model_id, problems[model_id], config_file)
        if failed is not None:
            out.append(failed)
            continue
        info = model_info(config, model_id, budget)
        where = info.spec.repo or info.spec.path or info.spec.gguf or f"built-in demo {info.spec.demo}"
        if info.verdict.allowed:
            out.append(Check(f"model {model_id}", "pass", f"{where}: {info.verdict.reason}"))
        else:
            out.append(Check(f"model {model_id}", "warn", f"{where}: {info.verdict.reason}",
                             "served by Ollama only; pick a smaller or more quantized MLX model for the engine"))
    return out


def check_default_model() -> Check:
    from mlxd import default_model

    path = default_model.gguf_path()
    if path.is_file():
        return Check("default model", "pass", f"{default_model.MODEL_NAME} ({path})")
    return Check("default model", "warn", default_model.missing_hint(),
                 "./scripts/setup.sh (with the package registry reachable)")


def check_config(config_file: Path, problems: dict[str, list[Problem]]) -> Check:
    """The verdict of `mlxd config validate` (the models' lines say which and how to fix them) (pure)."""
    broken = [model_id for model_id, found in problems.items() if found]
    if broken:
        return Check("config", "fail", f"{config_file}: model(s) {', '.join(broken)} cannot be served from "
                     f"their files (below)", f"edit {config_file}, then `mlxd config validate`")
    return Check("config", "pass", f"{config_file} is valid")


def run_checks(config: Config, config_file: Path | None = None) -> list[Check]:
    from mlxd.supervisor.control import supervisord_pid

    config_file = config_file or config_path(config.home)
    paths = config.paths
    running = supervisord_pid(paths) is not None
    problems = {model_id: problems_of_model(config, model_id) for model_id in config.models}
    blas = check_cpu_blas()
    checks = [check_python(), check_packages(), check_backend(config), *([blas] if blas else []),
              *check_ports(config, running),
              check_key(paths), check_config(config_file, problems),
              check_ollama(config), check_default_model(), *check_models(config, config_file, problems)]
    try:
        from mlxd.launchd.service import status_summary

        s = status_summary(config)
        checks.append(Check(s.get("kind", "autostart"), "pass" if s.get("installed") else "warn",
                            s.get("detail", ""), "" if s.get("installed") else
                            f"`mlxd {s.get('kind', 'launchd')} install` to start mlxd at login"))
    except Exception:  # noqa: BLE001 - autostart is optional
        pass
    return checks


def run_doctor(config: Config, as_json: bool, config_file: Path | None = None) -> int:
    checks = run_checks(config, config_file)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"{c.status.upper():4}  {c.name:<16} {c.detail}")
            if c.fix:
                print(f"{'':6}{'':<16} fix: {c.fix}")
    return exit_codes.UNAVAILABLE if any(c.status == "fail" for c in checks) else exit_codes.OK
