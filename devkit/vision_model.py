"""A tiny vision model for tests: the demo vision model (mlx-vlm's qwen2_vl
at a tiny size), fine-tuned with MLX for a few seconds until it names the
colour of a plain image: "It is red." for a red one, and so on.

Random weights answer the same nonsense whatever the image; these answer
from the image, so a test can tell that an `image_url` really reached the
model (and that a text-only request still works on it). Training stops when
every reply is the greedy choice at every position (teacher forcing).
Built once into a folder, atomically, like the demo models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .fine_tune import build_once, fine_tune, save_weights

BUILD_VERSION = 1
STAMP = ".mlxd-vision.json"
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 220)}
QUESTION = "What colour is this?"
# Sizes the examples come in: the answer must not depend on the image's size
# (one of 4, 6 and 12 image tokens here).
SIZES = ((56, 56), (84, 56), (112, 84))


def answer(colour: str) -> str:
    return f"It is {colour}."


def image(colour: str, size: tuple[int, int] = (64, 64)) -> Any:
    """A plain image of one of the COLOURS (a PIL image)."""
    from PIL import Image

    return Image.new("RGB", size, COLOURS[colour])


def data_url(colour: str, size: tuple[int, int] = (64, 64), fmt: str = "PNG") -> str:
    """A plain image of one of the COLOURS as a data URL, as clients send it."""
    import base64
    import io

    buf = io.BytesIO()
    image(colour, size).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def question(url: str, text: str = QUESTION) -> list[dict]:
    """The OpenAI messages that ask about the image at `url`."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def question_messages() -> list[dict]:
    """The question with its image, as the engine hands it to the template."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def _examples(model: Any, processor: Any) -> list[tuple[Any, ...]]:
    """(input ids, labels, where the reply starts, the model's image inputs)."""
    import mlx.core as mx
    from mlx_vlm import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    tokenizer = processor.tokenizer
    prompt = apply_chat_template(processor, model.config, question_messages(), num_images=1)
    out = []
    for colour in COLOURS:
        for size in SIZES:
            inputs = prepare_inputs(processor, images=[image(colour, size)], prompts=prompt)
            ids = inputs["input_ids"][0].tolist()
            reply = tokenizer.encode(answer(colour), add_special_tokens=False) + [tokenizer.eos_token_id]
            full = mx.array(ids + reply)
            out.append((full[:-1][None], full[1:], len(ids) - 1,
                        {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}))
    return out


def _fine_tune(model: Any, examples: list[tuple[Any, ...]], say: Callable[[str], None], max_steps: int = 400) -> int:
    """Adam on all weights until every reply token is the argmax; the steps taken."""
    import mlx.core as mx
    import mlx.nn as nn

    def logits(model: Any, ids: Any, image_inputs: dict) -> Any:
        out = model(ids, image_inputs["pixel_values"], image_grid_thw=image_inputs["image_grid_thw"])
        return getattr(out, "logits", out)

    def loss_fn(model: Any) -> Any:
        total = mx.array(0.0)
        for ids, labels, first, image_inputs in examples:
            total = total + nn.losses.cross_entropy(logits(model, ids, image_inputs)[0, first:], labels[first:],
                                                    reduction="mean")
        return total

    def memorised() -> bool:
        return all(mx.array_equal(mx.argmax(logits(model, ids, image_inputs)[0, first:], axis=-1),
                                  labels[first:]).item()
                   for ids, labels, first, image_inputs in examples)

    # 1e-3: at 3e-3 the tower's few weights settle on telling one colour from the others only.
    return fine_tune(model, loss_fn, memorised, "vision model", say, learning_rate=1e-3, max_steps=max_steps)


def _stamp() -> dict:
    from mlxd.engine.model.demo_model import VARIANTS
    from mlxd.engine.model.demo_model import _stamp as demo_stamp

    return {"vision_build": BUILD_VERSION, "demo": demo_stamp("vision", VARIANTS["vision"]),
            "colours": COLOURS, "question": QUESTION, "sizes": SIZES}


def build_vision_model(dest: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Builds (once) the fine-tuned vision model into `dest`; returns dest."""
    say = progress or (lambda _msg: None)

    def build_into(folder: Path) -> None:
        import mlx.core as mx
        from mlx_vlm import load

        from mlxd.engine.model.demo_model import build_demo_model

        build_demo_model(folder, "vision")
        model, processor = load(str(folder))
        mx.random.seed(0)
        steps = _fine_tune(model, _examples(model, processor), say)
        say(f"vision model: learned the colours in {steps} steps")
        save_weights(model, folder)

    return build_once(Path(dest), STAMP, _stamp(), build_into)
