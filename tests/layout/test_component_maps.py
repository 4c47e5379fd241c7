"""A newcomer's map: every component folder names each of its files, one
line each, in one place -- its __init__.py docstring or its README.md
(supervisor/ has no __init__.py). A file added without a line, or a line left
behind by a file moved or removed, fails here, so the maps stay whole."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Every component is an installed package: the folders pyproject.toml maps to mlxd.*.
COMPONENTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                    ["tool"]["setuptools"]["package-dir"].values())
# ... and their subpackages (engine/core/, engine/model/...): each keeps its own map.
FOLDERS = sorted(COMPONENTS + [str(p.parent.relative_to(REPO)) for c in COMPONENTS
                               for p in (REPO / c).glob("*/__init__.py")])
# A map's entry: an indented line starting with the file's name (a docstring),
# or a table row whose first cell is the name in backticks (a README).
DOCSTRING_ENTRY = re.compile(r"^ {2,}([\w.]+\.py)\s", re.MULTILINE)
README_ENTRY = re.compile(r"^\|\s*`([\w.]+\.py)`\s*\|", re.MULTILINE)


def map_entries(folder: Path) -> list[str]:
    """The files a component's map names, in its order (duplicates kept)."""
    entries: list[str] = []
    init = folder / "__init__.py"
    if init.exists():
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")), clean=False) or ""
        entries += DOCSTRING_ENTRY.findall(doc + "\n")
    readme = folder / "README.md"
    if readme.exists():
        entries += README_ENTRY.findall(readme.read_text(encoding="utf-8"))
    return entries


def files_of(folder: Path) -> set[str]:
    """The component's own .py files; __init__.py holds the map."""
    return {p.name for p in folder.glob("*.py")} - {"__init__.py"}


def test_every_installed_component_is_checked():
    assert {"core", "engine", "gateway", "supervisor", "cli", "devkit", "launchd"} <= set(FOLDERS)
    assert {"engine/api", "engine/core", "engine/model", "engine/cache", "engine/cpu"} <= set(FOLDERS)


def test_every_subpackage_is_installed():
    """A folder with an __init__.py under a component is a package pyproject.toml lists."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    package_of = {folder: package for package, folder in
                  tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
                  ["package-dir"].items()}
    for folder in FOLDERS:
        top, _, sub = folder.partition("/")
        assert package_of[top] + ("." + sub.replace("/", ".") if sub else "") in listed, folder


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_map_names_every_file_of_the_component(folder):
    missing = files_of(REPO / folder) - set(map_entries(REPO / folder))
    assert not missing, (f"{folder}/: add a line for {sorted(missing)} to the map "
                         f"(the __init__.py docstring or README.md: one line each)")


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_map_names_only_files_that_exist_once_each(folder):
    entries = map_entries(REPO / folder)
    gone = set(entries) - files_of(REPO / folder)
    assert not gone, f"{folder}/: the map names {sorted(gone)}, which {folder}/ does not hold"
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, f"{folder}/: the map names {twice} more than once (one place, one line each)"


def test_a_file_left_out_of_a_map_is_caught(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A component.\n\n  kept.py   named here\n"""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "added.py").write_text("")
    assert files_of(tmp_path) - set(map_entries(tmp_path)) == {"added.py"}
