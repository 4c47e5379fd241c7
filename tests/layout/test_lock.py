"""requirements-lock.txt (made by scripts/lock.sh; scripts/setup.sh installs
it with pip --require-hashes) agrees with pyproject.toml: every requirement
(the dependencies, the dev extra the tests need, the build tools of the
editable install) is pinned on each platform the lock is for, at a version
pyproject allows, and every pin carries its sha256. The LiteLLM releases known
to be compromised are excluded in both. Read with packaging, offline; each
check is also run on a broken copy, to prove it can fail."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-lock.txt"
PYPROJECT = REPO / "pyproject.toml"

# Reported compromised: 1.82.7 and 1.82.8 (PYSEC-2026-2 / GHSA-5mg7-485q-xm76,
# BerriAI/litellm#24518); 1.107.0 (issue 26, per a scanner of that incident).
COMPROMISED = {"litellm": ("1.82.7", "1.82.8", "1.107.0")}

PLATFORMS = {
    "macOS arm64": {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
    "Linux x86_64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
    "Linux aarch64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64"},
}
PYTHONS = ("3.11", "3.12", "3.13")


def environments() -> dict[str, dict[str, str]]:
    """Marker environments the lock must serve: each platform x each Python."""
    return {f"{platform}, Python {py}": {
        "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
        "implementation_version": f"{py}.0", "python_version": py, "python_full_version": f"{py}.0",
        "platform_release": "", "platform_version": "", "extra": "", **values}
        for platform, values in PLATFORMS.items() for py in PYTHONS}


ENVIRONMENTS = environments()


@dataclass(frozen=True)
class Pin:
    requirement: Requirement | None  # None: a line of options only
    hashes: tuple[str, ...]
    options: tuple[str, ...]
    line: int

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name) if self.requirement else ""

    @property
    def version(self) -> str | None:
        specs = list(self.requirement.specifier) if self.requirement else []
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            return specs[0].version
        return None

    def applies(self, env: dict[str, str]) -> bool:
        return self.requirement is not None and (
            self.requirement.marker is None or self.requirement.marker.evaluate(env))


def parse_lock(text: str) -> list[Pin]:
    """The lock's entries: `name==version ; marker --hash=... ...`, continued over
    lines ending in a backslash; comments and blank lines skipped."""
    pins, parts, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not parts and (not line or line.startswith("#")):
            continue
        if not parts:
            start = number
        parts.append(line.removesuffix("\\").strip())
        if line.endswith("\\"):
            continue
        logical, parts = " ".join(parts), []
        if logical.startswith("-"):
            pins.append(Pin(None, (), tuple(logical.split()), start))
            continue
        requirement, _, rest = logical.partition(" --")
        options = tuple(("--" + rest).split()) if rest else ()
        hashes = tuple(o.removeprefix("--hash=") for o in options if o.startswith("--hash="))
        others = tuple(o for o in options if not o.startswith("--hash="))
        pins.append(Pin(Requirement(requirement), hashes, others, start))
    return pins


def requirements(pyproject: dict) -> list[Requirement]:
    """What setup.sh installs from the lock: the dependencies, the dev extra,
    pip and the build system's requirements (the install is --no-build-isolation)."""
    project = pyproject["project"]
    return [Requirement(text) for text in [
        *project["dependencies"], *project["optional-dependencies"]["dev"],
        "pip", *pyproject["build-system"]["requires"]]]


def lock_problems(pins: list[Pin]) -> list[str]:
    """Each entry pinned to one version with sha256 hashes; no options (an index
    URL or a local path has no place in a committed lock); never two pins of one
    package for the same platform and Python."""
    problems = []
    for pin in pins:
        where = f"line {pin.line}: {pin.requirement or ''}"
        if pin.options:
            problems.append(f"{where}: option {' '.join(pin.options)} in the lock")
        if pin.requirement is None:
            continue
        if pin.requirement.url or pin.version is None:
            problems.append(f"{where}: not pinned to one version with ==")
        if not pin.hashes:
            problems.append(f"{where}: no hash")
        for digest in pin.hashes:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                problems.append(f"{where}: hash {digest!r} is not a sha256")
    for env_name, env in ENVIRONMENTS.items():
        seen: dict[str, Pin] = {}
        for pin in pins:
            if pin.applies(env):
                if pin.name in seen:
                    problems.append(f"{pin.name} pinned twice for {env_name} "
                                    f"(lines {seen[pin.name].line} and {pin.line})")
                seen[pin.name] = pin
    return problems


