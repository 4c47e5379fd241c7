"""Config parsing as a table of documents and outcomes."""

from pathlib import Path

import pytest

from mlxd.config import REQUIRED_ALIASES, ConfigError, apply_env_overrides, parse_config

HOME = Path("/nonexistent-home")


def test_empty_config_serves_the_default_model_under_every_required_alias():
    from mlxd import default_model

    cfg = parse_config({}, HOME)
    expected = "smollm2" if default_model.gguf_path().is_file() else "demo"
    assert list(cfg.models) == [expected]
    for alias in REQUIRED_ALIASES:
        assert cfg.resolve(alias) == expected
    assert cfg.engine.port == 8080 and cfg.engine.host == "127.0.0.1"


def test_the_default_model_is_the_real_one_once_fetched_else_the_demo(tmp_path):
    from mlxd.config import default_models

    real = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_models(real) == {"demo": default_models(real)["demo"]} and default_models(real)["demo"].demo == "a"
    real.write_bytes(b"GGUF")
    (model,) = default_models(real).values()
    assert model.gguf == str(real) and model.fallback_ollama == "smollm2:135m"


@pytest.mark.parametrize("doc, key_in_error", [
    ({"engine": {"port": 0}}, "engine.port"),
    ({"engine": {"max_queue": -1}}, "engine.max_queue"),
    ({"engine": {"memory_fraction": 1.5}}, "engine.memory_fraction"),
    ({"engine": {"bogus": 1}}, "engine.bogus"),
    ({"models": {"m": {}}}, "models.m"),
    ({"models": {"m": {"path": "/x", "repo": "a/b"}}}, "models.m"),
    ({"models": {"../evil": {"path": "/x"}}}, "must match"),
    ({"models": {"m": {"path": "/x"}}, "aliases": {"coding": "nope"}}, "aliases.coding"),
    ({"engine": {"kv_bits": 6}}, "engine.kv_bits"),
    ({"engine": {"kv_group_size": 48}}, "engine.kv_group_size"),
    ({"models": {"m": {"path": "/x", "quantized_kv_start": -1}}}, "models.m.quantized_kv_start"),
    # a rank group keeps its own caches
    ({"engine": {"kv_bits": 8, "ranks": {"hosts": ["10.0.0.1", "10.0.0.2"]}}, "models": {"m": {"path": "/x"}}},
     "rank group"),
    # a draft model: another configured model, without a draft of its own
    ({"models": {"m": {"path": "/x", "draft": "nope"}}}, "draft 'nope' is not under [models]"),
    ({"models": {"m": {"path": "/x", "draft": "m"}}}, "another model"),
    ({"models": {"m": {"path": "/x", "draft": "d"}, "d": {"path": "/y", "draft": "m"}}}, "another model"),
    ({"models": {"m": {"demo": "vision", "draft": "d"}, "d": {"path": "/y"}}}, "vision"),
    ({"models": {"m": {"path": "/x", "draft": "d", "draft_tokens": 0}, "d": {"path": "/y"}}},
     "models.m.draft_tokens"),
])
def test_invalid_configs_name_the_key(doc, key_in_error):
    with pytest.raises(ConfigError) as err:
        parse_config(doc, HOME, "test.toml")
    assert key_in_error in str(err.value)


@pytest.mark.parametrize("engine, model, expected", [
    ({}, {}, (16, 64, 0)),
    ({"kv_bits": 8}, {}, (8, 64, 0)),
    ({"kv_bits": 8}, {"kv_bits": 16}, (16, 64, 0)),  # a model keeps the model's dtype
    ({}, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 1024}, (4, 32, 1024)),
    ({"kv_bits": 8, "quantized_kv_start": 512}, {"quantized_kv_start": 0}, (8, 64, 0)),
    # batching is fine where the model keeps 16 bits, and quantised (the batch's rows each keep their own cache)
    ({"kv_bits": 8}, {"kv_bits": 16, "max_concurrency": 4}, (16, 64, 0)),
    ({"kv_bits": 8, "max_concurrency": 4}, {}, (8, 64, 0)),
    ({"max_concurrency": 2}, {"kv_bits": 4, "quantized_kv_start": 256}, (4, 64, 256)),
])
def test_kv_settings_per_model_over_the_engine(engine, model, expected):
    config = parse_config({"engine": engine, "models": {"m": {"path": "/x", **model}}}, HOME)
    assert config.kv_settings("m") == expected


@pytest.mark.parametrize("engine, model, expected", [
    ({}, {}, "prompt_lookup"),                                     # the default
    ({"speculative": "off"}, {}, "off"),
    ({"speculative": "off"}, {"speculative": "prompt_lookup"}, "prompt_lookup"),  # a model's own wins
    ({}, {"draft": "d"}, "draft"),                                 # a draft model replaces prompt lookup
    ({"speculative": "off"}, {"draft": "d"}, "off"),               # off is off, draft or not
    ({}, {"draft": "d", "speculative": "off"}, "off"),
])
def test_speculative_decoding_per_model(engine, model, expected):
    config = parse_config({"engine": engine, "models": {"m": {"path": "/x", **model}, "d": {"path": "/y"}}}, HOME)
    assert config.speculative_for("m") == expected


