"""Imports point one way: core at the bottom, the components on it, the
command line on top, and the test/bench kit beside, never imported by the
product. Read from the source with ast, so a late (in-function) import
counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDER = {"mlxd": "core", "mlxd.cli": "cli", "mlxd.engine": "engine", "mlxd.gateway": "gateway",
          "mlxd.supervisor": "supervisor", "mlxd.launchd": "launchd", "mlxd.devkit": "devkit"}
COMPONENT = {folder: package for package, folder in FOLDER.items()}
# component -> the components it may import (besides itself and core)
ALLOWED = {
    "core": set(),
    "engine": set(),
    "supervisor": set(),
    # the request schemas only (chat and completions, the Responses API, Anthropic's Messages API) and what is
    # set aside of a request before they read it (hosted tools): pydantic and the standard library, no MLX;
    # the status page's data (gateway/status_page.py): what `mlxd status` collects, and the crash journal
    "gateway": {"engine.api.request_schema", "engine.api.responses_api", "engine.api.messages_api",
                "engine.api.set_aside", "supervisor.status", "supervisor.journal"},
    "launchd": {"supervisor"},       # the stop timeout supervisord's config defines
    "cli": {"engine", "gateway", "supervisor", "launchd"},
    "devkit": {"engine", "gateway", "supervisor", "launchd", "cli"},
}


def component_of(module: str) -> str | None:
    """The component a dotted mlxd module belongs to ('mlxd.config' -> core)."""
    if not module.startswith("mlxd"):
        return None
    parts = module.split(".")
    if len(parts) >= 2 and f"mlxd.{parts[1]}" in FOLDER:
        return FOLDER[f"mlxd.{parts[1]}"]
    return "core"


def imports_of(path: Path, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the same package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
    return found


def edges() -> list[tuple[str, str, str]]:
    out = []
    for folder, package in COMPONENT.items():
        for path in sorted((REPO / folder).rglob("*.py")):  # subpackages too (engine/core/...)
            sub = path.parent.relative_to(REPO / folder).parts
            for module in sorted(imports_of(path, ".".join((package, *sub)))):  # one order in every process
                target = component_of(module)
                if target is not None and target != folder:
                    out.append((folder, str(path.relative_to(REPO)), module))
    return out


@pytest.mark.parametrize("folder, where, module", edges(), ids=lambda v: str(v))
def test_every_import_points_down(folder, where, module):
    target = component_of(module)
    if target == "core":
        return
    allowed = ALLOWED[folder]
    sub = module.removeprefix("mlxd.")
    assert target in allowed or sub in allowed, f"{where} imports {module}: {folder} may not import {target}"


def test_the_product_never_imports_the_devkit():
    product = [e for e in edges() if e[0] != "devkit"]
    assert not [e for e in product if component_of(e[2]) == "devkit"]


def test_the_gateway_reaches_the_engine_only_for_its_request_schemas():
    uses = {module for folder, _, module in edges() if folder == "gateway" and component_of(module) == "engine"}
    assert uses <= {"mlxd.engine.api.request_schema", "mlxd.engine.api.responses_api", "mlxd.engine.api.messages_api",
                    "mlxd.engine.api.set_aside"}


def test_the_gateway_reaches_the_supervisor_only_for_the_status_page():
    uses = {(where, module) for folder, where, module in edges()
            if folder == "gateway" and component_of(module) == "supervisor"}
    assert uses <= {("gateway/status_page.py", "mlxd.supervisor.status"),
                    ("gateway/status_page.py", "mlxd.supervisor.journal")}
