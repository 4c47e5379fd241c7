"""Images through the whole service with the openai client: the fine-tuned
demo vision model (devkit/vision_model.py) names the colour of the image,
through the gateway's fast path and the LiteLLM path; an image sent to a
text model is answered by the Ollama fallback, which gets the image; and a
SIGABRT while the vision model answers is journaled, restarted, and the
vision model serves again."""

from __future__ import annotations

import openai
import pytest

from mlxd.devkit import vision_model as vision
from mlxd.devkit.vision_model import data_url, question
from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.toml_text import dumps, table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(600)
OLLAMA_MODEL = "llama3.2:3b"


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield standin


def ask(client, messages, model="vision", stream=False) -> str:
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return answer.choices[0].message.content


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_images_through_the_gateway(stack, vision_model, ollama, fast_path):
    st = stack(gateway=table_lines({"engine_fast_path": fast_path, "ollama_url": ollama.url}),
               models=dumps({"models": {"vision": {"path": vision_model, "ollama": OLLAMA_MODEL}}}))
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    for colour, stream in (("red", False), ("blue", True)):
        assert ask(client, question(data_url(colour)), stream=stream) == vision.answer(colour)
    # A text model cannot see it: the engine's 400 sends the request on to Ollama, image and all.
    url = data_url("green")
    answer = ask(client, question(url), model="default")
    assert answer.startswith(marker(OLLAMA_MODEL).strip())
    sent = ollama.stats()["last_request"]["messages"][-1]
    assert sent["images"] == [url.split(",", 1)[1]] and vision.QUESTION in sent["content"]
    if not fast_path:
        return
    # A Metal crash while the vision model answers: journaled as such, restarted, serving images again.
    st.fault_file.write_text("abort@token:2")
    answer = ask(client, question(data_url("red")))
    assert answer.startswith(marker(OLLAMA_MODEL).strip())  # the fallback's whole answer, not half of ours
    st.fault_file.unlink()
    wait_until(lambda: st.records(), 30, what="a journal record")
    record = st.records()[-1]
    assert record.klass == "sigabrt" and record.model == "vision"
    wait_until(st.healthy, 60, what="the engine back")
    assert ask(client, question(data_url("blue"))) == vision.answer("blue")