def agreement_problems(pyproject: dict, pins: list[Pin]) -> list[str]:
    """Every requirement, wherever its marker applies, has a pin that applies
    there too and whose version the requirement allows."""
    found: dict[str, list[str]] = {}
    for requirement in requirements(pyproject):
        name = canonicalize_name(requirement.name)
        for env_name, env in ENVIRONMENTS.items():
            if requirement.marker is not None and not requirement.marker.evaluate(env):
                continue
            here = [pin for pin in pins if pin.name == name and pin.applies(env)]
            if not here:
                problem = f"{requirement} (pyproject.toml) is not in the lock"
                found.setdefault(problem, []).append(env_name)
            for pin in here:
                if pin.version is not None and not requirement.specifier.contains(pin.version, prereleases=True):
                    problem = f"{name}=={pin.version} in the lock is outside pyproject.toml's {requirement}"
                    found.setdefault(problem, []).append(env_name)
    return [f"{problem} (for {'every platform and Python' if len(envs) == len(ENVIRONMENTS) else ', '.join(envs)})"
            for problem, envs in found.items()]


def compromised_problems(pyproject: dict, pins: list[Pin]) -> list[str]:
    """Each compromised release is excluded by name (`!=`) in pyproject.toml, so
    it stays out whatever the lower bound, and is pinned nowhere in the lock."""
    problems = []
    for name, versions in COMPROMISED.items():
        declared = [r for r in requirements(pyproject) if canonicalize_name(r.name) == name]
        if not declared:
            problems.append(f"{name} is no longer in pyproject.toml: check COMPROMISED here")
        for requirement in declared:
            excluded = {s.version for s in requirement.specifier if s.operator == "!="}
            for version in versions:
                if requirement.specifier.contains(version, prereleases=True):
                    problems.append(f"pyproject.toml's {requirement} admits compromised {name} {version}")
                if version not in excluded:
                    problems.append(f"pyproject.toml's {requirement} lacks `!={version}` (compromised)")
        for pin in pins:
            if pin.name == name and pin.version in versions:
                problems.append(f"the lock pins compromised {name}=={pin.version} (line {pin.line})")
    return problems


# -- the files as they are --------------------------------------------------------

@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


@pytest.fixture(scope="module")
def lock_text() -> str:
    assert LOCK.is_file(), "requirements-lock.txt is missing: ./scripts/lock.sh makes it"
    return LOCK.read_text()


@pytest.fixture(scope="module")
def pins(lock_text) -> list[Pin]:
    return parse_lock(lock_text)


def test_every_lock_entry_is_pinned_with_hashes(pins):
    assert len(pins) > 50, "the lock holds almost nothing: run ./scripts/lock.sh"
    assert lock_problems(pins) == []


def test_lock_agrees_with_pyproject_on_every_platform(pyproject, pins):
    assert agreement_problems(pyproject, pins) == [], "refresh the lock: ./scripts/lock.sh"


def test_compromised_releases_are_excluded_in_pyproject_and_the_lock(pyproject, pins):
    assert compromised_problems(pyproject, pins) == []


def test_each_platform_gets_its_mlx_backend(pins):
    # mlx[cpu] on Linux brings mlx-cpu; mlx on macOS brings the Metal build,
    # which a lock resolved for Linux alone would lack.
    for env_name, env in ENVIRONMENTS.items():
        names = {pin.name for pin in pins if pin.applies(env)}
        backend = "mlx-metal" if env["sys_platform"] == "darwin" else "mlx-cpu"
        assert {"mlx", backend} <= names, f"{backend} is not locked for {env_name}"
        assert ({"mlx-cpu", "mlx-metal"} - {backend}).isdisjoint(names), env_name


def test_lock_names_no_index_or_local_path(lock_text):
    assert not re.search(r"(?m)^\s*-(-index-url|-extra-index-url|-find-links|i|f)\b", lock_text)
    assert "file:" not in lock_text and "/home/" not in lock_text and "/tmp/" not in lock_text


# -- each check, on a broken copy, fails ------------------------------------------

def _entries(text: str) -> list[str]:
    return re.split(r"\n(?=[^\s#])", text)


def _without(text: str, name: str) -> str:
    return "\n".join(e for e in _entries(text) if not re.match(rf"{name}==", e))


def _repinned(text: str, name: str, version: str) -> str:
    return re.sub(rf"(?m)^{name}==\S+", f"{name}=={version}", text)


def _entry(text: str, name: str) -> str:
    return next(e for e in _entries(text) if re.match(rf"{name}==", e))


