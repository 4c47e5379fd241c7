"""The engine core's turn logic (engine/core/engine_core.py), in process, as tables.

A real `EngineCore`, a real `AdmissionQueue`, request table, memory ledger
and (disabled) prompt cache, driven step by step against `FakeRunner`: the
runner's interface (engine/model/runner.py) with no MLX behind it. Each fake row
"generates" one token a step; its end goes out as `Generation.end` sends it
(engine/model/generation.py). No thread, no sleep: `run_until` calls `core.step()`
a bounded number of times. Beside the real-process tests (test_batching.py,
test_failures.py), which show the same behaviour through HTTP on a real model.
"""

from __future__ import annotations

import asyncio
import math
import importlib.abc
import inspect
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from mlxd.memory_estimate import KVLayout, kv_cache_bytes
from mlxd.records import InflightRequest

from mlxd.engine.cache.prompt_cache import PromptCache
from mlxd.engine.core import (backend_limit, embedding_turn, engine_core, held_answers, keep_alive, prompt_turns,
                             residency)
from mlxd.engine.core.admission import AdmissionQueue
from mlxd.engine.core.embedding_queue import EmbeddingQueue, EmbedJob
from mlxd.engine.model.decoder_rows import Admitted, Ended
from mlxd.engine.core.engine_core import EngineCore
from mlxd.engine.model.errors import EngineError, bad_request
from mlxd.engine.model.events import Delta, EventChannel, Failed, Finished, Started
from mlxd.engine.model.faults import FaultInjector
from mlxd.engine.model.generation import answer_finish, finish_reason
from mlxd.engine.model.job import Job, SamplingParams
from mlxd.engine.model.model_registry import ModelRegistry
from mlxd.engine.model.prefill import cancelled_error
from mlxd.engine.core.request_table import RequestStatus
from mlxd.engine.model.runner import ModelRunner, Prompt
from mlxd.engine.core.scheduler import Memory, Row, batch_kv_bytes
from mlxd.engine.model.serving_plan import ServingPlan, serving_plan
from mlxd.engine.model.mlx_memory import MemorySnapshot
from mlxd.engine.core.worker_state import Phase, WorkerStatus

W, P, D = RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING
MODEL, OTHER = "demo-a", "demo-b"
PROMPT = [11, 12, 13, 14]  # every job's prompt, unless a test says otherwise
ANSWER = 3  # tokens a fake row generates before it stops (fewer when max_tokens cuts it: "length")
MAX_TOKENS = 8
PREFILL_STEP = 512
# A model of 1 MB whose KV takes 256 bytes a position (1 layer, 1 KV head of 64, float16).
WEIGHTS = 1_000_000
CONFIG = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
          "head_dim": 64}
MLX_PACKAGES = ("mlx", "mlx_lm", "mlx_vlm")


# --- no MLX ------------------------------------------------------------------------


class _NoMLX(importlib.abc.MetaPathFinder):
    """Refuses (and records) any import of MLX while a test runs."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in MLX_PACKAGES:
            self.tried.append(name)
            raise ImportError(f"{name}: the engine core's tests make no MLX call")
        return None


@pytest.fixture(autouse=True)
def no_mlx(monkeypatch: pytest.MonkeyPatch):
    """Every test here runs with MLX out of reach: modules other tests loaded
    are hidden (and put back after), and a new import of one fails and is named."""
    finder = _NoMLX()
    for name in [n for n in sys.modules if n.split(".")[0] in MLX_PACKAGES]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield
    assert finder.tried == [], f"MLX was imported: {finder.tried}"


# --- the fakes -----------------------------------------------------------------------


@dataclass
class FakeRegistry:
    """What the core asks of ModelRegistry: the budget, each model's
    concurrency, its figures for the memory ledger, its prompt-cache key."""

    concurrency: dict[str, int]
    budget_bytes: int = 2**40
    weights_bytes: int | None = None  # None: the model's size is unknown (the ledger counts nothing)
    config: dict = field(default_factory=dict)
    too_large: frozenset[str] = frozenset()
    journal: Path = Path("/nonexistent/state/crashes.jsonl")  # a test of the journal gives its own
    float32: set[str] = field(default_factory=set)  # models serve_as_float32 turned to float32

    @property
    def journal_path(self) -> Path:
        return self.journal

    def serve_as_float32(self, model_id: str) -> bool:
        if model_id in self.float32:
            return False
        self.float32.add(model_id)
        return True

    def max_concurrency(self, model_id: str) -> int:
        return self.concurrency[model_id]

    def check_allowed(self, model_id: str) -> None:
        if model_id in self.too_large:
            raise EngineError(400, f"{model_id} does not fit", code="model_too_large", param="model")

    def info(self, model_id: str, *, refresh: bool = False) -> Any:
        return SimpleNamespace(footprint=SimpleNamespace(weights_bytes=self.weights_bytes), config=self.config,
                               prompt_cache_bytes=0)

    def build_key(self, model_id: str, target: str) -> str:
        return f"{model_id}@fake"

    def load_target(self, model_id: str) -> str:
        return f"/models/{model_id}"


class FakeGeneration:
    """A job's answer as far as the core reads it: the tokens generated."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.grammar = None


class FakeEncoder:
    """engine/model/encoder.py's Encoder without MLX: a token a word, one
    forward an input, each a vector of (words, the decode steps run before it);
    `failures[("embed", model)]` raised at the first forward."""

    def __init__(self, model_id: str, runner: "FakeRunner") -> None:
        self.model_id, self.runner = model_id, runner

    def tokenize(self, inputs: list, truncate: bool) -> list[list[int]]:
        if any(not isinstance(text, str) and min(text) < 0 for text in inputs):
            raise EngineError(400, "a token id outside the vocabulary", code="invalid_request", param="input")
        return [list(range(len(text.split()))) if isinstance(text, str) else list(text) for text in inputs]

    def start(self, ids: list[list[int]]) -> "FakeRun":
        return FakeRun(self, ids)


class FakeRun:
    def __init__(self, encoder: FakeEncoder, ids: list[list[int]]) -> None:
        self.encoder, self.ids, self.tokens, self.rows = encoder, ids, sum(map(len, ids)), []

    def step(self) -> bool:
        runner = self.encoder.runner
        runner._fail("embed", self.encoder.model_id)
        self.rows.append([len(self.ids[len(self.rows)]), len(runner.steps)])
        runner.timeline.append("forward")
        return len(self.rows) == len(self.ids)

    def vectors(self) -> Any:
        import numpy as np

        return np.array(self.rows, dtype=np.float32)


