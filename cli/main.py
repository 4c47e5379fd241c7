"""The `mlxd` command line: argument parsing and dispatch.

  mlxd engine               the engine alone, in the foreground
  mlxd up [--detach]        supervisord with the engine and the crash listener
  mlxd down                 stop everything
  mlxd restart [engine|all] an operator's restart (clears a crash loop)
  mlxd status [--json]      what runs, health, crashes; exit 0 healthy, 1 degraded, 2 down
  mlxd models [--json]      the configured models: on disk, size, fits or heavy, loaded, aliases
  mlxd pull NAME, mlxd rm NAME   a Hugging Face repo into the hub cache (if it fits) / out of it
  mlxd logs [component] [-f], mlxd doctor, mlxd config [show|path|validate|reference],
  mlxd key [show|rotate|path], mlxd launchd|systemd install|uninstall|status

status, down, logs and restart use what `up` was started with (its config
file and MLXD_* variables, remembered in $MLXD_HOME/run/started_with.json)
unless --config or an MLXD_* variable is given now (see started_with.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

from mlxd import __version__, exit_codes
from mlxd.config import CONFIG_ENV, ConfigError, config_path, default_home, env_help, load_config
from mlxd.paths import StatePaths

from . import started_with


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 64 (sysexits' EX_USAGE), as the
    commands' own usage errors do, not 2 (`mlxd status`'s "down")."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    remembered = ", ".join(CONFIG_ENV[:-1]) + " or " + CONFIG_ENV[-1]
    p = Parser(
        prog="mlxd", description="Dependable local MLX serving (OpenAI API).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.fill("status, down, logs and restart reach the stack `mlxd up` started in this home: its "
                             "config file, ports and hosts are remembered in $MLXD_HOME/run/started_with.json. "
                             f"--config or an {remembered} variable given now wins.", 79)
        + "\n\nEnvironment overrides (they win over mlxd.toml; every setting: `mlxd config reference`):\n"
        + env_help())
    p.add_argument("--version", action="version", version=f"mlxd {__version__}")
    p.add_argument("--home", type=Path, help="state directory (default $MLXD_HOME or ~/.mlxd)")
    p.add_argument("--config", type=Path, help="config file (default $MLXD_HOME/mlxd.toml)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    eng = sub.add_parser("engine", help="run the MLX engine alone in the foreground",
                         description="Run the MLX engine in the foreground on the configured port. "
                                     "With no model configured it serves the built-in demo model.")
    eng.add_argument("--host", help="bind address (default 127.0.0.1)")
    eng.add_argument("--port", type=int, help="port (default 8080)")
    eng.add_argument("--model", help="model id or alias to preload (default: the 'default' alias)")

    gw = sub.add_parser("gateway", help="run the LiteLLM gateway alone in the foreground")
    gw.add_argument("--host", help="bind address (default 127.0.0.1)")
    gw.add_argument("--port", type=int, help="port (default 4000)")

    up = sub.add_parser("up", help="run mlxd under supervisord (foreground unless --detach)")
    up.add_argument("--detach", action="store_true", help="start in the background and return once ready")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready with --detach")
    sub.add_parser("down", help="stop supervisord, the engine and the listener")
    rs = sub.add_parser("restart", help="restart the engine (clears a crash loop) or everything")
    rs.add_argument("what", choices=["engine", "all"], nargs="?", default="engine")
    st = sub.add_parser("status", help="show what runs and how it is doing",
                        description="What runs and how it is doing, on the ports `mlxd up` started with "
                                    "(an MLXD_* variable set now wins). Exit 0 healthy, 1 degraded, 2 down.")
    st.add_argument("--json", action="store_true", help="machine-readable output")

    key = sub.add_parser("key", help="show or rotate the gateway key (or renew the engine's)",
                         description="show: the gateway key clients send; path: its file; rotate: a new one (the "
                                     "old one stops working at once). `rotate engine` renews the engine's internal "
                                     "key (the gateway restarts to take it); `path engine`: that key's file.")
    key.add_argument("action", choices=["show", "rotate", "path"], nargs="?", default="show")
    key.add_argument("which", choices=["gateway", "engine"], nargs="?", default="gateway")

    for name, what in (("launchd", "a launchd LaunchAgent (macOS)"), ("systemd", "a systemd user unit (Linux)")):
        sv = sub.add_parser(name, help=f"install, uninstall or show {what} that runs mlxd at login")
        sv.add_argument("action", choices=["install", "uninstall", "status"])
        sv.set_defaults(platform=name)

    lg = sub.add_parser("logs", help="show (and follow) a component's logs")
    lg.add_argument("component", choices=["engine", "gateway", "listener", "standby", "supervisord", "all"], nargs="?",
                    default="all")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.add_argument("-n", "--lines", type=int, default=40, help="lines of history (default 40)")
    pl = sub.add_parser("pull", help="download a Hugging Face repo (a configured model's, or org/name), if it fits")
    pl.add_argument("name", help="a configured model id or alias, or a repo id (org/name)")
    rmp = sub.add_parser("rm", help="remove a repo's files from the Hugging Face cache")
    rmp.add_argument("name", help="a configured model id or alias, or a repo id (org/name)")
    mo = sub.add_parser("models", help="the configured models: on disk, size, fits or heavy, loaded, aliases")
    mo.add_argument("--json", action="store_true", help="for machines")
    dr = sub.add_parser("doctor", help="check this machine and the config; say what to fix")
    dr.add_argument("--json", action="store_true")

    cfg = sub.add_parser("config", help="show the effective config, or its path",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="show: the effective config (file, defaults and environment overrides) as "
                                     "JSON;\npath: the config file; validate: check it and its models;\n"
                                     "reference: every setting, its default and what it does (docs/CONFIG.md).",
                         epilog="Environment overrides (they win over the file):\n" + env_help())
    cfg.add_argument("action", choices=["show", "path", "validate", "reference"], nargs="?", default="show")
    return p


def _reach_the_stack_up_started(args: argparse.Namespace, home: Path) -> None:
    """Run with what `mlxd up` started with (remembered in $MLXD_HOME), where
    a variable set now does not say otherwise; `restart all` starts again
    with `start_overrides`."""
    record = started_with.read(StatePaths(home))
    now = started_with.given_overrides(os.environ)
    args.start_overrides = started_with.overrides_for(now, record, "start")
    started_with.use_overrides(started_with.overrides_for(now, record, "reach"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    home = (args.home or default_home()).expanduser()
    if args.home:
        os.environ["MLXD_HOME"] = str(home)
    if args.config:  # as MLXD_CONFIG: supervisord's children read the same file, and `up` remembers it
        os.environ["MLXD_CONFIG"] = str(args.config.expanduser().absolute())
    if args.command in started_with.STACK_COMMANDS:
        _reach_the_stack_up_started(args, home)
    path = config_path(home)
    if args.command == "config" and args.action in ("path", "reference"):
        from mlxd.config import reference_markdown

        print(path if args.action == "path" else reference_markdown())
        return exit_codes.OK
    try:
        config = load_config(path, home)
    except ConfigError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return exit_codes.CONFIG
    if args.command == "config":
        if args.action == "show":
            print(config.model_dump_json(indent=2))
            return exit_codes.OK
        from .preflight import model_problems

        problems = model_problems(config)
        print("\n".join(map(str, problems)) if problems else f"{path}: valid",
              file=sys.stderr if problems else sys.stdout)
        return exit_codes.CONFIG if problems else exit_codes.OK
    if args.command == "models":
        from . import models

        return models.main(config, args.json)
    if args.command in ("pull", "rm"):
        from . import pull

        return pull.pull(config, args.name) if args.command == "pull" else pull.rm(config, args.name)
    if args.command == "engine":
        engine_overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                               ("default_model", args.model)) if v is not None}
        if engine_overrides:
            config = config.model_copy(update={"engine": config.engine.model_copy(update=engine_overrides)})
        if config.resolve(config.engine.default_model) is None:
            print(f"mlxd: unknown model {config.engine.default_model!r}", file=sys.stderr)
            return exit_codes.USAGE
        from mlxd.engine.main import run_engine

        return run_engine(config)
    if args.command in ("launchd", "systemd"):
        from mlxd.launchd.service import run_command as run_service

        return run_service(args, config)
    if args.command == "logs":
        from .logs import run_logs

        return run_logs(config.paths, args.component, args.follow, args.lines)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(config, args.json, path)
    if args.command == "key":
        from mlxd.gateway.keys import ensure_key, rotate_key

        paths = config.paths
        paths.home.mkdir(parents=True, exist_ok=True)
        if args.action == "path":
            print(paths.engine_key if args.which == "engine" else paths.key)
        elif args.action == "rotate" and args.which == "engine":
            from .operate import cmd_rotate_engine_key

            return cmd_rotate_engine_key(config)
        elif args.action == "rotate":
            rotate_key(paths)  # the gateway re-reads the file: no restart needed
            print(f"new key written to {paths.key} (the old one no longer works)")
        elif args.which == "engine":
            print(f"the engine's key is internal: its file is {paths.engine_key} (`mlxd key path engine`)",
                  file=sys.stderr)
            return exit_codes.USAGE
        else:
            print(ensure_key(paths))
        return exit_codes.OK
    if args.command == "gateway":
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if overrides:
            config = config.model_copy(update={"gateway": config.gateway.model_copy(update=overrides)})
        from mlxd.gateway.main import run_gateway

        return run_gateway(config)
    from . import operate

    return operate.run_command(args, config)


if __name__ == "__main__":
    sys.exit(main())
