"""The launchd LaunchAgent, rendered from mlxd's config (pure).

launchd runs `mlxd up` in the foreground; supervisord is its child, and its
exit status is ours. So KeepAlive restarts mlxd after a crash or a failed
exit, but not after a clean `mlxd down` (supervisord, then `mlxd up`, exit 0).
"""

from __future__ import annotations

import plistlib
from collections.abc import Mapping

from mlxd.config import Config
from mlxd.supervisor.supervisord_conf import stop_timeout_s

from .common import check_argv, service_env

LABEL = "dev.mlxd.agent"
THROTTLE_S = 10  # at least this long between two starts (launchd's own default)
# supervisord writes its own rotated logs (logs/supervisord.log, engine.log,
# ...). launchd's output files are never rotated, so they get only what
# happens before supervisord's logging is up: a traceback of `mlxd up`, a
# config error, supervisord's startup failure, the progress lines of each
# start. Those all go to stderr; stdout would only echo supervisord's
# activity log (nodaemon echoes it), so it goes to /dev/null.
LAUNCHD_LOG = "launchd.err"


def render_launch_agent(config: Config, mlxd_argv: list[str], path_env: str,
                        extra_env: Mapping[str, str] | None = None) -> dict:
    """The LaunchAgent as a dict. mlxd_argv runs `mlxd` without a subcommand
    (e.g. [abs python, "-m", "mlxd.cli"]); path_env is the service's PATH;
    extra_env only the documented config overrides (common.PASSTHROUGH_ENV)."""
    argv = check_argv(mlxd_argv)
    env = service_env(config, path_env, extra_env)
    return {
        "Label": LABEL,
        "ProgramArguments": [*argv, "up"],
        "RunAtLoad": True,
        # Restart after a non-zero exit or a crash; a clean `mlxd down` stays down.
        "KeepAlive": {"SuccessfulExit": False, "Crashed": True},
        "ThrottleInterval": THROTTLE_S,
        # Not "Background": launchd would throttle its CPU and I/O (and the GPU work).
        "ProcessType": "Interactive",
        # launchd's SIGKILL must come after supervisord's own stop timeouts.
        "ExitTimeOut": stop_timeout_s(config),
        "EnvironmentVariables": env,
        "WorkingDirectory": str(config.home),
        "StandardOutPath": "/dev/null",
        "StandardErrorPath": str(config.paths.logs / LAUNCHD_LOG),
    }


def plist_bytes(d: dict) -> bytes:
    return plistlib.dumps(d, fmt=plistlib.FMT_XML, sort_keys=True)