class FakeRunner:
    """engine/model/runner.py's ModelRunner without MLX: one decoder of rows, a
    token a step each; `answer` tokens make an answer ("stop"), max_tokens
    cuts it ("length"), a cancelled job ends "cancelled" at its next token.
    `failures[(stage, job or model id)]` is raised at that stage ("load",
    "tokenize", "admit", "step"). What the core must never ask of a runner
    (a row beside one decoded alone, more rows than slots, an unload under
    running rows) is noted in `broken`: raised here, the core would take it
    for an MLX fault."""

    def __init__(self, registry: FakeRegistry, answer: int = ANSWER) -> None:
        self.registry = registry
        self.answer = answer
        self.plan: ServingPlan | None = None
        self._resident: str | None = None
        self.one: Admitted | None = None  # the row decoded alone (nobody joins it)
        self.many: list[Admitted] = []  # the batch's rows
        self.save_progress = None  # the core's hook for a long prefill (ModelRunner.save_progress)
        self.failures: dict[tuple[str, str], BaseException] = {}
        self.raised = False
        self.loads: list[str] = []
        self.unloads = 0
        self.steps: list[tuple[str, ...]] = []  # the job ids each decode step advanced
        self.broken: list[str] = []
        self.memory_limit: int | None = None
        self.encoder: FakeEncoder | None = None
        self.encoder_loads: list[str] = []
        self.timeline: list[str] = []  # "decode" and "forward" (an embedding's), in order

    def _fail(self, stage: str, key: str) -> None:
        exc = self.failures.get((stage, key))
        if exc is not None:
            self.raised = True  # the core may drop the failed step's rows (an unload under them)
            raise exc

    @property
    def resident_id(self) -> str | None:
        return self._resident

    # --- the model ------------------------------------------------------------------
    def load(self, model_id: str) -> ServingPlan:
        self._fail("load", model_id)
        if self.rows:
            self.broken.append(f"load of {model_id} under running rows")
        self.loads.append(model_id)
        self._resident = model_id
        self.plan = serving_plan(model_id, self.registry.max_concurrency(model_id), vision=False, rank_group=False,
                                 kv=KVLayout(), cpu_float32=False, rows_apart=True)
        return self.plan

    def unload(self) -> None:
        if self.rows and not self.raised:
            self.broken.append("unload under running rows")
        self.one, self.many, self.raised = None, [], False
        self.unloads += 1
        self._resident = self.plan = None

    def reset_peak(self) -> None:
        pass

    # --- the embedding model ----------------------------------------------------------
    def load_encoder(self, model_id: str) -> "FakeEncoder":
        self._fail("load_encoder", model_id)
        if self.encoder is None or self.encoder.model_id != model_id:
            self.encoder_loads.append(model_id)
            self.encoder = FakeEncoder(model_id, self)
        return self.encoder

    def unload_encoder(self) -> None:
        self.encoder = None

    def give_heap_back(self) -> None:
        pass

    def generation_prompt_length(self) -> int:
        return 0

    # --- a request ----------------------------------------------------------------------
    def can_batch(self, job: Job) -> bool:
        plan = self.plan
        return (plan is not None and plan.model_id == job.model_id and plan.max_concurrency > 1
                and job.params.seed is None and not job.images and not job.alone)

    def tokenize(self, job: Job) -> Prompt:
        self._fail("tokenize", job.id)
        return Prompt(list(job.prompt))  # type: ignore[arg-type]

    def admit(self, job: Job, prompt: Prompt, fetched: Any, cache_enabled: bool, alone: bool,
              taken_at: float) -> Admitted:
        self._fail("admit", job.id)
        if any(a.alone for a in self.rows):
            self.broken.append(f"{job.id} joined a request decoded alone")
        if len(self.rows) >= self.plan.max_concurrency:
            self.broken.append(f"{job.id} admitted past {self.plan.max_concurrency} rows")
        if job.model_id != self._resident:
            self.broken.append(f"{job.id} admitted on {self._resident}, not its model {job.model_id}")
        a = Admitted(job, FakeGeneration(), prompt.tokens, fetched, None, False, alone=alone,  # type: ignore[arg-type]
                     taken_at=taken_at)
        if alone:
            if self.rows:
                self.broken.append(f"{job.id} decoded alone with others running")
            self.one = a
        else:
            self.many.append(a)
        a.joined_at = time.monotonic()
        return a

    def step(self) -> list[Ended]:
        rows = self.rows
        for a in rows:
            self._fail("step", a.job.id)
        self.steps.append(tuple(a.job.id for a in rows))
        self.timeline.append("decode")
        ended = []
        for a in rows:
            if a.first_token_at is None:
                a.first_token_at = time.monotonic()
            tokens = a.generation.tokens
            tokens.append(100 + len(tokens))
            a.job.channel.put(Delta(f"t{len(tokens)}"))
            model_finish = ("length" if len(tokens) >= a.job.params.max_tokens else
                            "stop" if len(tokens) >= self.answer else None)
            finish = finish_reason(False, model_finish, a.job.cancelled.is_set(), False)
            if finish is not None:
                ended.append(Ended(a, finish, None))
        gone = {id(e.admitted) for e in ended}
        if self.one is not None and id(self.one) in gone:
            self.one = None
        self.many = [a for a in self.many if id(a) not in gone]
        return ended

    @property
    def rows(self) -> list[Admitted]:
        return ([self.one] if self.one is not None else []) + list(self.many)

    @property
    def batch_rows(self) -> list[Admitted]:
        return list(self.many)

    def finish(self, e: Ended) -> None:
        """As Generation.end: a cancelled answer is never ended as if complete."""
        a = e.admitted
        if e.finish == "cancelled":
            a.job.channel.put(Failed(cancelled_error()))
            return
        a.job.channel.put(Finished(answer_finish(e.finish, False), len(a.prompt), len(a.generation.tokens),
                                   a.fetched.cached_tokens))

    def echo(self, generated: list[int]) -> tuple[int, ...]:
        return ()

    def describe_reuse(self, cached: list[int], sent: list[int]) -> tuple[str, str]:
        return str(cached), str(sent)

    # --- memory ----------------------------------------------------------------------------
    def memory(self) -> MemorySnapshot:
        return MemorySnapshot(0, 0, 0, time.monotonic())

    def mlx_bytes(self) -> int:
        return 0

    def clear_cache(self) -> None:
        pass

    def set_memory_limit(self, limit_bytes: int) -> None:
        self.memory_limit = limit_bytes


# --- the harness -----------------------------------------------------------------------