def test_a_missing_requirement_is_caught(pyproject, lock_text):
    problems = agreement_problems(pyproject, parse_lock(_without(lock_text, "psutil")))
    psutil = next(r for r in requirements(pyproject) if r.name == "psutil")
    assert problems == [f"{psutil} (pyproject.toml) is not in the lock (for every platform and Python)"]


def test_a_pin_outside_pyprojects_bounds_is_caught(pyproject, lock_text):
    problems = agreement_problems(pyproject, parse_lock(_repinned(lock_text, "psutil", "6.0.0")))
    assert problems and all("psutil==6.0.0" in p and "outside" in p for p in problems)


def test_a_platform_left_out_is_caught(pyproject, lock_text):
    # mlx locked for Linux only, as a lock made on Linux without --universal would be.
    linux_only = lock_text.replace(_entry(lock_text, "mlx"), "mlx==0.32.4 ; sys_platform == 'linux' \\\n"
                                   "    --hash=sha256:" + "0" * 64)
    problems = agreement_problems(pyproject, parse_lock(linux_only))
    assert len(problems) == 1 and "mlx" in problems[0] and "macOS arm64, Python 3.11" in problems[0]
    assert "Linux" not in problems[0]


def test_an_entry_without_hash_is_caught(lock_text):
    pinned = _entry(lock_text, "psutil").split()[0]  # psutil==<version>
    problems = lock_problems(parse_lock(lock_text.replace(_entry(lock_text, "psutil"), pinned)))
    assert len(problems) == 1 and pinned in problems[0] and "no hash" in problems[0]


def test_an_unpinned_entry_a_bad_hash_and_an_index_url_are_caught():
    problems = lock_problems(parse_lock("psutil>=7 --hash=sha256:" + "a" * 64 + "\n"
                                        "six==1.17.0 --hash=md5:abc\n"
                                        "--extra-index-url file:///srv/wheels\n"))
    assert len(problems) == 3, problems
    assert "not pinned" in problems[0] and "not a sha256" in problems[1] and "option" in problems[2]


def test_a_package_pinned_twice_for_one_platform_is_caught(lock_text):
    doubled = lock_text + "\n" + _repinned(_entry(lock_text, "psutil"), "psutil", "7.0.0") + "\n"
    problems = lock_problems(parse_lock(doubled))
    assert len(problems) == len(ENVIRONMENTS) and all("psutil pinned twice" in p for p in problems)


def test_a_compromised_pin_in_the_lock_is_caught(pyproject, lock_text):
    bad = parse_lock(_repinned(lock_text, "litellm", "1.107.0"))
    assert compromised_problems(pyproject, bad) == [
        f"the lock pins compromised litellm==1.107.0 (line {_line_of(lock_text, 'litellm')})"]
    # ... which the agreement check alone would also refuse.
    assert any("litellm==1.107.0" in p for p in agreement_problems(pyproject, bad))


def test_pyproject_without_the_exclusions_is_caught(pyproject, pins):
    loose = {**pyproject, "project": {**pyproject["project"], "dependencies": [
        "litellm[proxy]>=1.106" if d.startswith("litellm") else d for d in pyproject["project"]["dependencies"]]}}
    problems = compromised_problems(loose, pins)
    assert "pyproject.toml's litellm[proxy]>=1.106 admits compromised litellm 1.107.0" in problems
    assert "pyproject.toml's litellm[proxy]>=1.106 lacks `!=1.82.7` (compromised)" in problems
    assert not any("admits compromised litellm 1.82" in p for p in problems)  # the bound does that


def _line_of(text: str, name: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith(f"{name}=="))


def test_the_parser_reads_markers_and_every_hash():
    pins = parse_lock("# header\n"
                      "numpy==2.4.6 ; python_full_version < '3.12' \\\n"
                      "    --hash=sha256:" + "1" * 64 + " \\\n"
                      "    --hash=sha256:" + "2" * 64 + "\n"
                      "    # via mlxd\n"
                      "six==1.17.0\n")
    assert [(p.name, p.version, len(p.hashes), p.line) for p in pins] == [("numpy", "2.4.6", 2, 2), ("six", "1.17.0", 0, 6)]
    assert pins[0].requirement.marker == Marker("python_full_version < '3.12'")
    assert pins[0].applies(ENVIRONMENTS["Linux x86_64, Python 3.11"])
    assert not pins[0].applies(ENVIRONMENTS["Linux x86_64, Python 3.12"])
