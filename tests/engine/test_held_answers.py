"""When an answer's end waits for its prompt on disk (engine/core/held_answers.py):
its decisions as tables. The core's use of them (rows decoding meanwhile, the
wait limit, a fault, an empty batch) is test_engine_core.py's; a real engine's
(a slow disk, kill -9 the moment an answer arrives) test_prompt_cache.py's."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from mlxd.engine.model.decoder_rows import Ended
from mlxd.engine.core.held_answers import CHECKPOINT_WAIT_S, Held, HeldAnswers, due, must_hold


def ended(finish: str = "stop", cancelled: bool = False) -> Ended:
    job = SimpleNamespace(id="r", cancelled=threading.Event())
    if cancelled:
        job.cancelled.set()
    return Ended(SimpleNamespace(job=job), finish, ["its KV"])  # type: ignore[arg-type]


@pytest.mark.parametrize("writing, finish, cancelled, written, held", [
    pytest.param(None, "stop", False, False, False, id="no-checkpoint-nothing-to-wait-for"),
    pytest.param("w", "stop", False, True, False, id="written-already"),
    pytest.param("w", "stop", False, False, True, id="under-way-held"),
    pytest.param("w", "length", False, False, True, id="cut-by-max-tokens-held-too"),
    pytest.param("w", "cancelled", False, False, False, id="a-cancelled-answer-is-no-complete-answer"),
    pytest.param("w", "stop", True, False, False, id="its-client-is-gone"),
])
def test_which_ends_are_held(writing, finish, cancelled, written, held):
    assert must_hold(writing, finish, cancelled, lambda w: written) is held


@pytest.mark.parametrize("after_s, cancelled, written, goes", [
    pytest.param(0.0, False, False, False, id="just-ended"),
    pytest.param(CHECKPOINT_WAIT_S - 0.001, False, False, False, id="just-before-the-limit"),
    pytest.param(CHECKPOINT_WAIT_S, False, False, True, id="the-limit-a-slow-disk-costs-the-disk-tier"),
    pytest.param(0.1, False, True, True, id="written"),
    pytest.param(0.1, True, False, True, id="its-client-left"),
])
def test_when_a_held_end_goes(after_s, cancelled, written, goes):
    h = Held(ended(cancelled=cancelled), "w", 100.0 + CHECKPOINT_WAIT_S)  # type: ignore[arg-type]
    assert due(h, 100.0 + after_s, lambda w: written) is goes


class Disk:
    def __init__(self, landed: set[str]) -> None:
        self.landed, self.waited = landed, []

    def written(self, w: str) -> bool:
        return w in self.landed

    def await_write(self, w: str, limit_s: float) -> None:
        self.waited.append(w)
        self.landed.add(w)


def test_each_end_is_sent_once_whatever_ends_its_hold():
    disk, sent = Disk({"w1"}), []
    held = HeldAnswers(lambda: disk, lambda e: sent.append(e))
    e1, e2, e3 = ended(), ended(), ended()
    assert held.end(e1, "w1") is False and sent == [e1]  # written already: at once, as it is
    assert held.end(e2, "w2", now=0.0) is True and held.end(e3, "w3") is True and len(held) == 2
    held.send_due(now=0.5)
    assert sent == [e1]
    disk.landed.add("w2")
    held.send_due(now=0.5)
    assert sent[-1].admitted is e2.admitted and sent[-1].kv is None and len(held) == 1  # held without its KV
    held.step(wait=True)  # no row decodes and work is to start: waited for (within its limit), then sent
    assert disk.waited == ["w3"] and sent[-1].admitted is e3.admitted and len(held) == 0
    held.send_all()
    assert len(sent) == 3
