"""The gateway process never loads MLX: it builds its whole app (heavy-model
verdicts, LiteLLM's proxy, the fast path) in a fresh interpreter, which then
lists what it imported."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]  # starts processes

BUILD = """
import json, sys
from mlxd.config import load_config
from mlxd.gateway.main import build_app
app = build_app(load_config())
print(json.dumps([type(app).__name__, sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm"))]))
"""


def test_building_the_gateway_app_imports_no_mlx(tmp_path):
    (tmp_path / "mlxd.toml").write_text('[models.small]\nrepo = "mlx-community/Qwen3-0.6B-4bit"\n'
                                        '[models.big]\nrepo = "mlx-community/Llama-3.3-70B-Instruct-4bit"\n')
    env = {**os.environ, "MLXD_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    app, mlx_modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert app == "HostCheck" and mlx_modules == []  # the Host check, then the key guard, before anything
    from mlxd.config import load_config

    routes = load_config(home=tmp_path).paths.litellm_config.read_text()
    assert "openai/small" in routes and "openai/big" not in routes  # the 70B model was judged heavy: Ollama only
