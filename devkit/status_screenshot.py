"""The status page's screenshot for docs/OPERATIONS.md (docs/status-page.png):
a real stack on the demo models (and the Ollama stand-in) in a throw-away
home, a couple of minutes of traffic (conversations that reuse the prompt
cache, streamed answers, one engine killed on the way), then the page in
headless Chromium (mlxd.devkit.browser), whole, as a PNG. Everything
started is stopped by pid at the end.

    python -m mlxd.devkit.status_screenshot [docs/status-page.png] [--traffic-s 120]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import requests

from mlxd.devkit.browser import headless_chromium, missing
from mlxd.devkit.ollama_standin import start_standin
from mlxd.devkit.stack import Stack
from mlxd.devkit.wait import wait_for
from mlxd.toml_text import dumps

SAMPLE_S = 2.0
WIDTH = 1280
MAX_BYTES = 300_000  # docs keep it small


def traffic(st: Stack, seconds: float) -> None:
    """Three conversations taking turns (each turn reuses its history's KV),
    the engine killed once half way (a crash on the timeline)."""
    rng = random.Random(7)
    talks: list[list[dict]] = [[{"role": "system", "content": f"You are helper number {i}."}] for i in range(3)]
    end, killed = time.monotonic() + seconds, False
    while time.monotonic() < end:
        talk = rng.choice(talks)
        talk.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))})
        try:
            r = requests.post(st.gateway_url + "/v1/chat/completions", timeout=120,
                              headers={"Authorization": f"Bearer {st.key}"},
                              json={"model": "default", "messages": talk, "max_tokens": rng.randint(32, 160),
                                    "temperature": 0.7})
            talk.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
        except (requests.RequestException, KeyError, ValueError):
            talk.pop()
        if not killed and time.monotonic() > end - seconds / 2:
            os.kill(st.engine_pid(), signal.SIGKILL)
            killed = True
            wait_for(st.healthy, 60)
        time.sleep(rng.uniform(0.2, 2.0))


WORDS = ("the", "engine", "answers", "a", "question", "about", "memory", "and", "cache", "while", "agents",
         "call", "tools", "through", "gateway", "model", "stream", "tokens", "fast", "local")


def screenshot(st: Stack, out: Path) -> int:
    with headless_chromium(width=WIDTH, height=1000) as browser:
        driver = browser.driver
        driver.get(f"{st.gateway_url}/ui?every=1")
        driver.find_element("id", "key-input").send_keys(st.key)
        driver.find_element("id", "key-submit").click()
        wait_for(lambda: driver.execute_script("return Number(document.body.dataset.refreshes || 0)") >= 2, 30)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(WIDTH, height + 120)
        time.sleep(1.5)  # a refresh at the new size (the page redraws every second)
        png = driver.get_screenshot_as_png()
        errors = browser.console_errors()
    if errors:
        raise SystemExit(f"the page logged errors: {errors}")
    out.write_bytes(_small(png))
    return out.stat().st_size


def _small(png: bytes) -> bytes:
    """The PNG re-encoded with a palette when it is over MAX_BYTES (Pillow, where installed)."""
    if len(png) <= MAX_BYTES:
        return png
    try:
        import io

        from PIL import Image
    except ImportError:
        return png
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="docs/status-page.png", type=Path)
    parser.add_argument("--traffic-s", type=float, default=120.0)
    args = parser.parse_args()
    if missing():
        print(f"no browser: {missing()}", file=sys.stderr)
        return 1
    from mlxd.engine.model.demo_model import build_demo_model, write_heavy_model_description

    with tempfile.TemporaryDirectory(prefix="mlxd-screenshot-") as tmp, \
            start_standin(models=("llama3.2:3b", "llama3.1:70b")) as ollama:
        root = Path(tmp)
        model = build_demo_model(root / "demo-a", "a")
        more = dumps({"models": {"demo-b": {"path": build_demo_model(root / "demo-b", "b")},
                                 "llama-70b": {"path": write_heavy_model_description(root / "Llama-3.3-70B-Instruct"),
                                               "ollama": "llama3.1:70b"}}})
        st = Stack.create(root / "home", model, gateway={"status_sample_s": SAMPLE_S, "ollama_url": ollama.url},
                          models=more, faults=False)
        try:
            st.up(120)
            traffic(st, args.traffic_s)
            size = screenshot(st, args.out)
        finally:
            st.stop()
    print(f"wrote {args.out} ({size / 1000:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
