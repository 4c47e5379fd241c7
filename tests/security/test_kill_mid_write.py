"""kill -9 in the middle of a write, for every file mlxd writes: afterwards
the file is absent, old and whole, or new and whole (mlxd's own reader takes
it), never torn or mixed; the key keeps mode 0600; and the temp files a killed
writer leaves are ignored by readers and removed by the next write, so they
never pile up.

Each case runs the REAL writer in a child process (`sys.executable -c`), in a
tight loop alternating two large contents so that one write takes real time.
The parent reads the file all the while (every read must be whole), SIGKILLs
the child at a varied moment and checks what is left; then the next child
starts from that. The style of
tests/supervisor/test_journal.py::test_kill_9_mid_append_never_corrupts.
(The crash journal, append-only, is covered there.)
"""

from __future__ import annotations

import configparser
import os
import plistlib
import random
import re
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest
import yaml

from mlxd.config import load_config
from mlxd.engine.model.errors import EngineError
from mlxd.engine.api.quarantine import QuarantineList
from mlxd.gateway.keys import PREFIX, read_key
from mlxd.paths import read_json, remove_stale_temps, write_atomic
from mlxd.supervisor.policy import State
from testkit import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # starts processes

KILLS = 3  # per writer; each from a varied moment into the writing
MAX_KILL_DELAY_S = 0.12  # a few writes' time: kills land before, in and after a write
START_TIMEOUT_S = 30.0

# Runs before each case's code: `home`, `expected` (where the child leaves the
# two whole contents it alternates), `N` (their size) and `big(i)`.
PRELUDE = """
import logging, os, sys
from pathlib import Path
logging.disable(logging.CRITICAL)  # the quarantine writer logs its whole list
home, expected, N = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

def big(i):
    return "ab"[i % 2] * N
"""

# Runs after it: the case defined `target` and `write(i)`.
LOOP = """
for i in (0, 1):
    write(i)
    (expected / str(i)).write_bytes(target.read_bytes())
print("writing", target, flush=True)
i = 0
while True:
    write(i)
    i += 1
"""


@dataclass(frozen=True)
class Writer:
    name: str
    code: str  # defines `target` (the file) and `write(i)`, calling the real writer
    check: Callable[[Path], object]  # mlxd's reader of the file; raises or returns falsy when it is bad
    fixed: bool = True  # write(i) alternates two fixed contents (else: only `check` judges)
    may_be_absent: bool = False  # write(i) removes the file first (a first-run writer)
    mode: int = 0o644
    size: int = 1 << 20


def _json(*keys: str) -> Callable[[Path], bool]:
    def check(path: Path) -> bool:
        data = read_json(path)
        return isinstance(data, dict) and all(k in data for k in keys)
    return check


def _key(path: Path) -> bool:
    return read_key(path).startswith(PREFIX)


def _supervisord_conf(path: Path) -> bool:
    from supervisor.options import UnhosedConfigParser

    parser = UnhosedConfigParser()
    parser.read_string(path.read_text())
    return parser.has_section("supervisord") and parser.has_section("program:engine")


def _litellm_yaml(path: Path) -> bool:
    return bool(yaml.load(path.read_text(), Loader=yaml.CSafeLoader)["model_list"])


def _plist(path: Path) -> bool:
    return plistlib.loads(path.read_bytes())["Label"] == "dev.mlxd.agent"


def _systemd_unit(path: Path) -> bool:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser.has_option("Service", "ExecStart")


def _quarantine(path: Path) -> bool:
    """The engine's own reader: exactly one of the two lists, first to last entry."""
    q = QuarantineList(path)

    def refused(fp: str) -> bool:
        try:
            q.check(fp, now=0.0)
            return False
        except EngineError:
            return True
    last = f"{(1 << 20) // 32 - 1:015x}"
    return [refused(f"0{0:015x}") and refused("0" + last), refused(f"1{0:015x}") and refused("1" + last)] in (
        [True, False], [False, True])


def _supervision(path: Path) -> bool:
    data = read_json(path)
    return isinstance(data, dict) and _whole_pad(State.from_json(data).killing)


def _inflight(path: Path) -> bool:
    data = read_json(path)
    return (isinstance(data, dict) and data["request_id"].startswith("req-") and _whole_pad(data["request_id"][4:])
            and data["pid"] > 0)


