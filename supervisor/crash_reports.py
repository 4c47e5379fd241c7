"""macOS crash reports: what killed the engine, and where (pure parsing, thin I/O).

supervisord cannot tell us why the engine died: its events carry no exit
status or signal, let alone the fault site. On macOS, ReportCrash writes a
report to ~/Library/Logs/DiagnosticReports/ for a process killed by a crash
signal, naming the signal, the faulting thread, its queue and stack, and the
"Application Specific Information" (e.g. libc++abi's uncaught-exception
message). The crash listener finds the dead engine's report by pid and puts a
one-line summary of it in the crash journal.

The `.ips` format (macOS 12+) is two JSON objects: the first line is the IPS
metadata (`bug_type` "309" for a crash report), the rest is the report body
(`pid`, `procName`, `captureTime`, `exception`, `termination`, `asi`,
`faultingThread`, `threads[].frames[]` with `imageIndex` into `usedImages`).
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath

CRASH_BUG_TYPE = "309"
MAX_FILES = 50  # newest reports looked at per lookup
MAX_REPORT_BYTES = 4 * 1024 * 1024  # real reports are tens to hundreds of KB
TOP_FRAMES = 8
_OOM = re.compile(r"kIOGPUCommandBufferCallbackErrorOutOfMemory|Insufficient Memory")
# Images of the abort()/terminate machinery: the summary names the first frame past them.
_PLUMBING = ("libsystem_kernel.dylib", "libsystem_pthread.dylib", "libsystem_c.dylib",
             "libsystem_platform.dylib", "libc++abi.dylib", "libobjc.A.dylib")


@dataclass(frozen=True)
class CrashReport:
    pid: int
    process_name: str | None
    process_path: str | None
    capture_time: datetime | None  # timezone-aware
    exception_type: str | None  # e.g. "EXC_CRASH"
    signal: str | None  # e.g. "SIGABRT"
    termination_indicator: str | None  # e.g. "Abort trap: 6"
    asi_messages: tuple[str, ...]
    faulting_thread_index: int | None
    faulting_thread_queue: str | None  # e.g. "com.Metal.CompletionQueueDispatch"
    first_mlx_frame: str | None  # "symbol (image)"
    top_frames: tuple[str, ...]  # "symbol (image)", innermost first


def default_reports_dir() -> Path:
    return Path.home() / "Library" / "Logs" / "DiagnosticReports"


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    for fmt in ("%Y-%m-%d %H:%M:%S.%f %z", "%Y-%m-%d %H:%M:%S %z"):
        try:
            return datetime.strptime(value.strip(), fmt)
        except ValueError:
            pass
    return None


def _split(text: str) -> tuple[dict, dict] | None:
    """(header, body); header is {} for a file that is one JSON object."""
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return {}, whole
    first, _, rest = text.lstrip("\ufeff").partition("\n")
    try:
        header, body = json.loads(first), json.loads(rest)
    except ValueError:
        return None
    if not isinstance(header, dict) or not isinstance(body, dict):
        return None
    return header, body


def _is_mlx_image(image: dict) -> bool:
    name, path = str(image.get("name") or ""), str(image.get("path") or "")
    return "mlx" in name.lower() or "mlx" in PurePosixPath(path).parts


def parse_ips(text: str) -> CrashReport | None:
    """The crash report in an .ips file's text, or None when it is not one."""
    parts = _split(text)
    if parts is None:
        return None
    header, body = parts
    if str(body.get("bug_type", header.get("bug_type", CRASH_BUG_TYPE))) != CRASH_BUG_TYPE:
        return None
    pid = body.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None

    images = [i if isinstance(i, dict) else {} for i in body.get("usedImages") or []]
    threads = [t for t in body.get("threads") or [] if isinstance(t, dict)]
    index = body.get("faultingThread")
    if not (isinstance(index, int) and 0 <= index < len(threads)):
        index = next((n for n, t in enumerate(threads) if t.get("triggered")), None)
    thread = threads[index] if index is not None else {}

    frames: list[str] = []
    first_mlx = None
    for frame in thread.get("frames") or []:
        if not isinstance(frame, dict):
            continue
        i = frame.get("imageIndex")
        image = images[i] if isinstance(i, int) and 0 <= i < len(images) else {}
        offset = frame.get("imageOffset")
        symbol = frame.get("symbol") or (f"0x{offset:x}" if isinstance(offset, int) else "???")
        shown = f"{symbol} ({image.get('name') or '???'})"
        frames.append(shown)
        if first_mlx is None and (_is_mlx_image(image) or str(symbol).startswith("mlx::")):
            first_mlx = shown

    asi = body.get("asi") if isinstance(body.get("asi"), dict) else {}
    messages = [m for v in asi.values() for m in (v if isinstance(v, list) else [v])]
    exception = body.get("exception") if isinstance(body.get("exception"), dict) else {}
    termination = body.get("termination") if isinstance(body.get("termination"), dict) else {}
    return CrashReport(
        pid=pid,
        process_name=body.get("procName") or header.get("app_name"),
        process_path=body.get("procPath"),
        capture_time=_parse_time(body.get("captureTime")) or _parse_time(header.get("timestamp")),
        exception_type=exception.get("type"),
        signal=exception.get("signal"),
        termination_indicator=termination.get("indicator"),
        asi_messages=tuple(str(m) for m in messages),
        faulting_thread_index=index,
        faulting_thread_queue=thread.get("queue"),
        first_mlx_frame=first_mlx,
        top_frames=tuple(frames[:TOP_FRAMES]),
    )


