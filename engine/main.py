"""`mlxd engine`: run the engine alone in the foreground.

Startup: read the config, build the demo model(s) if configured (with
progress), measure the memory budget, then serve with uvicorn. The worker
preloads the default model; /health answers 503 "loading" until it is done.
SIGTERM/SIGINT drain (see Lifecycle.begin_drain) and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import uvicorn

from mlxd import exit_codes
from mlxd.config import Config
from mlxd.keyfile import ENGINE_KEY_PREFIX, ensure_key_file
from mlxd.models import demo_model_dir, system_memory_budget

from .faults import FaultInjector
from .lifecycle import Lifecycle
from .model_registry import ModelRegistry
from .server import Engine, create_app

log = logging.getLogger("mlxd.engine")


class EngineServer(uvicorn.Server):
    """uvicorn, with our drain started on the first SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        self.lifecycle.begin_drain()
        # uvicorn's own handler records the signal and re-raises it after
        # shutdown, so a clean drain would end as "killed by SIGTERM"; a
        # drained engine exits 0 instead.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def build_demo_models(config: Config) -> None:
    from .demo_model import build_demo_model

    for model_id, spec in config.models.items():
        if spec.demo is not None:
            build_demo_model(demo_model_dir(config, spec.demo), spec.demo,
                             progress=lambda msg, m=model_id: log.info("demo model %s: %s", m, msg))


def run_engine(config: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        faults = FaultInjector.from_environ()
    except ValueError as exc:
        log.error("%s", exc)
        return exit_codes.CONFIG
    if faults.enabled:
        log.warning("fault injection is ON (MLXD_FAULT / MLXD_FAULT_FILE)")
    config.home.mkdir(parents=True, exist_ok=True)
    build_demo_models(config)
    budget, source = system_memory_budget(config.engine.memory_fraction)
    log.info("memory budget %.1f GiB (%.0f%% of %s)", budget / 2**30, config.engine.memory_fraction * 100, source)
    engine = Engine(config, ModelRegistry(config, budget), faults)
    key = ensure_key_file(config.paths.engine_key, ENGINE_KEY_PREFIX) if config.engine.require_key else None
    uv_config = uvicorn.Config(
        create_app(engine, key),
        host=config.engine.host,
        port=config.engine.port,
        http="auto",  # HTTP/1.1 (httptools when installed, else h11); SSE streams are chunked
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(config.engine.shutdown_grace_s) + 2,
        lifespan="on",
    )
    server = EngineServer(uv_config, engine.lifecycle)
    log.info("engine listening on http://%s:%d (pid %d)", config.engine.host, config.engine.port, os.getpid())
    server.run()
    if not server.started:  # e.g. the port is taken; uvicorn said why
        return exit_codes.STARTUP_FAILED
    return exit_codes.OK
