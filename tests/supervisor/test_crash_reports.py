"""Crash reports: parse_ips on hand-written samples, find_report on a folder
of them (mtimes set with os.utime; no waiting)."""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from mlxd.supervisor import crash_reports
from mlxd.supervisor.crash_reports import (
    default_reports_dir, find_report, is_metal_abort, is_metal_oom, parse_ips, summary,
)

SAMPLES = Path(__file__).parent / "samples"
OOM_MESSAGE = ("terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
               "buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)")


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def two_part(body: dict, bug_type: str = "309") -> str:
    header = {"app_name": "python3.11", "timestamp": "2026-11-21 12:01:02.00 +0100",
              "bug_type": bug_type, "name": "python3.11"}
    return json.dumps(header) + "\n" + json.dumps(body, indent=2)


def with_asi(name: str, asi: dict) -> str:
    header, _, body = sample(name).partition("\n")
    parsed = json.loads(body)
    parsed["asi"] = asi
    return header + "\n" + json.dumps(parsed)


# --- parse_ips on the samples -------------------------------------------------

@pytest.mark.parametrize("name, field, expected", [
    ("mlx_metal_abort.ips", "pid", 4242),
    ("mlx_metal_abort.ips", "process_name", "python3.11"),
    ("mlx_metal_abort.ips", "process_path",
     "/Users/USER/.local/share/uv/python/cpython-3.11.10-macos-aarch64-none/bin/python3.11"),
    ("mlx_metal_abort.ips", "exception_type", "EXC_CRASH"),
    ("mlx_metal_abort.ips", "signal", "SIGABRT"),
    ("mlx_metal_abort.ips", "termination_indicator", "Abort trap: 6"),
    ("mlx_metal_abort.ips", "asi_messages", ("abort() called", OOM_MESSAGE)),
    ("mlx_metal_abort.ips", "faulting_thread_index", 3),
    ("mlx_metal_abort.ips", "faulting_thread_queue", "com.Metal.CompletionQueueDispatch"),
    ("mlx_metal_abort.ips", "first_mlx_frame", "mlx::core::gpu::check_error(MTL::CommandBuffer*) (libmlx.dylib)"),
    ("other_abort.ips", "pid", 5151),
    ("other_abort.ips", "process_name", "Python"),
    ("other_abort.ips", "signal", "SIGABRT"),
    ("other_abort.ips", "asi_messages", ("abort() called",)),
    ("other_abort.ips", "faulting_thread_index", 0),
    ("other_abort.ips", "faulting_thread_queue", "com.apple.main-thread"),
    # MLX is loaded and on another thread's stack, but not on the faulting one.
    ("other_abort.ips", "first_mlx_frame", None),
])
def test_parse_sample_fields(name, field, expected):
    report = parse_ips(sample(name))
    assert report is not None
    assert getattr(report, field) == expected


def test_capture_time_is_timezone_aware():
    report = parse_ips(sample("mlx_metal_abort.ips"))
    assert report.capture_time.utcoffset() == timedelta(hours=1)
    assert report.capture_time.isoformat() == "2026-11-21T12:01:02.123400+01:00"


def test_top_frames_are_the_faulting_threads_innermost_eight():
    report = parse_ips(sample("mlx_metal_abort.ips"))
    assert report.top_frames == (
        "__pthread_kill (libsystem_kernel.dylib)",
        "pthread_kill (libsystem_pthread.dylib)",
        "abort (libsystem_c.dylib)",
        "__abort_message (libc++abi.dylib)",
        "demangling_terminate_handler() (libc++abi.dylib)",
        "_objc_terminate() (libobjc.A.dylib)",
        "std::__terminate(void (*)()) (libc++abi.dylib)",
        "__cxxabiv1::failed_throw(__cxxabiv1::__cxa_exception*) (libc++abi.dylib)",
    )


@pytest.mark.parametrize("text", [
    sample("legacy_or_garbage.ips"),
    "",
    "not json at all\n{}",
    "[1, 2, 3]",
    sample("mlx_metal_abort.ips").partition("\n")[0],          # header alone
    sample("mlx_metal_abort.ips")[:5000],                      # truncated body
    two_part({"pid": 4242, "bug_type": "288"}, bug_type="288"),  # a stackshot, not a crash
    two_part({"procName": "python3.11"}),                      # no pid
    two_part({"pid": "4242"}),                                 # pid of the wrong type
])
def test_not_a_crash_report(text):
    assert parse_ips(text) is None


def test_single_json_object_is_accepted():
    body = sample("mlx_metal_abort.ips").partition("\n")[2]
    report = parse_ips(body)
    assert report is not None
    assert (report.pid, report.first_mlx_frame) == (
        4242, "mlx::core::gpu::check_error(MTL::CommandBuffer*) (libmlx.dylib)")


