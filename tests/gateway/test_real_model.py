"""The real default model, SmolLM2-135M-Instruct, end to end through the
gateway with the openai client: answers that can be right or wrong. Short
prompts and max_tokens <= 16: this CPU decodes a few tokens a second."""

from __future__ import annotations

import openai
import pytest

from mlxd import default_model
from mlxd.devkit.gguf_fixture import write_ollama_store
from mlxd.toml_text import dumps, table_lines
from testkit import real_default_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def real(module_stack, tmp_path_factory):
    gguf = real_default_model()
    store = tmp_path_factory.mktemp("ollama") / "models"
    write_ollama_store(store, "smollm2:135m", gguf)  # as `ollama pull smollm2:135m` lays it out
    # served as with no model configured: its context extended to 32k by YaRN (ollamas: as trained, 8k)
    models = dumps({"models": {"smollm2": {"gguf": gguf, "extend_context": default_model.CONTEXT_TOKENS},
                               "ollamas": {"from_ollama": "smollm2:135m"}}})
    # a real model decodes a few tokens a second here: no 1 s stuck grace as for the tiny demo model
    st = module_stack(gateway="", models=models, engine=table_lines({"stuck_grace_s": 60}),
                      env={"OLLAMA_MODELS": str(store)})
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=240)
    return st, client


def ask(client, content: str, system: str | None = None, model: str = "smollm2", **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, **extra)


def test_a_factual_question_is_answered_correctly(real):
    _, client = real
    answer = ask(client, "What is the capital of France?")
    assert "Paris" in answer.choices[0].message.content
    assert answer.model == "smollm2" and answer.usage.completion_tokens <= 16


def test_greedy_decoding_is_deterministic(real):
    _, client = real
    first, second = (ask(client, "Name a colour of the sky.").choices[0].message.content for _ in range(2))
    assert first == second and first


def test_the_system_prompt_reaches_the_model(real):
    _, client = real
    plain = ask(client, "What is your name?")
    pirate = ask(client, "What is your name?", system="You are a pirate named Captain Hook.")
    # Without a system message the template adds its own ("You are a helpful AI assistant named
    # SmolLM, trained by Hugging Face"): far more than the ~10 tokens of the question and markers.
    assert plain.usage.prompt_tokens > 25 and pirate.usage.prompt_tokens != plain.usage.prompt_tokens
    assert "Captain" in pirate.choices[0].message.content and "Captain" not in plain.choices[0].message.content


def test_streamed_text_equals_the_non_streamed_text(real):
    _, client = real
    whole = ask(client, "What is the capital of France?").choices[0].message.content
    stream = ask(client, "What is the capital of France?", stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole


def test_ollamas_own_copy_of_the_model_answers_the_same_on_mlx(real):
    _, client = real
    answer = ask(client, "What is the capital of France?", model="ollamas")
    assert "Paris" in answer.choices[0].message.content and answer.model == "ollamas"
