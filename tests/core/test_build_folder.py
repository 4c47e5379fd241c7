"""A folder built once, atomically (mlxd.paths.build_folder_once): its pure
decisions as tables (whose temp a name is, whether its builder is gone),
then the behaviour: a complete folder is never rebuilt, a failed build
leaves nothing, a stale one is replaced and a foreign one refused, two
builders at once leave one whole folder, and a dead builder's leftovers
(its pid gone, or reused since) are removed while a live one's are kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxd.paths import build_folder_once, builder_gone, remove_dead_temps, temp_name, temp_pid


@pytest.mark.parametrize("name, target, pid", [
    (".demo-a.123.ab12cd34.tmp", "demo-a", 123),                 # a folder build's temp
    (".engine.pid.77.k2j4_x9q.tmp", "engine.pid", 77),           # write_atomic's temp file
    (".model.5.123.abc.tmp", "model.5", 123),                    # a target ending in .<digits>
    (".model.5.123.abc.tmp", "model", None),                     # ... is not the temp of `model`
    (".engine.pid.x.77.k2j4_x9q.tmp", "engine.pid", None),       # the temp of `engine.pid.x`
    (".engine.77.k2j4_x9q.tmp", "engine.pid", None),             # the temp of `engine`
    (".demo-a.notapid.ab12.tmp", "demo-a", None),
    (".demo-a.123.tmp", "demo-a", None),                         # no tag
    (".demo-a.123.ab.cd.tmp", "demo-a", None),                   # a tag has no dot
    ("demo-a.123.ab12cd34.tmp", "demo-a", None),                 # not hidden
    (".demo-a.123.ab12cd34.tmpx", "demo-a", None),
    (".demo-a.123.ab12cd34.tmp", None, 123),                     # any target's
    (".x.y.9.tag.tmp", None, 9),
    ("demo-a", None, None),
])
def test_temp_pid_reads_only_the_temps_of_the_target(name, target, pid):
    assert temp_pid(name, target) == pid


def test_temp_name_reads_back():
    assert temp_pid(temp_name("demo-a", 4242, "cafe0123"), "demo-a") == 4242


@pytest.mark.parametrize("started, mtime, gone", [
    (None, 1000.0, True),                # no process has the pid (or a zombie has it)
    (900.0, 1000.0, False),              # its builder, started before it wrote the temp
    (1000.5, 1000.0, False),             # within create_time's second: taken as its builder
    (1001.5, 1000.0, True),              # started after the temp last changed: the pid was reused
    (float("-inf"), 1000.0, False),      # someone else's process, start unknown: taken as alive
])
def test_builder_gone_table(started, mtime, gone):
    assert builder_gone(started, mtime) is gone


def write(name: str, text: str = "x"):
    def build_into(folder: Path) -> None:
        (folder / name).write_text(text)
    return build_into


def has(name: str):
    return lambda folder: (folder / name).is_file()


def test_a_complete_folder_is_not_built_again(tmp_path):
    dest = tmp_path / "m"
    assert build_folder_once(dest, write("done", "1"), has("done")) is True
    assert build_folder_once(dest, write("done", "2"), has("done")) is False
    assert (dest / "done").read_text() == "1" and os.listdir(tmp_path) == ["m"]


def test_a_failed_build_leaves_nothing(tmp_path):
    def fail(folder: Path) -> None:
        (folder / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_folder_once(tmp_path / "m", fail, has("done"))
    assert os.listdir(tmp_path) == []


def test_a_stale_folder_is_replaced_and_a_foreign_one_refused_before_building(tmp_path):
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "half").write_text("x")
    assert build_folder_once(stale, write("done"), has("done"), replaceable=has("half"))
    assert sorted(os.listdir(stale)) == ["done"] and os.listdir(tmp_path) == ["stale"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    built = []
    with pytest.raises(FileExistsError):
        build_folder_once(foreign, built.append, has("done"), replaceable=has("half"))
    assert built == [] and (foreign / "notes.txt").read_text() == "precious"
    (tmp_path / "file").write_text("a file")
    with pytest.raises(FileExistsError):
        build_folder_once(tmp_path / "file", built.append, has("done"))


def test_a_builder_that_loses_the_race_keeps_the_winners_build(tmp_path):
    dest = tmp_path / "m"

    def build_then_lose(folder: Path) -> None:
        (folder / "done").write_text("loser")
        build_folder_once(dest, write("done", "winner"), has("done"))  # another builder finishes first

    assert build_folder_once(dest, build_then_lose, has("done")) is False
    assert (dest / "done").read_text() == "winner" and os.listdir(tmp_path) == ["m"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    return p.pid


@pytest.mark.integration  # starts processes
def test_a_dead_builders_leftovers_are_removed_and_a_live_ones_kept(tmp_path):
    dead, me = _dead_pid(), os.getpid()
    left = {name: tmp_path / name for name in (
        temp_name("m", dead, "dead0000"),      # its builder was killed
        temp_name("m", me, "old00000"),        # this pid, from a process before this one (reused)
        temp_name("m", me, "live0000"),        # a live builder (a thread of ours) at work
        temp_name("other", dead, "dead0000"),  # another folder's: left to its own next build
    )}
    for path in left.values():
        path.mkdir()
        (path / "half").write_text("x")
    old = time.time() - 10**6
    os.utime(left[temp_name("m", me, "old00000")], (old, old))
    build_folder_once(tmp_path / "m", write("done"), has("done"))
    assert sorted(os.listdir(tmp_path)) == sorted(["m", temp_name("m", me, "live0000"),
                                                   temp_name("other", dead, "dead0000")])
    assert remove_dead_temps(tmp_path) == [tmp_path / temp_name("other", dead, "dead0000")]  # any target's


BUILDER = """
import sys, time
from pathlib import Path
from mlxd.paths import build_folder_once

dest, started, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

def build_into(folder):
    (folder / "weights").write_text(sys.argv[4] * 100_000)
    started.joinpath(sys.argv[4]).touch()
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:  # both builders mid-build at once
        time.sleep(0.01)
    (folder / "done").write_text(sys.argv[4])

print(build_folder_once(dest, build_into, lambda f: (f / "done").is_file()))
"""


@pytest.mark.integration  # starts processes
def test_two_builders_at_once_leave_one_whole_folder(tmp_path):
    dest, started, go = tmp_path / "out" / "m", tmp_path / "started", tmp_path / "go"
    started.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(dest), str(started), str(go), tag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in "ab"]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(started)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(os.listdir(started)) == ["a", "b"]
        assert len(os.listdir(dest.parent)) == 2  # two temp folders, no `m` yet
        go.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.strip() for out, _ in outs) == ["False", "True"]  # one put its build in place
    winner = (dest / "done").read_text()
    assert (dest / "weights").read_text() == winner * 100_000
    assert os.listdir(dest.parent) == ["m"]