def _body(frames: list[dict], images: list[dict], **extra) -> dict:
    return {"pid": 7, "threads": [{"frames": frames, "triggered": True}], "usedImages": images, **extra}


@pytest.mark.parametrize("image, symbol, expected", [
    # mlx's Python extension is recognised by its folder...
    ({"name": "core.cpython-311-darwin.so",
      "path": "/Users/USER/mlxd/.venv/lib/python3.11/site-packages/mlx/core.cpython-311-darwin.so"},
     "nanobind::detail::nb_func_vectorcall_complex", "nanobind::detail::nb_func_vectorcall_complex (core.cpython-311-darwin.so)"),
    # ...but a folder merely containing "mlx" (our own checkout) is not mlx.
    ({"name": "_multiarray_umath.cpython-311-darwin.so",
      "path": "/Users/USER/mlxd/.venv/lib/python3.11/site-packages/numpy/_core/_multiarray_umath.cpython-311-darwin.so"},
     "PyArray_Free", None),
    # an mlx:: symbol counts wherever it lives; redacted paths still match by name.
    ({"name": "libfoo.dylib", "path": "/usr/local/lib/libfoo.dylib"},
     "mlx::core::eval_impl(...)", "mlx::core::eval_impl(...) (libfoo.dylib)"),
    ({"name": "libmlx.dylib", "path": "/Users/USER/*/libmlx.dylib"},
     "mlx::core::metal::Device::Device()", "mlx::core::metal::Device::Device() (libmlx.dylib)"),
])
def test_first_mlx_frame_rules(image, symbol, expected):
    frames = [{"imageIndex": 0, "imageOffset": 16, "symbol": "__pthread_kill"},
              {"imageIndex": 1, "imageOffset": 32, "symbol": symbol}]
    images = [{"name": "libsystem_kernel.dylib", "path": "/usr/lib/system/libsystem_kernel.dylib"}, image]
    report = parse_ips(two_part(_body(frames, images)))
    assert report.first_mlx_frame == expected


def test_faulting_thread_falls_back_to_triggered_and_unsymbolicated_frames_show_offsets():
    body = {"pid": 7, "threads": [
        {"frames": [{"imageIndex": 0, "imageOffset": 1, "symbol": "idle"}], "queue": "q.idle"},
        {"frames": [{"imageIndex": 0, "imageOffset": 0x3f20}, {"imageIndex": 9, "imageOffset": 4, "symbol": "x"}],
         "triggered": True, "queue": "q.crashed"},
    ], "usedImages": [{"name": "libmlx.dylib", "path": "/x/mlx/lib/libmlx.dylib"}]}
    report = parse_ips(two_part(body))
    assert (report.faulting_thread_index, report.faulting_thread_queue) == (1, "q.crashed")
    assert report.top_frames == ("0x3f20 (libmlx.dylib)", "x (???)")
    assert report.first_mlx_frame == "0x3f20 (libmlx.dylib)"


def test_capture_time_falls_back_to_header_timestamp():
    report = parse_ips(two_part({"pid": 7}))
    assert report.capture_time.isoformat() == "2026-11-21T12:01:02+01:00"


# --- classification and summary -----------------------------------------------

def test_metal_abort_and_oom():
    metal = parse_ips(sample("mlx_metal_abort.ips"))
    plain = parse_ips(sample("other_abort.ips"))
    assert (is_metal_abort(metal), is_metal_oom(metal)) == (True, True)
    assert (is_metal_abort(plain), is_metal_oom(plain)) == (False, False)


def test_metal_abort_without_oom_message():
    """Often the report only says "abort() called"; the fault site still shows
    the Metal abort, and the OOM text must come from the engine's stderr."""
    report = parse_ips(with_asi("mlx_metal_abort.ips", {"libsystem_c.dylib": ["abort() called"]}))
    assert (is_metal_abort(report), is_metal_oom(report)) == (True, False)
    assert summary(report) == ("EXC_CRASH SIGABRT in mlx::core::gpu::check_error(MTL::CommandBuffer*) "
                               "(libmlx.dylib) on com.Metal.CompletionQueueDispatch: abort() called")


@pytest.mark.parametrize("name, expected", [
    ("mlx_metal_abort.ips",
     "EXC_CRASH SIGABRT in mlx::core::gpu::check_error(MTL::CommandBuffer*) (libmlx.dylib) "
     f"on com.Metal.CompletionQueueDispatch: {OOM_MESSAGE}"),
    # no mlx frame: the first frame past the abort() machinery.
    ("other_abort.ips", "EXC_CRASH SIGABRT in os_abort (Python) on com.apple.main-thread: abort() called"),
])
def test_summary(name, expected):
    assert summary(parse_ips(sample(name))) == expected


