"""Shared fixtures: demo models built once per session, and real engine
processes on free loopback ports, stopped by pid when the test ends."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from mlxd.engine.cpu.fast_blas import activate as activate_fast_blas

activate_fast_blas()  # before anything imports MLX: in-process tests get the engine's fast CPU path too

from mlxd.devkit.stack import Stack  # noqa: E402
from mlxd.engine.model.demo_model import build_demo_model, write_heavy_model_description  # noqa: E402
from mlxd.toml_text import dumps  # noqa: E402
from testkit import EngineProcess, spawn_engine, wait_healthy  # noqa: E402


# The fixtures that build a model or start a process: a test that uses one
# (directly or through another fixture) is an integration test, and
# `./scripts/test.sh --fast` leaves it out. A test that starts a process
# without them says so with `pytestmark = pytest.mark.integration`.
INTEGRATION_FIXTURES = frozenset({"demo_models", "think_model", "agent_model", "vision_model", "start_engine",
                                  "shared_engine", "stack_factory", "stack", "module_stack", "real_model",
                                  "process_runner"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: builds a model or starts real processes (left out by --fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


LIVE_STACKS: list[Stack] = []  # the stacks running now (stack_factory's), for a failure's report
LOG_TAIL_BYTES = 4000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test with stacks running gets their supervision log and the
    engine's stderr, tail only, in its report: CI keeps nothing else."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for st in LIVE_STACKS:
        for path in (st.paths.logs / "listener.log", st.paths.engine_stderr):
            try:
                with path.open("rb") as f:
                    f.seek(max(0, f.seek(0, 2) - LOG_TAIL_BYTES))
                    report.sections.append((f"{path.name} of {st.paths.home.name}", f.read().decode(errors="replace")))
            except OSError:
                pass


@dataclass
class DemoModels:
    a: Path
    b: Path
    heavy: Path


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> DemoModels:
    root = tmp_path_factory.mktemp("models")
    return DemoModels(
        a=build_demo_model(root / "demo-a", "a"),
        b=build_demo_model(root / "demo-b", "b"),
        heavy=write_heavy_model_description(root / "Llama-3.3-70B-Instruct", params_billion=70),
    )


@pytest.fixture(scope="session")
def tokenizer(demo_models: DemoModels):
    """Demo model a's tokenizer, for exact token counts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_models.a))


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's reasoning variant (think tokens, Qwen3's switch)."""
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo-think", "think")


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fine-tuned agent model (devkit/agent_model.py): ~1 min to build."""
    from mlxd.devkit.agent_model import build_agent_model

    return build_agent_model(tmp_path_factory.mktemp("models") / "agent")


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fine-tuned demo vision model (devkit/vision_model.py): names a
    plain image's colour; ~10 s to build."""
    from mlxd.devkit.vision_model import build_vision_model

    return build_vision_model(tmp_path_factory.mktemp("models") / "vision")


def engine_toml(models: DemoModels, engine: dict | None = None, extra_models: str | dict = "") -> str:
    """The config of an engine with our demo models; `engine`: [engine]
    settings; `extra_models`: more models, as {name: settings} or TOML text.
    No embedding model (the default one, where set-up fetched it, would add its
    weights to every model's estimate: the memory tests' budgets are exact)."""
    more = extra_models if isinstance(extra_models, dict) else {}
    return dumps({
        "embeddings": {},
        # Tests of the batch: the demo models decode no faster batched on 2 cores ([engine] batching's
        # "auto" would serve them one at a time; tests/engine/test_batching.py tests that choice itself).
        "engine": {"batching": "always", **(engine or {})},
        "models": {"demo-a": {"path": models.a}, "demo-b": {"path": models.b}, "llama-70b": {"path": models.heavy},
                   "big-72b-remote": {"repo": "mlx-community/Qwen2.5-72B-Instruct-4bit"}, **more},
        "aliases": {"default": "demo-a", "fast": "demo-a", "second": "demo-b", "heavy": "llama-70b"},
    }) + (extra_models if isinstance(extra_models, str) else "")


