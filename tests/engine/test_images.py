"""The image decisions as tables: what kind of URL an image_url is, which
local files may be read, the vision tower's memory estimate, and how image
parts reach the chat template."""

from __future__ import annotations

import base64
import io

import pytest

from mlxd.engine.model.errors import EngineError
from mlxd.engine.api.images import (DataUrl, ImagePolicy, LocalFile, RemoteUrl, Unreadable, allowed_path, check_image,
                                classify, read_image_bytes)
from mlxd.engine.api.request_schema import ChatCompletionRequest
from mlxd.memory_estimate import vision_encoder_bytes
from mlxd.models import is_vision_config


@pytest.mark.parametrize("url, expected", [
    ("data:image/png;base64,AAAA", DataUrl("AAAA")),
    ("data:image/jpeg;base64,", DataUrl("")),
    ("DATA:IMAGE/PNG;BASE64,AA", DataUrl("AA")),
    ("data:image/png,raw", Unreadable("an image data URL must be base64-encoded (data:image/png;base64,...)")),
    ("data:image/png;base64", Unreadable("a data URL needs a comma before its data")),
    ("data:text/plain;base64,aGk=", Unreadable("a data URL of type 'text/plain' is not an image")),
    ("https://example.com/a.png", RemoteUrl("https://example.com/a.png")),
    ("http://127.0.0.1:8000/a.png", RemoteUrl("http://127.0.0.1:8000/a.png")),
    ("file:///tmp/a%20b.png", LocalFile("/tmp/a b.png")),
    ("file://localhost/tmp/a.png", LocalFile("/tmp/a.png")),
    ("file://otherhost/tmp/a.png", Unreadable("a file URL must name a file on this machine (file:///path)")),
    ("/tmp/a.png", Unreadable("an image URL must be a data URL (data:image/...;base64,...) or a file URL (file:///...)")),
    ("ftp://x/a.png", Unreadable("an image URL must be a data URL (data:image/...;base64,...) or a file URL (file:///...)")),
])
def test_classify(url, expected):
    assert classify(url) == expected


def test_allowed_path_resolves_before_it_decides(tmp_path):
    allowed = (tmp_path / "pictures").resolve()
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(b"x")
    (tmp_path / "secret.png").write_bytes(b"x")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    dirs = (allowed,)
    assert allowed_path(str(allowed / "cat.png"), dirs) == allowed / "cat.png"
    assert allowed_path(str(allowed / ".." / "secret.png"), dirs) is None
    assert allowed_path(str(allowed / "link.png"), dirs) is None
    assert allowed_path(str(allowed / "cat.png"), ()) is None  # off by default
    assert allowed_path("cat.png", dirs) is None  # relative: never


def _png(size=(8, 8)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def test_reading_and_checking_images(tmp_path):
    policy = ImagePolicy(local_dirs=(tmp_path.resolve(),), max_bytes=1000, max_pixels=100)
    png = _png()
    assert read_image_bytes("data:image/png;base64," + base64.b64encode(png).decode(), policy, "m") == png
    (tmp_path / "a.png").write_bytes(png)
    assert read_image_bytes((tmp_path / "a.png").as_uri(), policy, "m") == png
    assert check_image(png, policy, "m") == (8, 8)
    with pytest.raises(EngineError, match="over 0 MiB"):
        read_image_bytes("data:image/png;base64," + "A" * 2000, policy, "m")
    with pytest.raises(EngineError, match="cannot read the file"):
        read_image_bytes((tmp_path / "missing.png").as_uri(), policy, "m")
    with pytest.raises(EngineError, match="over this engine's limit of 100"):
        check_image(_png((11, 10)), policy, "m")
    with pytest.raises(EngineError, match="not an image"):
        check_image(b"GIF89a-truncated", policy, "m")


@pytest.mark.parametrize("config, image_tokens, expected", [
    ({}, 16, 0),
    ({"vision_config": {"embed_dim": 32, "mlp_ratio": 2, "spatial_merge_size": 2}}, 0, 0),
    # 16 tokens x 4 patches, 32 wide, (5 + 2) tensors, float32, twice.
    ({"vision_config": {"embed_dim": 32, "mlp_ratio": 2, "spatial_merge_size": 2}}, 16, 2 * 64 * 32 * 7 * 4),
    # Qwen2-VL 7B's tower: 1280 wide, MLP ratio 4, 2x2 merge; a 1024x1024 image is ~1300 tokens.
    ({"vision_config": {"embed_dim": 1280, "mlp_ratio": 4, "spatial_merge_size": 2}}, 1300,
     2 * 5200 * 1280 * 9 * 4),
    # A tower given by hidden/intermediate sizes, no merge (LLaVA's CLIP: 576 tokens).
    ({"vision_config": {"hidden_size": 1024, "intermediate_size": 4096}}, 576, 2 * 576 * 1024 * 9 * 4),
])
def test_vision_encoder_bytes(config, image_tokens, expected):
    assert vision_encoder_bytes(config, image_tokens) == expected


@pytest.mark.parametrize("config, expected", [
    (None, None), ({}, None),
    ({"model_type": "llama", "hidden_size": 64}, False),
    ({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}, True),
    ({"model_type": "gemma3", "text_config": {}, "vision_config": {}}, True),
    ({"model_type": "odd", "vision_config": None}, False),
])
def test_is_vision_config(config, expected):
    assert is_vision_config(config) is expected


def test_image_parts_reach_the_template_in_order():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                     {"type": "text", "text": " and "},
                                     {"type": "image_url", "image_url": {"url": "file:///b.png", "detail": "low"}}]},
        {"role": "user", "content": [{"type": "text", "text": "plain parts"}]}]})
    assert req.image_parts() == [("messages[1].content[1]", "data:image/png;base64,AA"),
                                 ("messages[1].content[3]", "file:///b.png")]
    rendered = [m.for_template()["content"] for m in req.messages]
    assert rendered == ["Be brief.", [{"type": "text", "text": "Compare "}, {"type": "image"},
                                      {"type": "text", "text": " and "}, {"type": "image"}], "plain parts"]