class Engine:
    """A core over the fakes, its jobs and what each job's client received."""

    def __init__(self, loop: asyncio.AbstractEventLoop, concurrency: int = 1, *, others: dict[str, int] | None = None,
                 sized: bool = False, budget_bytes: int = 2**40, inflight_path: Path | None = None,
                 keep_alive_s: float = math.inf) -> None:
        self.loop = loop
        self.embeddings = EmbeddingQueue(lambda: None)
        models = {MODEL: concurrency, **(others or {})}
        self.registry = FakeRegistry(models, budget_bytes, WEIGHTS if sized else None, CONFIG if sized else {})
        self.admission: AdmissionQueue[Job] = AdmissionQueue(capacity=16, slots=max(models.values()))
        self.runner = FakeRunner(self.registry)
        self.fatal: list[tuple[BaseException, Job | None]] = []
        self.core = EngineCore(self.registry, self.admission, FaultInjector(None, None),  # type: ignore[arg-type]
                               self.runner, lambda exc, job: self.fatal.append((exc, job)), inflight_path,
                               PREFILL_STEP, keep_alive_s, self.embeddings)
        self.jobs: dict[str, Job] = {}
        self._received: dict[str, list] = {}

    def submit(self, name: str, *, max_tokens: int = MAX_TOKENS, seed: int | None = None, images: tuple = (),
               model: str = MODEL, prompt: list[int] = PROMPT, alone: bool = False,
               keep_alive_s: float | None = None) -> Job:
        job = Job(id=name, kind="completion", model_id=model, params=SamplingParams(max_tokens, seed=seed),
                  channel=EventChannel(self.loop), deadline_s=600.0, prompt=list(prompt), images=images, alone=alone,
                  keep_alive_s=keep_alive_s)
        assert self.admission.offer(job) is None
        self.jobs[name] = job
        return job

    def embed(self, *texts: str, model: str = "enc", keep_alive_s: float | None = None) -> EmbedJob:
        job = EmbedJob(model, list(texts), False, keep_alive_s)
        assert self.embeddings.offer(job) is None
        return job

    def events(self, name: str) -> list:
        """Everything the job's client received so far."""
        got = self.loop.run_until_complete(self.jobs[name].channel.get(0))
        self._received.setdefault(name, []).extend(got)
        return self._received[name]

    def kinds(self, name: str) -> list[str]:
        return [type(e).__name__ for e in self.events(name)]

    def ended(self, name: str) -> bool:
        return any(isinstance(e, (Finished, Failed)) for e in self.events(name))

    def held(self) -> dict[str, RequestStatus]:
        """The published request table: id -> status."""
        return {r.id: r.status for r in self.core.status.requests}

    def run_until(self, done: Callable[[], bool], max_steps: int = 200) -> list[WorkerStatus]:
        return run_until(self.core, done, max_steps)

    def all_ended(self) -> bool:
        return all(self.ended(n) for n in self.jobs)

    def idle(self) -> bool:
        """Nothing held, nothing queued, every slot free."""
        q = self.admission.snapshot()
        return not self.core.status.requests and q["running"] == 0 and q["waiting"] == 0


def run_until(core: EngineCore, done: Callable[[], bool], max_steps: int = 200) -> list[WorkerStatus]:
    """`core.step()` until `done()` (at most `max_steps` steps); the status
    published after each step. The fake runner's contract is checked each step."""
    seen: list[WorkerStatus] = []
    for _ in range(max_steps):
        if done():
            return seen
        core.step()
        seen.append(core.status)
        assert core.runner.broken == [], core.runner.broken
        idle = not (core.status.requests or core.pending or core.runner.rows or core.admission.has_waiting()
                    or core.embeddings.has_waiting() or core.embedding is not None or core.held)
        assert not idle or done(), f"the core has nothing left to do, and it is not done: {core.status}"
    assert done(), f"not done after {max_steps} steps: {core.status}"
    return seen


def running_ids(s: WorkerStatus) -> set[str]:
    return set(s.in_flight_ids)


def room_for(rows: int) -> int:
    """A budget with room for the model and `rows` rows of PROMPT + MAX_TOKENS
    at the batch's peak (engine/core/scheduler.py), and not one row more."""
    memory = Memory(0, WEIGHTS, kv_cache_bytes(CONFIG, 1))
    return WEIGHTS + batch_kv_bytes(memory, [Row(len(PROMPT), MAX_TOKENS)] * rows)


def failed_with(events: list) -> EngineError:
    assert events and isinstance(events[-1], Failed), events
    return events[-1].error


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def engine(loop) -> Callable[..., Engine]:
    return lambda *args, **kwargs: Engine(loop, *args, **kwargs)


# --- the fakes keep to the real interfaces ----------------------------------------------


def test_the_fakes_offer_what_the_core_uses_with_the_real_signatures():
    """Every runner and registry member EngineCore uses exists on ModelRunner /
    ModelRegistry and on the fakes, with the same parameters: the fakes cannot drift."""
    # The core and the parts it owns, each given its runner and registry (engine/core/: one owner each).
    source = "".join(inspect.getsource(m) for m in (engine_core, residency, keep_alive, embedding_turn, prompt_turns,
                                                    backend_limit, held_answers)).replace("core.runner.", "self.runner.").replace(
        "core.registry.", "self.registry.")
    registry = FakeRegistry({MODEL: 1})
    for name, real, fake, core_of_it in [("runner", ModelRunner, FakeRunner(registry), {"load", "admit", "step"}),
                                         ("registry", ModelRegistry, registry, {"info", "max_concurrency"})]:
        used = set(re.findall(rf"self\.{name}\.(\w+)", source))
        assert core_of_it <= used, used  # the pattern still finds what the core calls
        for member in sorted(used):
            if re.search(rf"self\.{member}(: [^=]+)? = ", inspect.getsource(real.__init__)):  # plan, budget_bytes
                assert hasattr(fake, member), member
                continue
            r, f = inspect.getattr_static(real, member), inspect.getattr_static(type(fake), member)
            assert isinstance(r, property) == isinstance(f, property), member
            if not isinstance(r, property):
                assert list(inspect.signature(r).parameters) == list(inspect.signature(f).parameters), member


# --- 1. single concurrency ---------------------------------------------------------------


@pytest.mark.parametrize("jobs, finishes", [
    pytest.param({"a": MAX_TOKENS, "b": MAX_TOKENS}, {"a": ("stop", ANSWER), "b": ("stop", ANSWER)},
                 id="two-jobs"),
    pytest.param({"a": MAX_TOKENS, "b": 2, "c": MAX_TOKENS},
                 {"a": ("stop", ANSWER), "b": ("length", 2), "c": ("stop", ANSWER)}, id="three-jobs-one-cut-short"),
])
def test_single_concurrency_serves_jobs_one_after_the_other(engine, jobs, finishes):
    """max_concurrency 1: jobs run one at a time in their order, the next not even taken meanwhile; each ends whole."""
    e = engine(1)
    for name, max_tokens in jobs.items():
        e.submit(name, max_tokens=max_tokens)
    seen = e.run_until(e.all_ended)

    assert max(len(s.running) for s in seen) == 1 and e.core.max_observed_concurrency == 1
    assert all(len(s.requests) <= 1 for s in seen)  # the next one stays in the queue: never held beside
    served = [r.id for s in seen for r in s.running]
    assert list(dict.fromkeys(served)) == list(jobs)  # in order
    assert {D} <= {s.requests[0].status for s in seen if s.requests}  # decoding is published
    assert all(len(rows) == 1 for rows in e.runner.steps)  # one row a step
    for name, (reason, tokens) in finishes.items():
        events = e.events(name)
        assert events[0] == Started(len(PROMPT))
        assert [type(x) for x in events[1:-1]] == [Delta] * tokens
        assert events[-1] == Finished(reason, len(PROMPT), tokens)
    assert e.runner.loads == [MODEL]
    assert e.core.counters["generated_tokens"] == sum(t for _, t in finishes.values())
    assert e.idle() and e.core.status.phase is Phase.IDLE


