"""bench/idle_unload.py's pure part: the share of what loading took that the unload gave back."""

from __future__ import annotations

import pytest

from testkit import load_bench

idle = load_bench("idle_unload")


@pytest.mark.parametrize("base, loaded, after, share", [
    (100, 700, 100, 1.0), (100, 700, 130, 0.95), (100, 700, 700, 0.0), (100, 100, 100, None),
])
def test_returned_share(base, loaded, after, share):
    got = idle.returned_share(base, loaded, after)
    assert got == share if share is None else got == pytest.approx(share)