@pytest.fixture
def start_engine(tmp_path_factory: pytest.TempPathFactory,
                 demo_models: DemoModels) -> Iterator[Callable[..., EngineProcess]]:
    """Start engines with a config of our demo models; each returns once
    /health says ok (or, with wait_ok=False, once spawned). All are stopped
    by pid at the end of the test."""
    started: list[EngineProcess] = []

    def start(engine: dict | None = None, env: dict | None = None, wait_ok: bool = True,
              toml: str | None = None) -> EngineProcess:
        home = tmp_path_factory.mktemp("home")
        ep = spawn_engine(home, toml if toml is not None else engine_toml(demo_models, engine), env)
        started.append(ep)
        if wait_ok:
            wait_healthy(ep)
        return ep

    yield start
    for ep in started:
        ep.stop()


# Small caps keep the limit tests fast.
SHARED_ENGINE = {"max_queue": 4, "max_tokens_cap": 64, "max_prompt_tokens": 4096}


@contextmanager
def running_engine(tmp_path_factory: pytest.TempPathFactory, toml: str) -> Iterator[EngineProcess]:
    """One engine with this config, healthy, stopped by pid on leaving: for
    module-scoped fixtures whose tests neither stop nor crash it."""
    ep = spawn_engine(tmp_path_factory.mktemp("home"), toml)
    try:
        wait_healthy(ep)
        yield ep
    finally:
        ep.stop()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory: pytest.TempPathFactory, demo_models: DemoModels) -> Iterator[EngineProcess]:
    """One engine for the tests of a module that neither stop nor crash it."""
    with running_engine(tmp_path_factory, engine_toml(demo_models, SHARED_ENGINE)) as ep:
        yield ep


# Fast supervision for tests: short backoffs, a quick health poll. The stuck check is
# 5 s, not 1: on a 2-core CI machine running two test workers, a decoding worker can
# stall past a second, and an engine killed as "hung" fails a test that never hung it.
# The hang tests set 1 s themselves.
TEST_ENGINE = "stuck_grace_s = 5.0\n"
TEST_SUPERVISOR = "backoff_base_s = 0.2\nhealth_interval_s = 0.25\nstart_grace_s = 20\n"


@contextmanager
def stack_factory(tmp_path_factory: pytest.TempPathFactory, demo_models: DemoModels) -> Iterator:
    """Start mlxd stacks (supervisord + engine + listener, maybe the gateway)
    in temp homes on free ports; all are stopped (by pid, too) at the end."""
    stacks: list[Stack] = []

    def start(supervisor: str = "", engine: str = "", env: dict | None = None, fault: str | None = None,
              gateway: str | None = None, models: str = "") -> Stack:
        """gateway: None for no gateway, else extra [gateway] settings."""
        engine = engine if "stuck_grace_s" in engine else TEST_ENGINE + engine  # a slow model sets its own
        defaults = "".join(line + "\n" for line in TEST_SUPERVISOR.splitlines()
                           if line.split("=")[0].strip() + " " not in supervisor + " ")  # a test's own wins
        st = Stack.create(tmp_path_factory.mktemp("stack"), demo_models.a, engine=engine,
                          supervisor=defaults + supervisor, gateway=gateway, models=models, env=env)
        stacks.append(st)
        LIVE_STACKS.append(st)
        if fault:
            st.fault_file.write_text(fault)
        if fault and "@boot" in fault:  # it will never be ready: do not wait
            st.mlxd("up", "--detach", "--timeout", "0")
        else:
            st.up(120)
        return st

    try:
        yield start
    finally:
        for st in stacks:
            st.stop()
            LIVE_STACKS.remove(st)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory, demo_models: DemoModels) -> Iterator:
    """A factory of mlxd stacks for one test."""
    with stack_factory(tmp_path_factory, demo_models) as start:
        yield start


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory: pytest.TempPathFactory, demo_models: DemoModels) -> Iterator:
    """A factory of mlxd stacks shared by the tests of one module."""
    with stack_factory(tmp_path_factory, demo_models) as start:
        yield start