# --- 2. batching ----------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, jobs, widest", [
    pytest.param(4, 4, 4, id="four-slots-four-jobs"),
    pytest.param(4, 6, 4, id="four-slots-six-jobs"),
    pytest.param(2, 3, 2, id="two-slots-three-jobs"),
])
def test_queued_jobs_are_decoded_together_up_to_the_slots(engine, concurrency, jobs, widest):
    """max_concurrency n: queued jobs join one batch, at most n rows, and every one ends whole."""
    e = engine(concurrency)
    for i in range(jobs):
        e.submit(f"j{i}")
    seen = e.run_until(e.all_ended)

    assert max(len(s.running) for s in seen) == widest == e.core.max_observed_concurrency
    assert max(len(rows) for rows in e.runner.steps) == widest
    assert tuple(f"j{i}" for i in range(widest)) in e.runner.steps  # the first n decoded in one step
    for i in range(jobs):
        assert e.events(f"j{i}")[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert e.idle()


@pytest.mark.parametrize("kind, loads", [
    pytest.param({"seed": 7}, [MODEL], id="a-seed"),
    pytest.param({"images": (b"\x89PNG",)}, [MODEL], id="an-image"),
    pytest.param({"model": OTHER}, [MODEL, OTHER, MODEL], id="another-model"),
    pytest.param({"alone": True}, [MODEL], id="a-suspect-of-a-crash"),  # in flight at a crash with others
])
def test_a_job_the_batch_cannot_take_waits_for_it_to_drain_then_runs_alone(engine, kind, loads):
    """A seed, an image, another model or a crash's suspect: the job waits (held WAITING) until the
    batch has drained, then runs with no other row beside it; the rest follow."""
    e = engine(4, others={OTHER: 4})
    for name in ("a", "b"):
        e.submit(name)
    e.submit("x", **kind)
    e.submit("c")
    seen = e.run_until(e.all_ended)

    assert any(running_ids(s) == {"a", "b"} and s.requests[-1].id == "x" and s.requests[-1].status is W
               for s in seen)  # it waits behind the batch, first in line
    x_steps = [rows for rows in e.runner.steps if "x" in rows]
    assert x_steps and all(rows == ("x",) for rows in x_steps)  # nobody beside it
    assert all(running_ids(s) == {"x"} for s in seen if "x" in running_ids(s))
    at = [i for i, rows in enumerate(e.runner.steps) if "x" in rows]
    first_x, last_x = at[0], at[-1]
    assert at == list(range(first_x, last_x + 1))  # its steps in one run
    assert all({"a", "b"} & set(rows) for rows in e.runner.steps[:first_x])  # the batch first
    assert all(rows == ("c",) for rows in e.runner.steps[last_x + 1:])  # c only after it
    assert e.runner.loads == loads
    for name in ("a", "b", "x", "c"):
        assert isinstance(e.events(name)[-1], Finished), name
    assert e.idle()


# --- 3. waiting for memory ---------------------------------------------------------------


@pytest.mark.parametrize("rows_fit, jobs", [
    pytest.param(1, 2, id="room-for-one-row"),
    pytest.param(2, 3, id="room-for-two-rows"),
    pytest.param(3, 4, id="room-for-three-rows"),
])
def test_a_job_waits_for_memory_until_a_row_ends(engine, rows_fit, jobs):
    """The ledger fits `rows_fit` rows: the next job stays WAITING while they
    run, and runs once the first (shortest) row has ended, beside the others."""
    e = engine(4, sized=True, budget_bytes=room_for(rows_fit))
    names = [f"j{i}" for i in range(jobs)]
    e.submit(names[0], max_tokens=2)  # the first ends first
    for name in names[1:]:
        e.submit(name)
    waiter, before = names[-1], set(names[:-1])
    e.run_until(lambda: e.held().get(waiter) is W)
    row = Row(len(PROMPT), MAX_TOKENS)
    assert e.core.ledger.fits_batch([row] * rows_fit) and not e.core.ledger.fits_batch([row] * (rows_fit + 1))
    seen = [e.core.status, *e.run_until(e.all_ended)]

    assert max(len(s.running) for s in seen) == rows_fit == e.core.max_observed_concurrency
    waiting = [s for s in seen if any(r.id == waiter and r.status is W for r in s.requests)]
    assert any(running_ids(s) == before for s in waiting)  # all the others run meanwhile
    assert all(running_ids(s) <= before for s in waiting)
    assert names[0] not in {i for s in seen for i in running_ids(s) if waiter in running_ids(s)}  # after it ended
    if rows_fit > 1:  # it joined the rows still running
        assert any(waiter in rows and len(rows) > 1 for rows in e.runner.steps)
    assert e.events(names[0])[-1] == Finished("length", len(PROMPT), 2)
    for name in names[1:]:
        assert e.events(name)[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert e.idle()


# --- 4. cancel, client gone ------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, victim, cancel_when, answered", [
    pytest.param(1, {}, None, None, id="cancelled-before-the-core-took-it"),
    pytest.param(4, {"seed": 7}, W, None, id="taken-and-waiting-behind-the-batch"),
    pytest.param(4, {}, P, ["Started", "Delta", "Failed"], id="prefilling-in-the-batch"),
    pytest.param(4, {}, D, ["Started", "Delta", "Delta", "Failed"], id="decoding-in-the-batch"),
    pytest.param(1, {}, D, ["Started", "Delta", "Delta", "Failed"], id="decoding-alone"),
])
def test_a_cancelled_job_is_let_go_and_its_slot_freed(engine, concurrency, victim, cancel_when, answered):
    """Cancelled (client gone, drain) before it runs: let go, never started; while
    it runs: ended by a 503 at its next token, never as complete; the others run on."""
    e = engine(concurrency)
    e.submit("a")
    e.submit("v", **victim)
    e.submit("z")
    if cancel_when is not None:
        e.run_until(lambda: e.held().get("v") is cancel_when)
    e.jobs["v"].cancelled.set()
    steps_before = len(e.runner.steps)
    e.run_until(lambda: e.ended("a") and e.ended("z") and e.idle())

    kinds = e.kinds("v")
    if answered is None:  # it never ran: nothing of an answer went out
        assert not {"Started", "Delta", "Finished"} & set(kinds), kinds
        assert "v" not in {i for rows in e.runner.steps for i in rows}
    else:
        assert kinds == answered
        error = failed_with(e.events("v"))
        assert (error.status, error.code) == (503, "engine_unavailable")
    after = [rows for rows in e.runner.steps[steps_before:] if "v" in rows]
    assert len(after) == (0 if answered is None else 1)  # ended at its next token, or never decoded
    for name in ("a", "z"):
        assert e.events(name)[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert e.idle() and not e.core.stopped


# --- 5. too large even alone ----------------------------------------------------------------


@pytest.mark.parametrize("concurrency, kinds", [
    pytest.param(1, ["Started", "Failed"], id="served-alone-refused-at-admission"),
    pytest.param(4, ["Failed"], id="batchable-refused-when-prepared"),
])
def test_a_job_too_large_even_alone_gets_a_400_and_the_next_is_served(engine, concurrency, kinds):
    """A prompt + max_tokens whose KV cannot fit beside the model even alone: a 400
    context_length_exceeded (the gateway falls back), nothing decoded; the next job runs."""
    e = engine(concurrency, sized=True, budget_bytes=room_for(2))
    e.submit("big", max_tokens=1_000_000)
    e.submit("b")
    e.run_until(lambda: e.ended("big") and e.ended("b"))

    error = failed_with(e.events("big"))
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert e.kinds("big") == kinds
    assert all(rows == ("b",) for rows in e.runner.steps)
    assert e.events("b")[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert e.idle() and not e.core.stopped and e.fatal == []


# --- 6. a runner error ------------------------------------------------------------------------

@pytest.mark.parametrize("concurrency, jobs, fails_at, blamed, held", [
    pytest.param(1, {"a": {}, "b": {}}, ("step", "a"), "a", {"a"}, id="decode-step-one-row-alone"),
    pytest.param(4, {"a": {}, "b": {}, "c": {}}, ("step", "a"), "a", {"a", "b", "c"},
                 id="decode-step-batch-of-three"),
    pytest.param(4, {"a": {}, "b": {}, "x": {}}, ("admit", "x"), "x", {"a", "b", "x"}, id="admit-beside-a-batch"),
    pytest.param(4, {"a": {}, "b": {}}, ("load", MODEL), "a", {"a"}, id="model-load"),
    pytest.param(4, {"a": {}, "b": {}, "s": {"seed": 7}}, ("step", "a"), "a", {"a", "b", "s"},
                 id="decode-step-with-a-job-waiting-for-the-batch"),
    pytest.param(4, {"a": {}, "x": {}}, ("tokenize", "x"), "x", {"a", "x"}, id="tokenize-beside-a-running-row"),
])
def test_a_runner_error_is_fatal_and_every_held_job_gets_a_500(engine, concurrency, jobs, fails_at, blamed, held):
    """An exception out of the runner (MLX): every job the core holds gets one 500
    mlx_error, the core stops, on_fatal is called once, the phase is FAILED."""
    e = engine(concurrency)
    for name, kw in jobs.items():
        e.submit(name, **kw)
    crash = RuntimeError("[METAL] Command buffer execution failed (fake)")
    e.runner.failures[fails_at] = crash
    e.run_until(lambda: e.core.stopped)

    assert e.core.status.phase is Phase.FAILED
    assert [(exc, job.id if job else None) for exc, job in e.fatal] == [(crash, blamed)]
    assert {r.id for r in e.core.status.requests} == held  # what the crash journal and the drain see
    for name in sorted(held):
        events = e.events(name)
        assert [x for x in events if isinstance(x, (Failed, Finished))] == events[-1:], (name, events)
        error = failed_with(events)
        assert (error.status, error.code, error.retry_after) == (500, "mlx_error", 5), name
    queued = [n for n in jobs if n not in held]  # still the queue's: the Lifecycle fails them (admission.close)
    assert all(e.events(n) == [] for n in queued)
    assert e.admission.snapshot()["waiting"] == len(queued)


@pytest.mark.parametrize("concurrency, jobs, fails_at, failed, already_float32, loads", [
    pytest.param(4, {"a": {}, "b": {}, "c": {}}, ("step", "a"), {"a", "b", "c"}, False, [MODEL, MODEL],
                 id="decode-step-of-a-batch-reloads-as-float32"),
    pytest.param(1, {"a": {}, "b": {}}, ("admit", "a"), {"a"}, False, [MODEL, MODEL],
                 id="prefill-alone-reloads-and-the-next-request-is-served"),
    pytest.param(1, {"a": {}, "b": {}}, ("step", "a"), {"a"}, True, [MODEL, MODEL],
                 id="float32-already-unloads-and-the-next-request-loads-it-again"),
])
def test_a_backend_limit_answers_its_requests_and_reloads_instead_of_exiting(engine, tmp_path, concurrency, jobs,
                                                                               fails_at, failed, already_float32,
                                                                               loads):
    """An op the MLX backend cannot run (GatherMM on bf16 weights on the CPU) is
    no device fault: the requests running get a 500 `backend_unsupported`, the
    crash journal a `backend_unsupported` line naming them, the model is
    reloaded as float32 (or, float32 already, unloaded), and the engine serves
    the requests that come next; no exit, no on_fatal."""
    from mlxd.engine.model.errors import BACKEND_UNSUPPORTED
    from mlxd.supervisor.journal import read_records

    e = engine(concurrency)
    e.registry.journal = tmp_path / "crashes.jsonl"
    if already_float32:
        e.registry.float32.add(MODEL)
    for name, kw in jobs.items():
        e.submit(name, **kw)
    e.runner.failures[fails_at] = RuntimeError("[GatherMM::eval] Currently only supports float32.")
    e.run_until(lambda: all(e.ended(n) for n in failed))
    e.runner.failures.clear()
    e.run_until(e.all_ended)

    assert not e.core.stopped and e.fatal == []
    for name in jobs:
        events = e.events(name)
        if name in failed:
            error = failed_with(events)
            assert (error.status, error.code) == (500, BACKEND_UNSUPPORTED) and "GatherMM" in error.message
        else:
            assert isinstance(events[-1], Finished), (name, events)
    assert e.runner.loads == loads
    (record,) = read_records(e.registry.journal)
    assert record.klass == BACKEND_UNSUPPORTED and not record.is_crash and record.model == MODEL
    assert {r["request_id"] for r in record.requests} == failed
    assert e.idle()


# --- 7. the drain's view -------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, room, jobs, moment, held, queued", [
    pytest.param(1, None, {"a": {}, "b": {}}, ("a", D), {"a": D}, ["b"], id="one-alone-one-queued"),
    pytest.param(4, None, {"a": {}, "b": {}, "c": {}}, ("c", P), {"a": P, "b": P, "c": P}, [],
                 id="a-batch-prefilling"),
    pytest.param(4, 2, {"a": {}, "b": {}, "c": {}, "d": {}}, ("a", D), {"a": D, "b": D, "c": W}, ["d"],
                 id="a-batch-and-one-waiting-for-memory"),
    pytest.param(4, None, {"a": {}, "s": {"seed": 7}, "b": {}}, ("a", D), {"a": D, "s": W}, ["b"],
                 id="a-batch-and-a-seeded-job-waiting"),
])
def test_the_drain_sees_every_held_job_and_cancelling_them_frees_every_slot(engine, concurrency, room, jobs, moment,
                                                                           held, queued):
    """core.status.requests is what the drain cancels: every held job in the order
    taken, one status each; in-flight ids are exactly the running ones. Cancelled,
    each is let go, the running ones with a 503, and every slot is freed."""
    e = engine(concurrency, sized=room is not None, budget_bytes=room_for(room) if room else 2**40)
    for name, kw in jobs.items():
        e.submit(name, **kw)
    name, status = moment
    e.run_until(lambda: e.held().get(name) is status)

    s = e.core.status
    assert [(r.id, r.status) for r in s.requests] == list(held.items())
    running = tuple(i for i, st in held.items() if st is not W)
    assert s.in_flight_ids == running and s.in_flight == running[0]
    assert len(s.running) == len(running)
    # The drain (Lifecycle): the queue closed and its jobs failed, then the held ones cancelled.
    assert [j.id for j in e.admission.close()] == queued
    for r in s.requests:
        r.job.cancelled.set()
    e.run_until(e.idle)

    for i, st in held.items():
        kinds = e.kinds(i)
        assert "Finished" not in kinds, (i, kinds)
        if st is W:
            assert "Started" not in kinds, (i, kinds)
        else:
            error = failed_with(e.events(i))
            assert (error.status, error.code) == (503, "engine_unavailable")
    assert not e.core.stopped and e.core.status.phase is Phase.IDLE