def _whole_pad(s: str) -> bool:
    """big(i) of the default size, all of it."""
    return s in ("a" * (1 << 20), "b" * (1 << 20))


def _config(path: Path) -> bool:
    return load_config(path=path, home=path.parent).engine.port == 8080


ENGINE_RUNNER = """
os.environ["MLXD_HOME"] = str(home)
from mlxd.paths import StatePaths
from mlxd.supervisor import engine_runner

class FakeEngine:  # the runner's child, exited at once
    pid = 4242
    def __init__(self, cmd, **kwargs): pass
    def poll(self): return 0
    def wait(self, timeout=None): return 0
    def send_signal(self, sig): pass

engine_runner.subprocess.Popen = FakeEngine
target = StatePaths(home).{attr}

def write(i):
    engine_runner.main()
"""

WRITERS = [
    Writer("paths.write_atomic", """
from mlxd.paths import write_atomic
target = home / "state" / "blob"
def write(i):
    write_atomic(target, big(i))
""", check=lambda p: p.stat().st_size == 1 << 20),
    Writer("paths.write_atomic(durable=False)", """
from mlxd.paths import write_atomic
target = home / "run" / "blob"
def write(i):
    write_atomic(target, big(i), durable=False)
""", check=lambda p: p.stat().st_size == 1 << 20),
    Writer("paths.write_json_atomic", """
from mlxd.paths import write_json_atomic
target = home / "state" / "some.json"
def write(i):
    write_json_atomic(target, {"i": i % 2, "pad": big(i)})
""", check=_json("i", "pad")),
    Writer("gateway.keys.rotate_key", """
from mlxd.gateway import keys
from mlxd.paths import StatePaths
paths = StatePaths(home)
target = paths.key
def write(i):
    keys.new_key = lambda: keys.PREFIX + big(i)
    keys.rotate_key(paths)
""", check=_key, mode=0o600),
    Writer("keyfile.rotate_key_file", """
from mlxd import keyfile
from mlxd.paths import StatePaths
target = StatePaths(home).engine_key
def write(i):
    keyfile.rotate_key_file(target, make=lambda: "sk-mlxd-" + big(i))  # `mlxd key rotate engine`
""", check=_key, mode=0o600),
    Writer("gateway.keys.ensure_key", """
from mlxd.gateway import keys
from mlxd.paths import StatePaths
paths = StatePaths(home)
target = paths.key
def write(i):
    keys.new_key = lambda: keys.PREFIX + big(i)
    target.unlink(missing_ok=True)
    keys.ensure_key(paths)
""", check=_key, mode=0o600, may_be_absent=True),
    Writer("config.write_default_config", """
from mlxd import config
target = home / "mlxd.toml"
text = config.DEFAULT_CONFIG_TEXT
def write(i):
    config.DEFAULT_CONFIG_TEXT = text + "# " + big(i) + "\\n"
    target.unlink(missing_ok=True)
    config.write_default_config(target)
""", check=_config, may_be_absent=True),
    Writer("supervisor.control.prepare (supervisord.conf)", """
from mlxd.config import Config
from mlxd.paths import StatePaths
from mlxd.supervisor import control
config = Config(home=home)
target = StatePaths(home).supervisord_conf
render = control.render_supervisord_conf
def write(i):
    control.render_supervisord_conf = lambda c: render(c) + "; " + big(i) + "\\n"
    control.prepare(config)
""", check=_supervisord_conf),
    Writer("gateway.main.write_litellm_config", """
from mlxd.config import Config
from mlxd.gateway import main
from mlxd.paths import StatePaths
config = Config(home=home)
target = StatePaths(home).litellm_config
render = main.render_litellm_config
import yaml  # its C emitter: else rendering 1 MB is all the loop would do
yaml.safe_dump = lambda data, **kw: yaml.dump(data, Dumper=yaml.CSafeDumper, **kw)
def write(i):
    main.render_litellm_config = lambda c, heavy: {**render(c, heavy), "mlxd_pad": big(i)}
    main.write_litellm_config(config, {})
""", check=_litellm_yaml),
    Writer("launchd.launchctl plist (shell.write_unit)", """
os.environ["MLXD_LAUNCH_AGENTS_DIR"] = str(home / "LaunchAgents")
from mlxd.config import Config
from mlxd.launchd import launchctl, shell
config = Config(home=home)
target = launchctl.plist_path()
def write(i):
    inputs = shell.Inputs(config, ["/usr/local/bin/mlxd"], "/usr/bin:/bin", {"MLXD_OLLAMA_URL": "http://" + big(i)})
    shell.write_unit(target, launchctl._render(inputs), inputs)
""", check=_plist),
    Writer("launchd.systemctl unit (shell.write_unit)", """
os.environ["MLXD_SYSTEMD_USER_DIR"] = str(home / "systemd")
from mlxd.config import Config
from mlxd.launchd import systemctl, shell
config = Config(home=home)
target = systemctl.unit_path()
def write(i):
    inputs = shell.Inputs(config, ["/usr/local/bin/mlxd"], "/usr/bin:/bin", {"MLXD_OLLAMA_URL": "http://" + big(i)})
    shell.write_unit(target, systemctl._render(inputs), inputs)
""", check=_systemd_unit),
    Writer("engine core's in-flight file", """
from types import SimpleNamespace
from mlxd.engine.core.inflight_record import InflightRecord, inflight_request
from mlxd.engine.model.mlx_memory import MemorySnapshot
from mlxd.paths import StatePaths
target = StatePaths(home).inflight
record = InflightRecord(target)
def write(i):
    job = SimpleNamespace(id="req-" + big(i), fingerprint="0123456789abcdef", model_id="demo")
    record.write(inflight_request([job], MemorySnapshot()))  # what its writer thread does
""", check=_inflight, fixed=False),  # it holds the time and pid
    Writer("supervisor.listener quarantine.json", """
from types import SimpleNamespace
from mlxd.config import Config
from mlxd.paths import StatePaths
from mlxd.supervisor import listener
sup = SimpleNamespace(paths=StatePaths(home), config=Config(home=home), pending_records=[])
target = sup.paths.quarantine
listener.journal.append_record = lambda *a, **k: None  # the journal has its own test
listener.journal.read_records = lambda path: []
def write(i):
    listener.journal.quarantine_verdicts = lambda records, now, period: ({
        f"{i % 2}{n:015x}": 4e9 for n in range(N // 32)}, {})
    listener.Supervision._write_verdicts(sup)
""", check=_quarantine),
    Writer("supervisor.listener supervision.json", """
from types import SimpleNamespace
from mlxd.paths import StatePaths
from mlxd.supervisor import listener
from mlxd.supervisor.policy import State
sup = SimpleNamespace(paths=StatePaths(home), state=State(), _supervisord_pid=lambda: 4242)
target = sup.paths.supervision
def write(i):
    sup.state = State(mode=listener.Mode.BACKOFF, crash_times=(1.0, 2.0), killing=big(i))
    listener.Supervision._save(sup)
""", check=_supervision, fixed=False),  # it holds the time
    Writer("supervisor.engine_runner engine.pid", ENGINE_RUNNER.replace("{attr}", "engine_pid"),
           check=_json("pid", "runner_pid", "started"), fixed=False),
    Writer("supervisor.engine_runner engine.exit.json", ENGINE_RUNNER.replace("{attr}", "engine_exit"),
           check=_json("pid", "runner_pid", "returncode", "ended"), fixed=False),
]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    """Writer processes; any still running at the end is killed by pid."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(10)


def _start(case: Writer, home: Path, expected: Path, log: Path, procs: list) -> tuple[subprocess.Popen, Path]:
    """A writer child, once it has written both contents and is looping."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    code = PRELUDE + textwrap.dedent(case.code) + LOOP
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, str(home), str(expected), str(case.size)],
                                stdout=subprocess.PIPE, stderr=err, env=env)
    procs.append(proc)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(START_TIMEOUT_S):
            raise AssertionError(f"{case.name}: the writer did not start in {START_TIMEOUT_S}s")
    line = proc.stdout.readline().decode()
    assert line.startswith("writing "), f"{case.name}: the writer failed:\n{log.read_text()[-3000:]}"
    return proc, Path(line.split(" ", 1)[1].strip())


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL  # killed, not already dead of an error