def test_summary_is_one_bounded_line():
    report = parse_ips(with_asi("mlx_metal_abort.ips", {"libc++abi.dylib": ["line one\nline two " + "x" * 1000]}))
    line = summary(report, limit=200)
    assert "\n" not in line and len(line) == 200 and line.endswith("…")


def test_default_reports_dir():
    assert default_reports_dir() == Path.home() / "Library" / "Logs" / "DiagnosticReports"


# --- find_report --------------------------------------------------------------

METAL_DIED_AT = parse_ips(sample("mlx_metal_abort.ips")).capture_time.timestamp()


def put(folder: Path, sample_name: str, as_name: str, mtime: float) -> Path:
    path = folder / as_name
    shutil.copyfile(SAMPLES / sample_name, path)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    """A DiagnosticReports-like folder around the death of pid 4242."""
    t = METAL_DIED_AT
    put(tmp_path, "other_abort.ips", "Python-2026-11-21-120340.ips", t + 158)
    put(tmp_path, "legacy_or_garbage.ips", "python3.11-2026-11-21-120104.ips", t + 4)  # pid 4242, not parseable
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-21-120102.ips", t + 2)
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-20-093015.ips", t - 86400)  # same pid, a day old
    (tmp_path / "python3.11-2026-11-21-120103.crash").write_text(sample("mlx_metal_abort.ips"))  # not .ips
    os.utime(tmp_path / "python3.11-2026-11-21-120103.crash", (t + 3, t + 3))
    (tmp_path / "folder.ips").mkdir()
    (tmp_path / "dangling.ips").symlink_to(tmp_path / "gone.ips")  # stat fails: skipped
    return tmp_path


def test_find_report_picks_the_pid_in_the_window(reports):
    found = find_report(reports, 4242, METAL_DIED_AT)
    assert found is not None
    path, report = found
    assert path.name == "python3.11-2026-11-21-120102.ips"
    assert report.pid == 4242 and report.first_mlx_frame is not None


def test_find_report_other_pid(reports):
    died_at = parse_ips(sample("other_abort.ips")).capture_time.timestamp()
    path, report = find_report(reports, 5151, died_at)
    assert path.name == "Python-2026-11-21-120340.ips" and report.first_mlx_frame is None


def test_find_report_ignores_a_matching_pid_outside_the_window(reports):
    (reports / "python3.11-2026-11-21-120102.ips").unlink()
    assert (reports / "python3.11-2026-11-20-093015.ips").exists()
    assert find_report(reports, 4242, METAL_DIED_AT) is None


def test_find_report_checks_capture_time_not_just_mtime(tmp_path):
    """A report copied or touched later (recent mtime) but captured a day
    before this death is not this death's report."""
    later = METAL_DIED_AT + 86400
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-21-120102.ips", later + 1)
    assert find_report(tmp_path, 4242, later) is None
    assert find_report(tmp_path, 4242, later, window_s=2 * 86400) is not None


def test_find_report_unknown_pid(reports):
    assert find_report(reports, 9999, METAL_DIED_AT) is None


def test_find_report_missing_folder(tmp_path):
    assert find_report(tmp_path / "no-such-folder", 4242, METAL_DIED_AT) is None


def test_find_report_skips_garbage_newer_than_the_real_report(tmp_path):
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-21-120102.ips", METAL_DIED_AT + 2)
    (tmp_path / "python3.11-2026-11-21-120105.ips").write_bytes(b"\xff\xfe\x00garbage\n{")
    os.utime(tmp_path / "python3.11-2026-11-21-120105.ips", (METAL_DIED_AT + 5, METAL_DIED_AT + 5))
    path, _ = find_report(tmp_path, 4242, METAL_DIED_AT)
    assert path.name == "python3.11-2026-11-21-120102.ips"


def test_find_report_skips_oversized_files(tmp_path, monkeypatch):
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-21-120102.ips", METAL_DIED_AT + 2)
    assert find_report(tmp_path, 4242, METAL_DIED_AT) is not None
    monkeypatch.setattr(crash_reports, "MAX_REPORT_BYTES", 1000)
    assert find_report(tmp_path, 4242, METAL_DIED_AT) is None


def test_find_report_reads_only_the_newest_files(tmp_path, monkeypatch):
    put(tmp_path, "mlx_metal_abort.ips", "python3.11-2026-11-21-120102.ips", METAL_DIED_AT + 2)
    put(tmp_path, "other_abort.ips", "Python-a.ips", METAL_DIED_AT + 3)
    put(tmp_path, "other_abort.ips", "Python-b.ips", METAL_DIED_AT + 4)
    monkeypatch.setattr(crash_reports, "MAX_FILES", 2)
    assert find_report(tmp_path, 4242, METAL_DIED_AT) is None
    monkeypatch.setattr(crash_reports, "MAX_FILES", 3)
    assert find_report(tmp_path, 4242, METAL_DIED_AT) is not None