def test_a_job_waiting_for_the_batch_cancelled_by_the_drain_is_told(engine):
    """A job taken but waiting for room when the drain's grace runs out gets the
    drain's 503, as the running ones do, rather than no answer at all."""
    e = engine(4)
    e.submit("a")
    e.submit("s", seed=7)
    e.run_until(lambda: e.held().get("s") is W)
    for r in e.core.status.requests:
        r.job.cancelled.set()
    e.run_until(e.idle)
    error = failed_with(e.events("s"))
    assert (error.status, error.code) == (503, "engine_unavailable")


# --- 8. a job the runner refuses ---------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, x, fails_at, error, kinds, loads", [
    pytest.param(1, {}, ("tokenize", "x"), bad_request("the prompt is empty", param="prompt"), ["Failed"],
                 [MODEL], id="tokenize-alone"),
    pytest.param(4, {}, ("tokenize", "x"), bad_request("the prompt is empty", param="prompt"), ["Failed"],
                 [MODEL], id="tokenize-beside-a-batch"),
    pytest.param(4, {}, ("admit", "x"),
                 EngineError(400, "the grammar cannot be enforced", code="unsupported_parameter"),
                 ["Started", "Failed"], [MODEL], id="admit-beside-a-batch"),
    pytest.param(1, {"model": OTHER}, ("load", OTHER),
                 EngineError(503, "could not load model", code="model_load_failed", retry_after=30), ["Failed"],
                 [MODEL, MODEL], id="its-model-fails-to-load"),
])
def test_an_engine_error_from_the_runner_fails_that_job_only(engine, concurrency, x, fails_at, error, kinds, loads):
    """An EngineError (a prompt the model cannot take, a model that cannot load):
    that job gets it, the others are served, the core goes on."""
    e = engine(concurrency, others={OTHER: concurrency})
    e.submit("a")
    e.submit("x", **x)
    e.submit("z")
    e.runner.failures[fails_at] = error
    e.run_until(lambda: e.all_ended() and e.idle())

    assert e.kinds("x") == kinds and failed_with(e.events("x")) is error
    assert "x" not in {i for rows in e.runner.steps for i in rows}
    for name in ("a", "z"):
        assert e.events(name)[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert e.runner.loads == loads
    assert not e.core.stopped and e.fatal == []


def test_a_model_refused_at_load_fails_its_job_and_the_next_is_served(engine):
    """A model its registry refuses when it is to load (model_too_large): a 400 to
    its job; the core goes on, the next job's model resident."""
    e = engine(1, others={OTHER: 1})
    e.registry.too_large = frozenset({OTHER})
    e.submit("a")
    e.submit("x", model=OTHER)
    e.submit("z")
    e.run_until(lambda: e.all_ended() and e.idle())

    error = failed_with(e.events("x"))
    assert (error.status, error.code) == (400, "model_too_large") and e.kinds("x") == ["Failed"]
    assert e.events("z")[-1] == Finished("stop", len(PROMPT), ANSWER)
    assert OTHER not in e.runner.loads and e.runner.resident_id == MODEL


# --- idle unload (engine/core/keep_alive.py) -----------------------------------------------------------------


@pytest.mark.parametrize("engine_keep_alive, job_keep_alive, waiting, unloaded", [
    pytest.param(0.0, None, False, True, id="keep_alive-0"),
    pytest.param(math.inf, None, False, False, id="never"),
    pytest.param(3600.0, None, False, False, id="not-yet"),
    pytest.param(math.inf, 0.0, False, True, id="the-jobs-0-over-never"),
    pytest.param(0.0, math.inf, False, False, id="the-jobs-never-over-0"),
    pytest.param(0.0, None, True, False, id="a-job-waiting"),
])
def test_an_idle_model_is_given_back_after_its_keep_alive(engine, engine_keep_alive, job_keep_alive, waiting,
                                                          unloaded):
    e = engine(1, keep_alive_s=engine_keep_alive)
    e.submit("a", keep_alive_s=job_keep_alive)
    e.run_until(lambda: e.all_ended() and e.idle())
    if waiting:
        e.submit("b")
    e.core.idle()
    assert (e.runner.unloads == 1) is unloaded and (e.runner.resident_id is None) is unloaded
    assert e.core.idle_unload.unloaded_model == (MODEL if unloaded else None)
    assert e.core.counters["idle_unloads"] == (1 if unloaded else 0)
    e.submit("c")  # the next job loads it again
    e.run_until(lambda: e.all_ended() and e.idle())
    assert e.runner.resident_id == MODEL and e.core.idle_unload.unloaded_model is None
    assert len(e.runner.loads) == (2 if unloaded else 1)


# --- embedding requests --------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, chat_jobs, timeline", [
    pytest.param(1, ["a"], ["forward", "decode", "forward", "decode", "forward"], id="one-row"),
    pytest.param(4, ["a", "b"], ["forward", "decode", "forward", "decode", "forward"], id="a-batch"),
    pytest.param(1, [], ["forward", "forward", "forward"], id="nothing-running"),
])
def test_an_embedding_requests_forwards_alternate_with_decode_steps(engine, concurrency, chat_jobs, timeline):
    """A running answer waits one group of an embedding request's forwards
    between two of its tokens, never the whole request; with nothing else to
    do, the forwards run one after another."""
    e = engine(concurrency)
    e.runner.answer = 100
    for name in chat_jobs:
        e.submit(name, max_tokens=100)
    if chat_jobs:
        e.run_until(lambda: len(e.runner.steps) >= 2)
    e.runner.timeline.clear()
    job = e.embed("one two three", "four", "five six")
    e.run_until(job.future.done, max_steps=20)
    assert e.runner.timeline == timeline
    vectors, tokens = job.future.result(0)
    assert tokens == 6 and vectors[:, 0].tolist() == [3, 1, 2]
    assert e.core.counters["embedding_requests"] == 1 and e.core.counters["embedding_inputs"] == 3
    for name in chat_jobs:
        e.jobs[name].cancelled.set()
    e.run_until(lambda: e.all_ended() and e.idle())


