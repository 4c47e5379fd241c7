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
import threading
import time
from typing import NoReturn

import uvicorn

from mlxd import exit_codes
from mlxd.config import Config
from mlxd.host_check import machine_names, served_names
from mlxd.keyfile import ENGINE_KEY_PREFIX, KeyFile, ensure_key_file
from mlxd.models import demo_model_dir, system_memory_budget

from .cpu.fast_blas import activate as activate_fast_blas
from .model.faults import FaultInjector
from .api.lifecycle import Lifecycle
from .model.model_registry import ModelRegistry
from .api.server import Engine, create_app

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
    from .model.demo_model import build_demo_model

    for model_id, spec in config.models.items():
        if spec.demo is not None:
            build_demo_model(demo_model_dir(config, spec.demo), spec.demo,
                             progress=lambda msg, m=model_id: log.info("demo model %s: %s", m, msg))


def rank_link(config: Config):
    """This process's RankLink when it is one rank of a rank group started by
    mlx.launch (engine/model/ranks.py); None for a one-process engine."""
    if not config.engine.ranks.enabled:
        return None
    import mlx.core as mx

    from .model.ranks import RankLink

    group = mx.distributed.init()
    if group.size() == 1:
        log.warning("engine.ranks is set but this engine was not started by mlx.launch: serving alone, unsharded")
        return None
    threading.Thread(target=_exit_with_launcher, args=(os.getppid(), "the rank group's launcher"), daemon=True).start()
    return RankLink(group)


# Set by mlxd's engine runner (supervisor/engine_runner.py) to its pid for the engine it starts: the engine
# exits with it (a runner gone before the engine looked is gone all the same).
EXIT_WITH_PARENT_ENV = "MLXD_EXIT_WITH_PARENT"


def _exit_with_launcher(parent: int, who: str) -> None:
    """An engine whose launcher is gone exits too: a rank whose launcher was
    killed for a hang, an engine whose runner was killed with supervisord
    (`mlxd down`'s last resort kills by pid, and a runner killed between its
    start and its pid file leaves nobody to stop it). No orphan keeps the
    port, the memory or the group's sockets."""
    while os.getppid() == parent:
        time.sleep(0.5)
    log.warning("%s is gone; exiting", who)
    os.kill(os.getpid(), signal.SIGKILL)


def runs_on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def runs_on_cuda() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def run_follower(config: Config, link) -> int:
    """Ranks above 0: no HTTP; load and run what rank 0 says (engine/model/ranks.py)."""
    from .model.ranks import follow, sharded

    registry = ModelRegistry(config, 0)
    log.info("rank %d of %d: following rank 0 (pid %d)", link.rank, link.size, os.getpid())
    follow(link, load=lambda model_id: sharded(registry.load_target(model_id), link)[0])
    log.info("rank %d: rank 0 stopped; exiting", link.rank)
    return exit_codes.OK


def run_engine(config: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("mlxd").setLevel(config.engine.log_level.upper())  # ours only: libraries stay at info
    runner = os.environ.pop(EXIT_WITH_PARENT_ENV, "")
    if runner.isdigit():
        threading.Thread(target=_exit_with_launcher, args=(int(runner), "the engine's runner"), daemon=True).start()
    blas = activate_fast_blas()  # before anything imports MLX
    (log.info if blas.fast else log.warning)("%s", blas.why)
    try:
        faults = FaultInjector.from_environ()
    except ValueError as exc:
        log.error("%s", exc)
        return exit_codes.CONFIG
    if faults.enabled:
        log.warning("fault injection is ON (MLXD_FAULT / MLXD_FAULT_FILE)")
    config.home.mkdir(parents=True, exist_ok=True)
    link = rank_link(config)
    if link is not None and link.rank > 0:
        return run_follower(config, link)
    build_demo_models(config)
    budget, source = system_memory_budget(config.engine.memory_fraction)
    log.info("memory budget %.1f GiB (%.0f%% of %s)", budget / 2**30, config.engine.memory_fraction * 100, source)
    if link is not None:  # every rank holds 1/N of the weights (and of the KV): N budgets, roughly
        log.info("rank 0 of a rank group of %d: the model is sharded over the group", link.size)
        budget *= link.size
    on_cpu, on_cuda = runs_on_cpu(), runs_on_cuda()
    few_shapes = config.engine.attention_shapes == "few" or (config.engine.attention_shapes == "auto" and on_cuda)
    registry = ModelRegistry(config, budget, cpu_float32=config.engine.cpu_float32 and blas.fast and on_cpu,
                             on_cpu=on_cpu, on_cuda=on_cuda, few_shapes=few_shapes)
    engine = Engine(config, registry, faults, link)
    ensure_key_file(config.paths.engine_key, ENGINE_KEY_PREFIX)  # made here on first start (0600), or the gateway's
    names = served_names(config.engine.host, config.engine.allowed_hosts, machine_names())
    uv_config = uvicorn.Config(
        create_app(engine, KeyFile(config.paths.engine_key), names),
        host=config.engine.host,
        port=config.engine.port,
        http="auto",  # HTTP/1.1 (httptools when installed, else h11); SSE streams are chunked
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(config.engine.shutdown_grace_s) + 2,
        # Longer than any client's pool keeps an idle connection (the gateway's aiohttp: 60 s): at
        # uvicorn's 5 s, a request sent as the engine closed its idle connection was reset.
        timeout_keep_alive=75,
        lifespan="on",
    )
    server = EngineServer(uv_config, engine.lifecycle)
    log.info("engine listening on http://%s:%d (pid %d)", config.engine.host, config.engine.port, os.getpid())
    server.run()
    if not server.started:  # e.g. the port is taken; uvicorn said why
        return exit_codes.STARTUP_FAILED
    exit_now(exit_codes.OK)


def exit_now(code: int) -> NoReturn:
    """The drained engine's exit, without the interpreter's teardown: the
    worker has stopped, the prompt cache's files are written and fsynced,
    and what is left is C++ static destructors, where MLX's CUDA backend
    aborted ("terminate called without an active exception": a clean drain
    ended as a SIGABRT). Logs are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