def _temps(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.*.tmp"))


def _assert_whole(case: Writer, target: Path, expected: list[bytes], full: bool) -> None:
    """Absent (where allowed), or one of the contents, whole and in mode; `full`
    also runs mlxd's reader (slower; the bytes alone decide during writing)."""
    try:
        mode = os.stat(target).st_mode & 0o777
        data = target.read_bytes()
    except FileNotFoundError:
        assert case.may_be_absent, f"{case.name}: {target.name} is gone"
        return
    assert mode == case.mode, f"{case.name}: {target.name} has mode {mode:o}"  # before read_key mends it
    if case.fixed:
        assert data in expected, (f"{case.name}: {target.name} is torn or mixed "
                                  f"({len(data)} bytes, not one of {[len(e) for e in expected]})")
    if full or not case.fixed:
        assert case.check(target), f"{case.name}: mlxd's reader rejects {target.name}"


@pytest.mark.parametrize("case", WRITERS, ids=[w.name for w in WRITERS])
def test_kill_9_mid_write_leaves_the_old_or_the_new_file_whole(case, tmp_path, children):
    home, expected_dir = tmp_path / "home", tmp_path / "expected"
    home.mkdir()
    expected_dir.mkdir()
    rng = random.Random(case.name)  # varied, but the same delays on every run
    delays = [0.0] + [rng.uniform(0.005, MAX_KILL_DELAY_S) for _ in range(KILLS - 1)]
    for n, delay in enumerate(delays):
        proc, target = _start(case, home, expected_dir, tmp_path / f"writer-{n}.log", children)
        expected = [(expected_dir / str(i)).read_bytes() for i in (0, 1)]
        assert not case.fixed or (expected[0] != expected[1] and len(expected[0]) >= case.size // 2)
        # Earlier writers' temp files are gone: the writes since removed them.
        assert all(f".{proc.pid}." in t.name for t in _temps(target)), _temps(target)
        kill_at = time.monotonic() + delay
        while True:  # a reader all the while sees only whole files
            _assert_whole(case, target, expected, full=False)
            if time.monotonic() >= kill_at:
                break
        _kill(proc)
        _assert_whole(case, target, expected, full=True)
        left = _temps(target)
        assert len(left) <= 1 and all(f".{proc.pid}." in t.name for t in left), left
        for t in left:  # a torn temp file: never more readable than the file
            assert os.stat(t).st_mode & 0o777 & ~case.mode == 0, f"{t.name}: mode {os.stat(t).st_mode & 0o777:o}"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    return p.pid


def test_the_next_write_removes_only_temp_files_whose_writer_is_gone(tmp_path):
    target = tmp_path / "engine.pid"
    dead, me = _dead_pid(), os.getpid()
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(zombie.pid, signal.SIGKILL)  # not reaped yet: a zombie, which writes nothing any more
        wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 10, what="a zombie")
        stale = [f".engine.pid.{dead}.k2j4_x9q.tmp", f".engine.pid.{zombie.pid}.abcdefgh.tmp",
                 f".engine.pid.{me}.old0pid0.tmp"]  # this pid, but from a process before us
        kept = [f".engine.pid.{me}.writing.tmp",  # a live writer (a thread of ours) at work
                f".engine.pid.x.{dead}.k2j4_x9q.tmp",  # the temp of `engine.pid.x`, not ours
                f".engine.{dead}.k2j4_x9q.tmp",  # the temp of `engine`
                ".engine.pid.notapid.tmp", "engine.pid.tmp", f"engine.pid.{dead}.k2j4_x9q.tmp"]
        for name in stale + kept:
            (tmp_path / name).write_text("torn")
        os.utime(tmp_path / stale[2], (time.time() - 10 ** 6, time.time() - 10 ** 6))
        write_atomic(target, "{}")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["engine.pid"])
        assert remove_stale_temps(target) == []
    finally:
        zombie.wait(10)


def test_temp_names_carry_the_writer_pid(tmp_path, monkeypatch):
    """The pattern remove_stale_temps relies on, as write_atomic really makes it."""
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (seen.append(Path(src).name), real(src, dst)))
    write_atomic(tmp_path / "key", "k\n", mode=0o600)
    assert re.fullmatch(rf"\.key\.{os.getpid()}\.[a-z0-9_]+\.tmp", seen[0]), seen
    assert os.stat(tmp_path / "key").st_mode & 0o777 == 0o600 and list(tmp_path.iterdir()) == [tmp_path / "key"]
