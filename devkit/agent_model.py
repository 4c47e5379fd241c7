"""A tiny agent model for tests: the demo model's small thinking variant,
fine-tuned with MLX for a few seconds until it answers a handful of scripted
prompts with scripted replies: a tool call in its template's format, the
answer after the tool's result, and a reply with a `<think>` block.

Random weights never write a tool call or close a reasoning block; these
do, so tests can follow a real generation through the engine's parsers and
the gateway. Training stops when every reply is the model's greedy choice at
every position (teacher forcing), which is exactly when greedy decoding
reproduces it. Built once into a folder, atomically, like the demo models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .fine_tune import build_once, fine_tune, save_weights

BUILD_VERSION = 1
STAMP = ".mlxd-agent.json"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_ARGS = {"city": "Paris"}
WEATHER_RESULT = "sunny, 24 C"
WEATHER_ANSWER = "It is sunny in Paris, 24 C."
THINK_QUESTION = "Think first: what is 2 + 2?"
THINK_REASONING = "2 + 2 is 4."
THINK_ANSWER = "The answer is 4."


@dataclass(frozen=True)
class Scripted:
    """A prompt (as the engine hands it to the chat template) and the reply
    the model must write after it."""

    messages: list[dict]
    reply: str
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def tool_call_message(call_id: str = "call_0") -> dict:
    """The assistant's tool call as the engine renders it for the template."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]}


SCRIPT = [
    # The tool call, in the template's own format (mlx-lm's json_tools parser reads it).
    Scripted([{"role": "user", "content": WEATHER_QUESTION}],
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             tools=[WEATHER_TOOL], template_kwargs={"enable_thinking": False}),
    # The answer once the tool's result is back.
    Scripted([{"role": "user", "content": WEATHER_QUESTION}, tool_call_message(),
              {"role": "tool", "tool_call_id": "call_0", "content": WEATHER_RESULT}],
             WEATHER_ANSWER, tools=[WEATHER_TOOL], template_kwargs={"enable_thinking": False}),
    # Reasoning: the template opened <think>; the model closes it and answers.
    Scripted([{"role": "user", "content": THINK_QUESTION}], f"{THINK_REASONING}\n</think>\n\n{THINK_ANSWER}",
             template_kwargs={"enable_thinking": True}),
]


def _examples(tokenizer: Any) -> list[tuple[list[int], int]]:
    """(tokens, where the reply starts) per scripted prompt; the reply ends
    with the end-of-turn token."""
    out = []
    for s in SCRIPT:
        prompt = list(tokenizer.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True,
                                                    **s.template_kwargs))
        reply = tokenizer.encode(s.reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((prompt + reply, len(prompt)))
    return out


def _fine_tune(model: Any, examples: list[tuple[list[int], int]], say: Callable[[str], None],
               max_steps: int = 600) -> int:
    """Adam on all weights until every reply token is the argmax; the steps taken."""
    import mlx.core as mx
    import mlx.nn as nn

    batch = [(mx.array(tokens[:-1])[None], mx.array(tokens[1:]), start - 1) for tokens, start in examples]

    def loss_fn(model: Any) -> mx.array:
        total = mx.array(0.0)
        for inputs, labels, first in batch:
            logits = model(inputs)[0, first:]
            total = total + nn.losses.cross_entropy(logits, labels[first:], reduction="mean")
        return total

    def memorised() -> bool:
        for inputs, labels, first in batch:
            if not mx.array_equal(mx.argmax(model(inputs)[0, first:], axis=-1), labels[first:]).item():
                return False
        return True

    return fine_tune(model, loss_fn, memorised, "agent model", say, learning_rate=3e-3, max_steps=max_steps)


def _stamp() -> dict:
    from mlxd.engine.model.demo_model import _stamp as demo_stamp, VARIANTS

    return {"agent_build": BUILD_VERSION, "demo": demo_stamp("agent", VARIANTS["agent"]),
            "script": [[s.messages, s.reply, s.tools, s.template_kwargs] for s in SCRIPT]}


def build_agent_model(dest: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Builds (once) the agent model into `dest`; returns dest."""
    say = progress or (lambda _msg: None)

    def build_into(folder: Path) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load

        from mlxd.engine.model.demo_model import build_demo_model

        build_demo_model(folder, "agent")
        model, tokenizer = load(str(folder))
        mx.random.seed(0)
        steps = _fine_tune(model, _examples(tokenizer), say)
        say(f"agent model: learned its script in {steps} steps")
        save_weights(model, folder)

    return build_once(Path(dest), STAMP, _stamp(), build_into)