def is_metal_abort(report: CrashReport) -> bool:
    """MLX aborted from a Metal completion handler (gpu::check_error threw)."""
    frame = report.first_mlx_frame or ""
    return report.signal == "SIGABRT" and (
        "check_error" in frame
        or (bool(frame) and (report.faulting_thread_queue or "").startswith("com.Metal."))
    )


def is_metal_oom(report: CrashReport) -> bool:
    """The report itself says the GPU ran out of memory (libc++abi's message)."""
    return any(_OOM.search(m) for m in report.asi_messages)


def summary(report: CrashReport, limit: int = 400) -> str:
    """One line for the crash journal, e.g. "EXC_CRASH SIGABRT in
    mlx::core::gpu::check_error(MTL::CommandBuffer*) (libmlx.dylib) on
    com.Metal.CompletionQueueDispatch: abort() called"."""
    line = " ".join(x for x in (report.exception_type, report.signal) if x) or "crash"
    where = report.first_mlx_frame or next(
        (f for f in report.top_frames if not f.endswith(tuple(f" ({i})" for i in _PLUMBING))),
        report.top_frames[0] if report.top_frames else None)
    if where:
        line += f" in {where}"
    if report.faulting_thread_queue:
        line += f" on {report.faulting_thread_queue}"
    # "abort() called" says nothing the signal did not; prefer the others.
    asi = [m for m in report.asi_messages if m != "abort() called"] or list(report.asi_messages)
    if asi:
        line += ": " + "; ".join(" ".join(m.split()) for m in asi)
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _read_capped(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_REPORT_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_REPORT_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


def find_report(reports_dir: Path, pid: int, died_at: float, *,
                window_s: float = 120) -> tuple[Path, CrashReport] | None:
    """The crash report for `pid`, which died at `died_at` (epoch seconds):
    among the newest .ips files modified within `window_s` of it, the first
    whose pid matches and whose capture time (if any) is within the window.
    pids are reused, hence the time checks."""
    candidates: list[tuple[float, Path]] = []
    for path in Path(reports_dir).glob("*.ips"):  # a missing folder yields nothing
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and abs(st.st_mtime - died_at) <= window_s:
            candidates.append((st.st_mtime, path))
    for _, path in sorted(candidates, key=lambda c: c[0], reverse=True)[:MAX_FILES]:
        text = _read_capped(path)
        report = parse_ips(text) if text is not None else None
        if report is None or report.pid != pid:
            continue
        if report.capture_time is not None and abs(report.capture_time.timestamp() - died_at) > window_s:
            continue
        return path, report
    return None
