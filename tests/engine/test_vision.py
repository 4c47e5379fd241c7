"""Vision through mlx-vlm, against one real engine: the fine-tuned demo
vision model (devkit/vision_model.py) names the colour of the image it is
sent, so each test can tell that the image reached the model. Images are
data URLs or, under the configured folder only, file URLs; they count in the
prompt-size check; a text model refuses them with a 400 the gateway falls
back on; and the one-model cache swaps between a text and a vision model."""

from __future__ import annotations

import base64

import pytest
import requests
from openai import OpenAI

from conftest import engine_toml, running_engine
from mlxd.devkit import vision_model as vision
from mlxd.devkit.vision_model import data_url, question
from testkit import metric

pytestmark = pytest.mark.timeout(600)
MAX_PROMPT_TOKENS = 200  # a 448x448 image alone is 256 image tokens


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_models, vision_model):
    pictures = tmp_path_factory.mktemp("pictures")
    toml = engine_toml(demo_models, {"max_tokens_cap": 32, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                                     "images": {"local_dirs": [pictures]}},
                       extra_models={"vision": {"path": vision_model}})
    with running_engine(tmp_path_factory, toml) as ep:
        ep.pictures = pictures
        yield ep


@pytest.fixture(scope="module")
def client(engine):
    return OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, messages, model="vision", **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, **kw)


def refusal(engine, messages, model="vision") -> tuple[int, dict]:
    r = requests.post(engine.url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": messages, "max_tokens": 4})
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize("colour", list(vision.COLOURS))
def test_the_model_sees_the_image(client, colour):
    answer = ask(client, question(data_url(colour))).choices[0]
    assert (answer.message.content, answer.finish_reason) == (vision.answer(colour), "stop")


def test_the_stream_equals_the_answer_and_counts_the_image_tokens(client):
    whole = ask(client, question(data_url("blue", (56, 56))))
    chunks = list(ask(client, question(data_url("blue", (56, 56))), stream=True,
                      stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == vision.answer("blue")
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # One image token per 28x28 pixels: 56x56 -> 4, 112x112 -> 16.
    larger = ask(client, question(data_url("blue", (112, 112))))
    assert larger.usage.prompt_tokens - whole.usage.prompt_tokens == 12
    assert larger.choices[0].message.content == vision.answer("blue")


def test_jpeg_and_a_file_under_the_allowed_folder(client, engine):
    assert ask(client, question(data_url("red", fmt="JPEG"))).choices[0].message.content == vision.answer("red")
    path = engine.pictures / "green.png"
    vision.image("green", (90, 60)).save(path)
    assert ask(client, question(path.as_uri())).choices[0].message.content == vision.answer("green")


def test_a_text_only_request_to_the_vision_model_works(client):
    answer = ask(client, [{"role": "user", "content": "Say something."}])
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens < ask(client, question(data_url("red"))).usage.prompt_tokens


def test_an_image_to_a_text_model_is_a_400_the_gateway_falls_back_on(engine):
    status, error = refusal(engine, question(data_url("red")), model="demo-a")
    assert status == 400 and error["code"] == "images_not_supported" and "text model" in error["message"]
    assert requests.get(engine.url + "/health", timeout=10).json()["status"] == "ok"


def test_images_count_in_the_prompt_size_check(engine, client):
    status, error = refusal(engine, question(data_url("red", (448, 448))))
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert "256 of them for images" in error["message"]
    assert ask(client, question(data_url("red"))).choices[0].message.content == vision.answer("red")


@pytest.mark.parametrize("url, code, says", [
    ("data:image/png;base64,%%%not-base64", "invalid_request", "base64 is invalid"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_request", "not an image"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_request", "not an image"),
    ("https://example.com/cat.png", "unsupported_parameter", "does not fetch images"),
    ("file:///etc/passwd", "invalid_request", "not under a folder"),
    ("ftp://example.com/cat.png", "invalid_request", "must be a data URL"),
])
def test_unusable_image_urls_are_clear_400s(engine, url, code, says):
    status, error = refusal(engine, question(url))
    assert status == 400 and error["code"] == code and says in error["message"], error
    assert error["param"] == "messages[0].content[0].image_url.url"


def test_a_file_url_cannot_step_out_of_the_folder(engine, tmp_path):
    outside = tmp_path / "secret.png"
    vision.image("red").save(outside)
    sneaky = "file://" + str(engine.pictures) + "/.." * len(engine.pictures.parts) + str(outside)
    status, error = refusal(engine, question(sneaky))
    assert status == 400 and "not under a folder" in error["message"]
    (engine.pictures / "link.png").symlink_to(outside)
    status, error = refusal(engine, question((engine.pictures / "link.png").as_uri()))
    assert status == 400 and "not under a folder" in error["message"]


def test_images_only_in_user_messages(engine):
    messages = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url("red")}}]},
                {"role": "user", "content": "hi"}]
    status, error = refusal(engine, messages)
    assert status == 400 and error["code"] == "invalid_request" and "user messages only" in error["message"]


def test_the_one_model_cache_swaps_between_text_and_vision(client, engine):
    # (the module's engine may hold demo-a already, after an earlier test: then asking for it loads nothing)
    loads = metric(engine.url, "mlxd_engine_model_loads")
    already = requests.get(engine.url + "/health", timeout=10).json()["resident_model"] == "demo-a"
    assert ask(client, [{"role": "user", "content": "hello"}], model="demo-a").choices[0].message.content
    assert requests.get(engine.url + "/health", timeout=10).json()["resident_model"] == "demo-a"
    assert metric(engine.url, "mlxd_engine_model_loads") == loads + (0 if already else 1)
    assert ask(client, question(data_url("green"))).choices[0].message.content == vision.answer("green")
    assert requests.get(engine.url + "/health", timeout=10).json()["resident_model"] == "vision"
    assert metric(engine.url, "mlxd_engine_model_loads") == loads + (1 if already else 2)


def test_images_count_in_the_memory_check(start_engine, demo_models, tmp_path):
    """The built-in random-weight demo vision model (`demo = "vision"`) in a
    memory budget of its weights + 1 MiB: an image's tokens (their KV) and
    the vision tower's activations (7 KiB a token for this tower) must fit
    beside the model, so a small image is served and a 448x448 one (256
    image tokens, ~1.9 MiB) is refused before MLX could run out of memory."""
    from mlxd.engine.model.demo_model import build_demo_model
    from mlxd.memory_estimate import read_weight_bytes

    weights, _ = read_weight_bytes(build_demo_model(tmp_path / "demo-vision", "vision"))  # the same bytes
    total = int((weights + 2**20) / 0.75) + 1
    ep = start_engine(toml=engine_toml(demo_models, {"context_tokens": 128},
                                       extra_models={"eye": {"demo": "vision"}}),
                      env={"MLXD_MEMORY_TOTAL_BYTES": str(total)})
    client = OpenAI(base_url=ep.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    small = ask(client, question(data_url("red", (56, 56))), model="eye")
    assert small.usage.completion_tokens > 0 and small.usage.prompt_tokens > 4
    status, error = refusal(ep, question(data_url("red", (448, 448))), model="eye")
    assert status == 400 and error["code"] == "context_length_exceeded", error
    assert "does not fit beside the model" in error["message"]
    assert ask(client, [{"role": "user", "content": "hi"}], model="eye").usage.completion_tokens > 0