def test_aliases_resolve_and_unknown_names_do_not():
    cfg = parse_config({"models": {"qwen": {"repo": "mlx-community/Qwen3-4B-4bit"}, "demo": {"demo": "a"}},
                        "aliases": {"coding": "qwen"}}, HOME)
    assert cfg.resolve("coding") == "qwen"
    assert cfg.resolve("default") == "qwen"  # required aliases default to the first model
    assert cfg.resolve("qwen") == "qwen"
    assert cfg.resolve("../qwen") is None and cfg.resolve("/etc/passwd") is None


def test_env_overrides_engine_port_and_host():
    doc = apply_env_overrides({"engine": {"port": 1234, "require_key": True}},
                              {"MLXD_ENGINE_PORT": "9999", "MLXD_ENGINE_HOST": "0.0.0.0"})
    cfg = parse_config(doc, HOME)
    assert cfg.engine.port == 9999 and cfg.engine.host == "0.0.0.0"


def test_docs_config_reference_is_current():
    from mlxd.config import reference_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    assert doc.read_text().strip() == reference_markdown().strip(), "run: mlxd config reference > docs/CONFIG.md"


def _settings():
    from mlxd.config_reference import sections, settings

    return [(title, name, field) for title, model in sections() for name, field in settings(model)]


@pytest.mark.parametrize("section, name, field", _settings(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_setting_is_described_in_the_schema(section, name, field):
    assert field.description and field.description.endswith((".", ")")), f"[{section}] {name}: Field(description=)"


def test_every_section_is_described_and_reaches_the_reference():
    from mlxd.config import reference_markdown
    from mlxd.config_reference import _prose, sections

    reference = reference_markdown()
    for title, model in sections():
        assert model.__doc__ and f"## [{title}]\n\n{_prose(model.__doc__)}\n" in reference
    for _, name, field in _settings():
        assert f"| `{name}` |" in reference and field.description.replace("|", "\\|") in reference


def _setting_overrides():
    from mlxd.config import ENV_OVERRIDES

    return [v for v in ENV_OVERRIDES if v.setting]


@pytest.mark.parametrize("override", _setting_overrides(), ids=lambda v: v.name)
def test_each_setting_override_replaces_its_setting(override):
    section, key = override.setting.split(".")
    value = "8123" if key.endswith("port") else ("http://10.0.0.9:1" if key.endswith("url") else "::1")
    cfg = parse_config(apply_env_overrides({section: {key: "ignored"}}, {override.name: value}), HOME)
    assert str(getattr(getattr(cfg, section), key)) == value


def test_the_overrides_are_listed_once_and_read_everywhere():
    from mlxd.cli import started_with
    from mlxd.cli.main import _parser
    from mlxd.config import CONFIG_ENV, ENV_OVERRIDES, env_help, reference_markdown
    from mlxd.launchd import common

    names = [v.name for v in ENV_OVERRIDES]
    assert CONFIG_ENV == tuple(n for n in names if n != "MLXD_HOME")
    assert started_with.OVERRIDE_VARS == common.PASSTHROUGH_ENV == CONFIG_ENV
    help_text, reference = _parser().format_help(), reference_markdown()
    assert env_help() in help_text
    assert all(f"| `{n}` |" in reference for n in names)


def test_the_first_run_file_spells_out_defaults_only(tmp_path):
    import tomllib

    from mlxd.config import DEFAULT_CONFIG_TEXT, write_default_config

    assert parse_config(tomllib.loads(DEFAULT_CONFIG_TEXT), HOME) == parse_config({}, HOME)
    assert "port = 8080" in DEFAULT_CONFIG_TEXT and "port = 4000" in DEFAULT_CONFIG_TEXT
    target = tmp_path / "mlxd.toml"
    assert write_default_config(target) and target.read_text() == DEFAULT_CONFIG_TEXT
    assert not write_default_config(target)  # never over an existing file


def test_invalid_config_file_names_the_key(tmp_path):
    import subprocess
    import sys

    (tmp_path / "mlxd.toml").write_text("[engine]\nport = 'eighty'\n")
    r = subprocess.run([sys.executable, "-m", "mlxd.cli", "--home", str(tmp_path), "config", "validate"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "engine.port" in r.stderr


@pytest.mark.parametrize("engine_host, gateway_host, engine_url, gateway_url", [
    ("127.0.0.1", "127.0.0.1", "http://127.0.0.1:8080", "http://127.0.0.1:4000"),
    ("0.0.0.0", "::", "http://127.0.0.1:8080", "http://127.0.0.1:4000"),  # a wildcard bind is reached on loopback
    ("::1", "172.17.0.1", "http://[::1]:8080", "http://172.17.0.1:4000"),
])
def test_one_loopback_rule_for_every_url(engine_host, gateway_host, engine_url, gateway_url):
    c = parse_config({"engine": {"host": engine_host, "require_key": True}, "gateway": {"host": gateway_host}},
                     Path("/h"))
    assert (c.engine_url, c.gateway_url) == (engine_url, gateway_url)
    assert c.paths.journal == Path("/h/state/crashes.jsonl")


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.20", False), ("mac-studio.local", False),
])
def test_is_loopback(host, loopback):
    from mlxd.config import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "192.168.1.20", "mac-studio.local"])
def test_the_engine_always_requires_its_key(host):
    assert parse_config({"engine": {"host": host}}, HOME).engine.require_key  # on loopback too
    assert parse_config({"engine": {"host": host, "require_key": True}}, HOME).engine.require_key  # old configs load
    with pytest.raises(ConfigError, match="require_key"):
        parse_config({"engine": {"host": host, "require_key": False}}, HOME)
