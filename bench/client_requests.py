#!/usr/bin/env python3
"""Records the first model request each agent client sends, as the client is
released, for the test suite to replay (tests/fixtures/clients/, issue 50).

The clients are bench/agent_clients.py's (Codex CLI, Claude Code, opencode,
aider), installed by it into its cache (`agent_clients.py --install-only`),
configured as it configures them, each run once with its whole default tool
set on a plain question. In a network namespace of its own with only
loopback (`unshare --net`), the clients talk to a recorder on 127.0.0.1 that
keeps every request and answers each with a 503 in OpenAI's error shape, so
a client stops after its first attempt: no model is needed and no request
leaves the machine. What is kept per client: the route, the request's
headers less any key, and its JSON body, with this machine's paths, the
key written as placeholders.

  .venv/bin/python bench/client_requests.py                 # all four, into tests/fixtures/clients/
  .venv/bin/python bench/client_requests.py --only codex,claude
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_clients as ac  # noqa: E402
from benchkit import say  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "clients"
MODEL_ROUTES = ("/v1/responses", "/v1/messages", "/v1/chat/completions", "/chat/completions", "/responses")
KEY = "mlxd-recording-key"
SETTLE_S = 5.0
FULL_CASE = {"codex": "text", "claude": "text", "opencode": "text", "aider": "text"}  # each client's whole tool set


class Recorder:
    """An HTTP server on loopback that keeps every request and answers 503."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> "Recorder":
        threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True).start()
        self._ready.wait(30)
        return self

    async def _serve(self) -> None:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            self.records.append({"method": request.method, "path": request.path,
                                 "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body})
            return web.json_response({"error": {"message": "recorded; no model here", "type": "server_error",
                                                "code": "engine_unavailable"}}, status=503)

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        await asyncio.Event().wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def scrubbed(text: str, replacements: dict[str, str]) -> str:
    """This run's paths and key as placeholders (pure): longest first."""
    for old in sorted(replacements, key=len, reverse=True):
        text = text.replace(old, replacements[old])
    return text


def record_client(name: str, cache: Path, base: Path, timeout: float) -> dict[str, Any] | None:
    client = ac.CLIENTS[name]
    recorder = Recorder().start()
    cases = ac.CASES[name](client.bin(cache), base / name, ac.client_endpoint(name, recorder.url), KEY)
    case = next(c for c in cases if c.name == FULL_CASE[name])
    say(f"{name}: {' '.join(case.argv[:3])} ... against the recorder")
    proc = subprocess.Popen(case.argv, cwd=case.cwd, env=case.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    # A client may send a small side request first (opencode: a title for the conversation): the requests of
    # the first SETTLE_S after the first one, the largest of them (the turn, with the tools and the prompt).
    deadline, settle = time.monotonic() + timeout, None
    while time.monotonic() < (deadline if settle is None else min(deadline, settle)) and proc.poll() is None:
        if settle is None and any(r["method"] == "POST" and r["path"] in MODEL_ROUTES for r in recorder.records):
            settle = time.monotonic() + SETTLE_S
        time.sleep(0.2)
    ac.stop_group(proc)
    model_requests = [r for r in recorder.records if r["method"] == "POST" and r["path"] in MODEL_ROUTES]
    first = max(model_requests, key=lambda r: len(r["body"]), default=None)
    if first is None:
        say(f"{name}: no model request in {timeout:.0f} s ({len(recorder.records)} other requests)")
        return None
    replacements = {str(base / name): "/home/user/project", str(base): "/home/user", KEY: "<key>",
                    str(Path.home()): "/home/user", tempfile.gettempdir(): "/tmp",
                    # Claude Code names its memory folder after the working directory, slashes as dashes
                    str(base / name).replace("/", "-"): "-home-user-project"}
    body = json.loads(scrubbed(first["body"].decode(), replacements))
    headers = {k: scrubbed(v, replacements) for k, v in first["headers"].items()
               if k not in ("authorization", "x-api-key", "api-key", "host", "content-length")}
    return {"client": client.title, "package": client.package, "version": ac.client_version(client, cache),
            "recorded": "2026-12-07", "method": "POST", "path": first["path"], "headers": headers, "body": body}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(ac.CLIENTS))
    p.add_argument("--cache", type=Path, default=ac.CACHE)
    p.add_argument("--out", type=Path, default=FIXTURES)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.in_netns:  # again, inside a namespace with only loopback
        argv = [*ac.netns_prefix(False), sys.executable, __file__, "--in-netns", "--only", args.only,
                "--cache", str(args.cache), "--out", str(args.out), "--timeout", str(args.timeout)]
        return subprocess.call(argv)
    network = ac.loopback_only()
    if not network["isolated"]:
        raise SystemExit(f"not isolated: {network}")
    args.out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="client-requests-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        for name in args.only.split(","):
            got = record_client(name, args.cache, base, args.timeout)
            if got is not None:
                path = args.out / f"{name}.json"
                path.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
                say(f"{name}: {got['path']}, {len(json.dumps(got['body']))} bytes, "
                    f"tools {[t.get('type') or 'function' for t in got['body'].get('tools') or []][:12]} -> {path}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