def test_waiting_embedding_requests_for_one_model_run_as_one(engine):
    """Several clients' requests waiting together are one run (their inputs
    planned together), each answered with its own vectors; another model's
    request is not joined, nor one refused at its tokens."""
    e = engine(1)
    e.runner.answer = 100
    e.submit("a", max_tokens=100)
    e.run_until(lambda: len(e.runner.steps) >= 1)
    first, second = e.embed("one two", "three"), e.embed("four five six")
    other = e.embed("seven", model="other")
    e.run_until(lambda: first.future.done() and second.future.done(), max_steps=20)
    (v1, t1), (v2, t2) = first.future.result(0), second.future.result(0)
    assert v1[:, 0].tolist() == [2, 1] and t1 == 3 and v2[:, 0].tolist() == [3] and t2 == 3
    assert e.runner.encoder_loads == ["enc"] and not other.future.done()  # the other model's: the next run
    assert e.core.counters["embedding_requests"] == 2 and e.core.counters["embedding_inputs"] == 3
    e.run_until(other.future.done, max_steps=20)
    assert e.runner.encoder_loads == ["enc", "other"]
    e.jobs["a"].cancelled.set()
    e.run_until(lambda: e.all_ended() and e.idle())


def test_a_joined_request_refused_at_its_tokens_leaves_the_others(engine):
    e = engine(1)
    e.runner.answer = 100
    e.submit("a", max_tokens=100)
    e.run_until(lambda: len(e.runner.steps) >= 1)
    good, bad = e.embed("one two"), e.embed("x")
    object.__setattr__(bad, "inputs", [[-1]])  # ids the fake's tokenizer refuses
    e.run_until(good.future.done, max_steps=20)
    assert good.future.result(0)[1] == 2
    assert bad.future.exception(0).status == 400 and e.core.counters["embedding_requests"] == 1
    e.jobs["a"].cancelled.set()
    e.run_until(lambda: e.all_ended() and e.idle())


