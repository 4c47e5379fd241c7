"""mlxd.models: the memory budget's source as a table, and the child
process that asks Metal on the gateway's behalf."""

import sys

import pytest

from mlxd.models import TOTAL_ENV, metal_working_set, metal_working_set_in_child, system_memory_budget

GIB = 1024**3


@pytest.mark.parametrize("env_total, metal, expected", [
    (str(64 * GIB), 48 * GIB, (48 * GIB, TOTAL_ENV)),  # the override wins
    (None, 48 * GIB, (36 * GIB, "Metal recommended working set")),
    (None, None, (None, "physical memory")),  # no Metal: psutil's total
])
def test_where_the_budget_comes_from(monkeypatch, env_total, metal, expected):
    if env_total is None:
        monkeypatch.delenv(TOTAL_ENV, raising=False)
    else:
        monkeypatch.setenv(TOTAL_ENV, env_total)
    budget, source = system_memory_budget(0.75, lambda: metal)
    assert source == expected[1]
    if expected[0] is not None:
        assert budget == expected[0]
    else:
        import psutil

        assert budget == int(psutil.virtual_memory().total * 0.75)


def test_the_child_process_sees_what_this_process_sees(caplog):
    # "darwin" forces the child even here, so its code path runs everywhere.
    assert metal_working_set_in_child("darwin") == metal_working_set()
    assert "could not ask" not in caplog.text
    assert metal_working_set_in_child("linux") is None  # no Metal off macOS: no child at all
    assert sys.platform == "darwin" or metal_working_set() is None
