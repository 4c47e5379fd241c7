"""scripts/setup.sh installs the lock with uv, which scripts/lock.sh resolves it
with: both get uv from scripts/uv.sh, the one place that pins its version and
hashes. setup.sh writes bytecode for what the service imports as it starts
(uv writes none): the modules it names must exist, and the gateway's heavy
import must be among them. Read as text and found on disk, offline, nothing
imported."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _text(name: str) -> str:
    return (SCRIPTS / name).read_text()


def bytecode_modules(setup_text: str) -> list[str]:
    """The modules start_bytecode imports: the words of its `for modules in` list."""
    body = setup_text[setup_text.index("start_bytecode() {"):]
    words = re.search(r"for modules in (.*?);\s*do", body, re.S).group(1).replace("\\\n", " ").split()
    return [module for word in words for module in word.split(",")]


def module_file(dotted: str) -> Path | None:
    """Where a module's source is, found without importing it (its parents
    would run: LiteLLM's proxy takes seconds to import)."""
    top, *rest = dotted.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        return None
    here = Path(spec.origin).parent if rest else Path(spec.origin)
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        package = here / part
        if last and (package / "__init__.py").is_file():
            return package / "__init__.py"
        if last and (here / f"{part}.py").is_file():
            return here / f"{part}.py"
        if last or not package.is_dir():
            return None
        here = package
    return here


def test_uv_is_pinned_in_scripts_uv_sh_alone():
    uv_sh = _text("uv.sh")
    version = re.search(r"(?m)^uv_version=(\S+)$", uv_sh).group(1)
    hashes = re.findall(r"(?m)^\s+([0-9a-f]{64})\s+#", uv_sh)
    assert version and len(hashes) >= 4
    for name in ("setup.sh", "lock.sh"):
        text = _text(name)
        assert "scripts/uv.sh" in text, f"{name} does not get uv from scripts/uv.sh"
        assert "uv_version=" not in text and not any(h in text for h in hashes), f"{name} pins uv itself"


def test_uv_sh_refuses_without_a_python():
    out = subprocess.run(["bash", str(SCRIPTS / "uv.sh")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage" in out.stderr


def test_setup_installs_the_lock_hash_checked_with_uv_and_with_pip():
    setup = _text("setup.sh")
    assert re.search(r'"\$uv" pip install --require-hashes --no-deps -r "\$lock"', setup)
    assert re.search(r'"\$\{pip\[@\]\}" install --require-hashes --no-deps -r "\$lock"', setup)
    assert '"$uv" pip check' in setup and '"${pip[@]}" check' in setup
    assert "editable_mode=strict" in setup


def test_bytecode_modules_exist():
    modules = bytecode_modules(_text("setup.sh"))
    assert "litellm.proxy.proxy_server" in modules
    missing = [m for m in modules if module_file(m) is None]
    assert missing == [], f"scripts/setup.sh compiles modules that are not installed: {missing}"


def test_the_gateways_heavy_import_is_compiled():
    # gateway/main.py imports LiteLLM's proxy as it starts: the most bytecode.
    assert "from litellm.proxy.proxy_server import" in (REPO / "gateway" / "main.py").read_text()


def test_bytecode_modules_parser_and_finder_can_fail():
    text = 'start_bytecode() {\n  for modules in a.b \\\n      c,d.e; do\n'
    assert bytecode_modules(text) == ["a.b", "c", "d.e"]
    assert module_file("litellm.proxy.no_such_module") is None
    assert module_file("no_such_package_here") is None
    assert module_file("supervisor.supervisord") is not None