def test_embedding_requests_never_starve_the_running_answers(engine):
    """A flood of embedding requests alternates with the answer's steps."""
    e = engine(1)
    e.runner.answer = 100
    e.submit("a", max_tokens=100)
    e.run_until(lambda: len(e.runner.steps) >= 1)
    jobs = [e.embed(f"text {i}") for i in range(5)]
    for _ in range(10):
        e.core.step()
    assert all(j.future.done() for j in jobs) and len(e.runner.steps) >= 5


@pytest.mark.parametrize("fails_at, error, fatal", [
    pytest.param("load_encoder", EngineError(503, "no such folder", code="model_load_failed"), False, id="load"),
    pytest.param("embed", EngineError(400, "too long", code="context_length_exceeded"), False, id="refused"),
    pytest.param("embed", RuntimeError("[METAL] Command buffer execution failed"), True, id="mlx-fault"),
])
def test_an_embedding_failure_goes_to_its_request(engine, fails_at, error, fatal):
    e = engine(1)
    e.runner.failures[(fails_at, "enc")] = error
    job = e.embed("x")
    e.core.step()
    got = job.future.exception(0)
    assert isinstance(got, EngineError) and got.status == (500 if fatal else error.status)
    assert bool(e.fatal) is fatal and e.core.stopped is fatal


def test_the_encoder_is_one_at_a_time_and_given_back_with_the_idle_model(engine):
    e = engine(1)
    e.submit("a")
    e.run_until(lambda: e.all_ended() and e.idle())
    for model in ("enc", "enc", "other"):
        job = e.embed("x", model=model)
        e.run_until(job.future.done, max_steps=3)
        assert job.future.result(0)[1] == 1
    assert e.runner.encoder_loads == ["enc", "other"]  # the second asked for the resident one
    e.core.idle_unload.unload_at = 0.0  # keep_alive over
    e.core.idle()
    assert e.runner.encoder is None and e.runner.resident_id is None
    assert e.core.idle_unload.unloaded_model == MODEL and e.core.counters["idle_unloads"] == 1
    job = e.embed("y", keep_alive_s=0.0)  # an encoder alone is given back too
    e.run_until(job.future.done, max_steps=3)
    e.core.idle()
    assert job.future.done() and e.runner.encoder is None and e.core.counters["idle_unloads"] == 2


# --- the in-flight record --------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency, running", [
    pytest.param(1, ["a"], id="one-at-a-time"),
    pytest.param(4, ["a", "b", "c"], id="a-batch"),
])
def test_the_inflight_record_names_the_running_jobs_until_they_end(engine, tmp_path, concurrency, running):
    """The crash journal's record: every running job, oldest first, on disk before it
    runs; gone once nothing runs."""
    path = tmp_path / "engine.inflight.json"
    e = engine(concurrency, inflight_path=path)
    for name in ("a", "b", "c"):
        e.submit(name)
    e.run_until(lambda: e.held().get(running[-1]) is P)
    e.core.inflight.flush()  # written off the worker's thread

    record = InflightRequest.read(path)
    assert record is not None and record.model == MODEL
    assert record.all_requests() == tuple((i, e.jobs[i].fingerprint) for i in running)
    e.run_until(lambda: e.all_ended() and e.idle())
    e.core.inflight.flush()
    assert not path.exists()


