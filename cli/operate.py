"""The stack commands of `mlxd`: up, down, restart, status (thin shells over
mlxd.supervisor's control and status). Waiting for a started stack is
cli/readiness.py's; the status table, cli/status_format.py's."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from mlxd import default_model, exit_codes
from mlxd.config import DEMO_MODEL_ID, Config, ConfigError, config_path, load_config
from mlxd.supervisor import control
from mlxd.supervisor.status import collect_status

from . import preflight, started_with
from .readiness import wait_ready
from .status_format import format_status

STATUS_EXIT = {"healthy": 0, "degraded": 1, "down": 2}


def with_default_model(config: Config) -> Config:
    """With no model configured, the real default model: fetched now, with
    its progress, where set-up did not (mlxd installed with pip alone), and
    the config read again to serve it. Where it cannot be had, the fetch says
    why in one line and `_first_run` that the demo model answers instead."""
    if list(config.models) != [DEMO_MODEL_ID] or default_model.gguf_path().is_file():
        return config
    print(f"mlxd: no model is configured: fetching the default model, {default_model.MODEL_NAME}", file=sys.stderr)
    if default_model.fetch(lambda line: print(f"mlxd:   {line}", file=sys.stderr, flush=True)) is None:
        return config
    return load_config(home=config.home)


def cmd_up(args: argparse.Namespace, config: Config) -> int:
    paths = config.paths
    pid = control.supervisord_pid(paths)
    if pid is not None:
        print(f"mlxd is already running (supervisord pid {pid}); see `mlxd status`")
        return exit_codes.OK
    config = with_default_model(config)
    for note in control.clean_stale(paths):
        print(f"mlxd: {note}", file=sys.stderr)
    for problems, code in ((preflight.model_problems(config), exit_codes.CONFIG),
                           (preflight.port_problems(config), exit_codes.STARTUP_FAILED)):
        if problems:
            print("\n".join(map(str, problems)), file=sys.stderr)
            return code
    _first_run(config)
    from .pull import pull_missing

    pull_missing(config)  # a configured repo not on disk yet: now, with its progress, not at its first request
    started_with.remember(config, config_path(config.home), paths)
    if not args.detach:
        return _run_foreground(config, args.timeout)
    pid = control.start_detached(config)
    print(f"supervisord started (pid {pid}); waiting for the engine...", file=sys.stderr)
    problem = wait_ready(config, args.timeout, supervisord=pid)
    if problem is not None:
        print(f"\nmlxd: {problem}", file=sys.stderr)
        return 1
    _print_endpoint(config, detached=True)  # (no Ctrl-C stops a detached stack)
    return exit_codes.OK


def _first_run(config: Config) -> None:
    """A default config with a hint, and the key, on the very first `up`."""
    from mlxd.config import config_path, write_default_config
    from mlxd.gateway.keys import ensure_key

    path = config_path(config.home)
    if write_default_config(path):
        serving = (default_model.MODEL_NAME if default_model.MODEL_ID in config.models
                   else "the built-in demo model (random weights)")
        print(f"mlxd: wrote a default config to {path}: every alias serves {serving}.\n"
              f"      For another model add e.g. [models.qwen] repo = \"mlx-community/Qwen3-4B-Instruct-2507-4bit\" "
              f"there (see the comments in it).", file=sys.stderr)
    if list(config.models) == [DEMO_MODEL_ID]:
        print(f"mlxd: warning: {default_model.missing_hint()}", file=sys.stderr)
    if config.gateway.enabled:
        ensure_key(config.paths)


def _print_endpoint(config: Config, detached: bool = False) -> None:
    if config.gateway.enabled:
        base = config.gateway_url + "/v1"
        key_file = config.paths.key
        auth = f"-H \"Authorization: Bearer $(cat {key_file})\" "
        where = f"mlxd is serving: {base}   (key in {key_file})"
    else:
        base = f"{config.engine_url}/v1"
        auth = f"-H \"Authorization: Bearer $(cat {config.paths.engine_key})\" "
        where = f"mlxd is serving (engine only): {base}   (key in {config.paths.engine_key})"
    print(f"{where}\n"
          f"  curl -s {base}/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"default\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n"
          f"  status: mlxd status    stop: {'mlxd down' if detached else 'Ctrl-C (or mlxd down)'}",
          flush=True)  # a log or pipe sees it now, not at exit


def _run_foreground(config: Config, timeout: float) -> int:
    """supervisord as our child: progress and the endpoint are printed, its
    exit status is ours (launchd's KeepAlive reads it), signals are passed on."""
    import signal
    import subprocess

    conf = control.prepare(config)
    proc = subprocess.Popen(control.supervisord_argv(conf))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: proc.send_signal(signum))
    print(f"supervisord started (pid {proc.pid}); waiting for the engine...", file=sys.stderr)
    problem = wait_ready(config, timeout, alive=lambda: proc.poll() is None, supervisord=proc.pid)
    if problem is None:
        _print_endpoint(config)
    else:
        print(f"\nmlxd: {problem}", file=sys.stderr)
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:
            continue
    started_with.forget(config.paths, writer_pid=os.getpid())  # as `mlxd down` does: nothing runs now
    return code


