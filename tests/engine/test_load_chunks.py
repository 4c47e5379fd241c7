"""The engine's weight load reads a model a chunk at a time (engine/model/model_load.py
`evaluate_in_chunks`): how parameters are grouped, as a table (pure)."""

from __future__ import annotations

import pytest

from mlxd.engine.model.model_load import load_chunks


@pytest.mark.parametrize("sizes, limit, expected", [
    ([10, 10, 10, 10], 20, [[0, 1], [2, 3]]),
    ([10, 10, 10], 20, [[0, 1], [2]]),  # the rest is a chunk of its own
    ([50, 5, 5], 20, [[0], [1, 2]]),  # larger than the limit: alone
    ([5, 5, 50, 5], 20, [[0, 1, 2], [3]]),
    ([], 20, []),
    ([1, 2, 3], 1, [[0], [1], [2]]),
])
def test_chunks_group_parameters_up_to_the_limit(sizes, limit, expected):
    assert load_chunks(sizes, limit) == expected