@pytest.mark.parametrize("concurrency, jobs", [pytest.param(1, ["a"], id="one-row"), pytest.param(4, ["a", "b"],
                                                                                                   id="a-batch")])
def test_generated_tokens_are_counted_as_they_come(engine, concurrency, jobs):
    """The counter a rate is read from (the status page's tok/s) grows with every
    step, not at the answers' ends, and ends at every answer's tokens once."""
    e = engine(concurrency)
    e.runner.answer = 100
    for name in jobs:
        e.submit(name, max_tokens=100)
    e.run_until(lambda: len(e.runner.steps) >= 5)
    assert not any(e.ended(n) for n in jobs)
    running = e.core.counters["generated_tokens"]
    assert running >= 4 * len(jobs)
    e.run_until(lambda: len(e.runner.steps) >= 10)
    assert e.core.counters["generated_tokens"] > running
    e.run_until(lambda: e.all_ended() and e.idle())
    answered = sum(e.events(n)[-1].completion_tokens for n in jobs)
    assert e.core.counters["generated_tokens"] == answered == 100 * len(jobs)


# --- an answer's end held for its prompt on disk (engine/core/held_answers.py) ----------------------


class SlowDisk(PromptCache):
    """The prompt cache (disabled) with a disk that writes a row's prompt once
    its first token is out and lands a write only when the test says so
    (`land`); `waited`: what the core waited for, and how long at most."""

    def __init__(self) -> None:
        super().__init__(False, None, 0.0)
        self.under_way: set[str] = set()
        self.waited: list[tuple[str, float]] = []

    def checkpoint_rows(self, rows: list[Admitted]) -> None:  # in place of PromptTurns.checkpoint
        for a in rows:
            if a.first_token_at is not None and not getattr(a, "_written_once", False):
                a.checkpoint, a._written_once = f"prompt of {a.job.id}", True  # type: ignore[attr-defined]
                self.under_way.add(a.checkpoint)

    def land(self, job: str) -> None:
        self.under_way.discard(f"prompt of {job}")

    def written(self, writing: Any) -> bool:
        return writing not in self.under_way

    def await_write(self, writing: Any, limit_s: float) -> None:
        self.waited.append((writing, limit_s))  # a disk that does not land it in time


def slow_disk_engine(engine, concurrency: int = 2) -> tuple[Engine, SlowDisk]:
    e = engine(concurrency)
    e.runner.answer = 100  # max_tokens ends each answer
    disk = SlowDisk()
    e.core.use_prompt_cache(disk)
    e.core.turns.checkpoint = disk.checkpoint_rows  # type: ignore[method-assign]
    return e, disk


def deltas(e: Engine, name: str) -> int:
    return sum(isinstance(x, Delta) for x in e.events(name))


def test_a_slow_checkpoint_holds_its_answers_end_and_no_other_rows_tokens(engine):
    """A short answer ends before its prompt's write lands: its end is held
    (not waited for under the step) while the other row gets a token every
    step; it goes out at the first step after the write lands, whole."""
    e, disk = slow_disk_engine(engine)
    e.submit("short", max_tokens=2)
    e.submit("long", max_tokens=30)
    e.run_until(lambda: deltas(e, "short") == 2)  # its last token is out
    assert deltas(e, "short") == 2 and not e.ended("short") and len(e.core.held) == 1
    assert "short" not in e.held()  # the request is let go (its memory, its slot): only its end waits
    before = deltas(e, "long")
    for _ in range(5):
        e.core.step()
    assert deltas(e, "long") == before + 5 and not e.ended("short")  # a token a step meanwhile
    disk.land("short")
    e.core.step()
    assert e.kinds("short") == ["Started", "Delta", "Delta", "Finished"] and not e.ended("long")
    disk.land("long")
    e.run_until(lambda: e.all_ended() and e.idle() and not e.core.held)
    assert e.events("long")[-1].completion_tokens == 30 and disk.waited == []  # never waited under a step


def test_a_held_end_goes_out_after_the_wait_limit_or_when_its_client_leaves(engine, monkeypatch):
    """A write that never lands costs the disk tier, not the answer: its end
    goes out CHECKPOINT_WAIT_S after it ended; one whose client left goes at once."""
    clock = [1000.0]
    monkeypatch.setattr(held_answers, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    e, disk = slow_disk_engine(engine, concurrency=3)
    for name, max_tokens in (("a", 2), ("b", 2), ("long", 40)):
        e.submit(name, max_tokens=max_tokens)
    e.run_until(lambda: len(e.core.held) == 2)
    clock[0] += held_answers.CHECKPOINT_WAIT_S - 0.01
    e.core.step()
    assert not e.ended("a") and not e.ended("b")
    e.jobs["b"].cancelled.set()  # its client is gone: nothing to wait for
    e.core.step()
    assert not e.ended("a") and e.ended("b")
    clock[0] += 0.01
    e.core.step()
    assert e.kinds("a")[-1] == "Finished" and not e.ended("long")
    assert disk.waited == []


def test_with_no_row_left_a_held_end_is_waited_for_before_the_next_request_starts(engine):
    """No row decodes and a request is to start (its load or prefill runs
    under one step): the end held is waited for (at most its limit) and sent
    first. With nothing to do, the step polls instead of waiting 0.25 s."""
    e, disk = slow_disk_engine(engine)
    e.submit("a", max_tokens=2)
    e.run_until(lambda: len(e.core.held) == 1 and not e.runner.rows)
    started = time.monotonic()
    e.core.step()  # nothing else to do: a poll of the queue, not a wait of WAIT_S
    assert time.monotonic() - started < engine_core.WAIT_S / 2 and not e.ended("a")
    e.submit("b", max_tokens=2)
    e.core.step()
    assert [w for w, _ in disk.waited] == ["prompt of a"] and 0 < disk.waited[0][1] <= 1.0
    assert e.kinds("a")[-1] == "Finished" and not e.core.held and e.events("b") == []
    e.run_until(lambda: e.all_ended())


def test_an_mlx_fault_sends_the_held_ends_and_fails_the_rest(engine):
    """A held answer is complete: an MLX fault of another row fails that row,
    and the held end still goes out (after its prompt's write, bounded)."""
    e, disk = slow_disk_engine(engine)
    e.submit("short", max_tokens=2)
    e.submit("long", max_tokens=30)
    e.run_until(lambda: len(e.core.held) == 1)
    e.runner.failures[("step", "long")] = RuntimeError("[METAL] fake")
    e.run_until(lambda: e.core.stopped)
    assert e.kinds("short")[-1] == "Finished" and failed_with(e.events("long")).code == "mlx_error"
    assert [w for w, _ in disk.waited] == ["prompt of short"] and not e.core.held
