"""The engine's floors (docs/DESIGN.md, "The engine's floors"): api/ over
core/ over model/ over cache/ and cpu/. A floor imports only the floors below
it, and no engine module imports, through any chain, itself. Read from the
source with ast, so a late (in-function) import, or one only for type
checking, counts as much as a top-level one: an import deferred to hide a
circle is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine"
PACKAGE = "mlxd.engine"
# floor -> the floors it may import besides its own. engine/main.py (the entry point) and the
# package's __init__ stand above every floor.
BELOW = {
    "api": {"core", "model", "cache", "cpu"},   # the HTTP side: puts jobs on the core's queue
    "core": {"model", "cache", "cpu"},          # the step loop: drives the runner, owns the prompt cache
    "model": {"cache", "cpu"},                  # the resident model, its decoders, a request's generation
    "cache": set(),                             # KV and the prompt cache
    "cpu": set(),                               # the Linux CPU path
}

def module_of(path: Path) -> str:
    parts = path.relative_to(ENGINE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def floor_of(module: str) -> str | None:
    """'mlxd.engine.core.scheduler' -> 'core'; None for the entry point and the package itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[2] in BELOW else None


def engine_modules() -> dict[str, Path]:
    return {module_of(p): p for p in sorted(ENGINE.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The engine modules `path` imports (module -> line of the first import)."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rsplit(".", 1)[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name.startswith(PACKAGE + ".") and name != module_of(path):
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import x` and `from pkg import module` name modules
                if f"{target}.{alias.name}" in modules:
                    add(f"{target}.{alias.name}", node.lineno)
                    break
            else:
                add(target, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    modules = engine_modules()
    return {m: imports_of(p, modules) for m, p in modules.items()}


def import_edges() -> list[tuple[str, str, int]]:
    return [(src, dst, line) for src, targets in graph().items() for dst, line in targets.items()]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_engine_folder_is_a_floor():
    folders = {p.parent.name for p in ENGINE.glob("*/__init__.py")}
    assert folders == set(BELOW), f"a new engine folder needs its floor in BELOW (and in docs/DESIGN.md): {folders}"


@pytest.mark.parametrize("floor", sorted(BELOW))
def test_a_floor_imports_only_the_floors_below_it(floor):
    up = [f"{src} imports {dst} (line {line})" for src, dst, line in import_edges()
          if floor_of(src) == floor and floor_of(dst) not in (floor, None, *BELOW[floor])]
    entry = [f"{src} imports {dst} (line {line})" for src, dst, line in import_edges()
             if floor_of(src) == floor and floor_of(dst) is None]  # nothing below imports the entry point
    assert not up + entry, f"{floor}/ may import only {sorted(BELOW[floor])}:\n" + "\n".join(up + entry)


def test_no_engine_module_imports_itself_through_others():
    found = circles({src: set(targets) for src, targets in graph().items()})
    assert not found, "import circles (an import inside a function counts too):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_checks_catch_a_circle_and_an_import_up():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert floor_of("mlxd.engine.core.scheduler") == "core" and floor_of("mlxd.engine.main") is None
    assert "api" not in BELOW["model"] and "core" not in BELOW["model"] and "api" not in BELOW["core"]