def cmd_down(config: Config) -> int:
    from mlxd.supervisor.supervisord_conf import stop_timeout_s

    stopped = control.shutdown(config.paths, timeout=stop_timeout_s(config))
    started_with.forget(config.paths)  # so that `status` and the next `up` no longer read the stopped stack's
    print("mlxd stopped" if stopped else "mlxd was not running")
    return exit_codes.OK


def cmd_restart(args: argparse.Namespace, config: Config) -> int:
    paths = config.paths
    if control.supervisord_pid(paths) is None:
        print("mlxd is not running; start it with `mlxd up`", file=sys.stderr)
        return 2
    if args.what == "engine":
        control.restart_engine(paths)
        print("engine restarted", file=sys.stderr)
        problem = wait_ready(config, 300, supervisord=control.supervisord_pid(paths))
        if problem is not None:
            print(f"mlxd: {problem}", file=sys.stderr)
        return exit_codes.OK if problem is None else 1
    from mlxd.supervisor.supervisord_conf import stop_timeout_s

    control.shutdown(paths, timeout=stop_timeout_s(config))
    # Start again as `up` was started (its MLXD_* variables, unless set now), from mlxd.toml as it is now.
    started_with.use_overrides(getattr(args, "start_overrides", started_with.given_overrides(os.environ)))
    try:
        config = load_config(config_path(config.home), config.home)
    except ConfigError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return exit_codes.CONFIG
    return cmd_up(argparse.Namespace(detach=True, timeout=300.0), config)


def cmd_rotate_engine_key(config: Config) -> int:
    """`mlxd key rotate engine`: a new engine key. The engine and the gateway's
    own clients read the file again at their next request; LiteLLM's
    deployments hold the key they started with, so a running gateway is
    restarted to take the new one (a few seconds without the gateway)."""
    from mlxd.keyfile import ENGINE_KEY_PREFIX, rotate_key_file

    config.paths.home.mkdir(parents=True, exist_ok=True)
    rotate_key_file(config.paths.engine_key, ENGINE_KEY_PREFIX)
    print(f"new engine key written to {config.paths.engine_key} (the old one no longer works)")
    if control.supervisord_pid(config.paths) is not None and control.restart_gateway(config.paths):
        print("the gateway restarted to take it")
    if config.remote_engines:
        print(f"copy {config.paths.engine_key} to every other host of `hosts` again: they hold the old key",
              file=sys.stderr)
    return exit_codes.OK


def _autostart(config: Config) -> dict | None:
    from mlxd.launchd.service import status_summary

    try:
        return status_summary(config)
    except Exception:  # noqa: BLE001 - status never fails because of autostart
        return None


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    st = replace(collect_status(config), autostart=_autostart(config), started_with=started_with.read(config.paths))
    print(json.dumps(st.to_json(), indent=2, default=str) if args.json else format_status(st))
    return STATUS_EXIT[st.overall]


def run_command(args: argparse.Namespace, config: Config) -> int:
    if args.command == "up":
        return cmd_up(args, config)
    if args.command == "down":
        return cmd_down(config)
    if args.command == "restart":
        return cmd_restart(args, config)
    if args.command == "status":
        return cmd_status(args, config)
    return exit_codes.USAGE
