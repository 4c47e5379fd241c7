"""Our supervisor/ folder must never shadow supervisord's `supervisor`
package (docs/DESIGN.md, "Layout"): not from the repo root, not under -m, not in
pytest."""

import importlib
import subprocess
import sys
from pathlib import Path

import supervisor

REPO = Path(__file__).resolve().parents[2]


def _import_from(cwd: Path, code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_repo_has_our_supervisor_folder_without_init():
    assert (REPO / "supervisor").is_dir()
    assert not (REPO / "supervisor" / "__init__.py").exists()


def test_supervisord_imports_from_site_packages_at_repo_root():
    where = _import_from(REPO, "import supervisor.supervisord, supervisor; print(supervisor.__file__)")
    assert "site-packages" in where and where.endswith("supervisor/__init__.py"), where
    assert not where.startswith(str(REPO / "supervisor")), where


def test_supervisord_runs_as_module_from_repo_root():
    out = subprocess.run([sys.executable, "-m", "supervisor.supervisord", "--version"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()[0].isdigit(), out.stdout


def test_in_pytest_supervisor_is_supervisord():
    assert supervisor.__file__ and "site-packages" in supervisor.__file__
    assert importlib.import_module("supervisor.supervisord").__file__.startswith(str(Path(supervisor.__file__).parent))


def test_our_components_import_under_the_mlxd_namespace_from_repo_root():
    where = _import_from(REPO, "import mlxd.supervisor, mlxd.engine, mlxd.gateway, mlxd.config; "
                               "print(list(mlxd.supervisor.__path__)[0])")
    assert where.endswith("supervisor"), where
