#!/usr/bin/env python3
"""Records the first model request each agent client sends, as the client is
released, for the test suite to replay (tests/fixtures/clients/, issue 50).

Two kinds of client:

- The CLI clients, bench/agent_clients.py's (Codex CLI, Claude Code,
  opencode, aider, OpenClaw), installed by it into its cache (`agent_clients.py
  --install-only`), configured as it configures them, each run once with its
  whole default tool set on a plain question.
- The Python agent libraries of the dev extra (openai-agents on Chat
  Completions and on the Responses API, pydantic-ai, instructor,
  langchain-openai, Simon Willison's `llm` CLI), each making the call its
  users make against an OpenAI-compatible base URL (tests/gateway/
  test_agent_clients.py makes the same calls against the gateway): a function
  tool and a structured output. Each runs in a process of its own, retries
  off where the library allows and a timeout, tracing and telemetry off.

In a network namespace of its own with only loopback (`unshare --net`), the
clients talk to a recorder on 127.0.0.1 that keeps every request and answers
each with a 503 in OpenAI's error shape, so a client stops after its first
attempt: no model is needed and no request leaves the machine. What is kept
per client: the route, the request's headers less any key, and its JSON body
(the largest on a model route), with this machine's paths, the key written as
placeholders.

  .venv/bin/python bench/client_requests.py                 # every client, into tests/fixtures/clients/
  .venv/bin/python bench/client_requests.py --only codex,claude
  .venv/bin/python bench/client_requests.py --only libraries   # the Python libraries alone (or: --only cli)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_clients as ac  # noqa: E402
from benchkit import say  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "clients"
MODEL_ROUTES = ("/v1/responses", "/v1/messages", "/v1/chat/completions", "/chat/completions", "/responses")
KEY = "mlxd-recording-key"
SETTLE_S = 5.0
FULL_CASE = {"codex": "text", "claude": "text", "opencode": "text", "aider": "text",  # each client's whole tool set
             "openclaw": "text"}
# OpenClaw retries a refused request 2 s later, larger: its question re-worded as "[Queued user message from a
# previous active turn ...]" with a note to continue the task. Its first request is the one kept.
FIRST_REQUEST = {"openclaw"}


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


def capture(argv: list[str], cwd: Path, env: dict[str, str], recorder: Recorder,
            timeout: float, first_only: bool = False) -> dict[str, Any] | None:
    """Runs a client against the recorder; its request with the largest body
    on a model route (`first_only`: its first), or None."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    # A client may send a small side request first (opencode: a title for the conversation): the requests of
    # the first SETTLE_S after the first one, the largest of them (the turn, with the tools and the prompt).
    # A library that retries the 503 sends the same body again: the first of them is kept.
    deadline, settle = time.monotonic() + timeout, None
    while time.monotonic() < (deadline if settle is None else min(deadline, settle)) and proc.poll() is None:
        if settle is None and any(r["method"] == "POST" and r["path"] in MODEL_ROUTES for r in recorder.records):
            settle = time.monotonic() + (0.0 if first_only else SETTLE_S)
        time.sleep(0.2)
    ac.stop_group(proc)
    model_requests = [r for r in recorder.records if r["method"] == "POST" and r["path"] in MODEL_ROUTES]
    if first_only:
        return model_requests[0] if model_requests else None
    return max(model_requests, key=lambda r: len(r["body"]), default=None)


def replacements_for(base: Path, project: Path, installed: Path | None = None) -> dict[str, str]:
    """`installed`: an npm client's install folder, whose node_modules is
    written as a global install's (OpenClaw lists its bundled skills' files)."""
    out = {str(project): "/home/user/project", str(base): "/home/user", KEY: "<key>",
           str(Path.home()): "/home/user", tempfile.gettempdir(): "/tmp", str(REPO): "/home/user/mlxd",
           # Claude Code names its memory folder after the working directory, slashes as dashes
           str(project).replace("/", "-"): "-home-user-project"}
    if installed is not None:
        out[str(installed / "node_modules")] = "/usr/local/lib/node_modules"
    return out


def fixture_of(request: dict[str, Any], title: str, package: str, version: str | None,
               replacements: dict[str, str]) -> dict[str, Any]:
    """The fixture's shape (pure): the key and this machine's paths as placeholders, no key header."""
    body = json.loads(scrubbed(request["body"].decode(), replacements))
    headers = {k: scrubbed(v, replacements) for k, v in request["headers"].items()
               if k not in ("authorization", "x-api-key", "api-key", "host", "content-length")}
    return {"client": title, "package": package, "version": version, "recorded": dt.date.today().isoformat(),
            "method": "POST", "path": request["path"], "headers": headers, "body": body}


def leftovers(fixture: dict[str, Any], replacements: dict[str, str]) -> list[str]:
    """What scrubbing missed (pure): a path or the key still in the fixture."""
    text = json.dumps(fixture, ensure_ascii=False)
    return [old for old, new in replacements.items() if len(old) > 1 and old != new and old in text]


def record_client(name: str, cache: Path, base: Path, timeout: float) -> dict[str, Any] | None:
    client = ac.CLIENTS[name]
    recorder = Recorder().start()
    cases = ac.CASES[name](client.bin(cache), base / name, ac.client_endpoint(name, recorder.url), KEY)
    case = next(c for c in cases if c.name == FULL_CASE[name])
    say(f"{name}: {' '.join(case.argv[:3])} ... against the recorder")
    first = capture(case.argv, case.cwd, case.env, recorder, timeout, first_only=name in FIRST_REQUEST)
    if first is None:
        say(f"{name}: no model request in {timeout:.0f} s ({len(recorder.records)} other requests)")
        return None
    return fixture_of(first, client.title, client.package, ac.client_version(client, cache),
                      replacements_for(base, base / name, client.folder(cache) if client.registry == "npm" else None))


# --- the Python agent libraries --------------------------------------------------------------------------------
# Each library's call as tests/gateway/test_agent_clients.py makes it (the same models and settings), made by
# `client_requests.py --call NAME --base-url URL` in a process of its own; the recorder's 503 ends it.

MODEL = "default"
CALL_TIMEOUT_S = 30.0  # each library's HTTP timeout; retries are off where the library allows
WEATHER_PROMPT = "What's the weather in Oslo?"


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Weather(Closed):
    city: str = Field(min_length=1, max_length=30)
    temperature_c: int = Field(ge=-50, le=60)


class Person(Closed):
    name: str = Field(min_length=1, max_length=40)
    age: int = Field(ge=0, le=120)
    languages: list[str] = Field(max_length=3)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny, 21 C in {city}"


def call_openai_agents(base_v1: str, api: str = "chat_completions") -> None:
    """An Agent with one function tool and an output_type, made to call the
    tool first, on Chat Completions or the Responses API; tracing off."""
    import openai
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=base_v1, api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT_S)
        model = (OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel)(
            model=MODEL, openai_client=client)
        agent = Agent(name="weather", instructions="Look the weather up, then report it.", model=model,
                      tools=[function_tool(get_weather)], output_type=Weather,
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=60))
        try:
            await Runner.run(agent, WEATHER_PROMPT, max_turns=3)
        finally:
            await client.close()

    asyncio.run(run())


def call_pydantic_ai(base_v1: str) -> None:
    """An agent with a tool and an output type (by pydantic-ai's default, its
    final_result tool) on OpenAIChatModel + OpenAIProvider(base_url, api_key)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_v1, api_key=KEY))
    model.client.max_retries, model.client.timeout = 0, CALL_TIMEOUT_S  # the provider's client retries twice
    agent = Agent(model, output_type=Weather, instructions="Look the weather up, then report it.", retries=0,
                  model_settings={"temperature": 0, "max_tokens": 80})
    agent.tool_plain(get_weather)
    agent.run_sync(WEATHER_PROMPT)


def call_instructor(base_v1: str) -> None:
    """instructor.from_openai(OpenAI(base_url=...)) with a response_model (Mode.TOOLS)."""
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=base_v1, api_key=KEY, max_retries=0,
                                                  timeout=CALL_TIMEOUT_S), mode=instructor.Mode.TOOLS)
    client.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=100,
                                   messages=[{"role": "user", "content": "Describe a programmer."}])


def call_langchain_openai(base_v1: str) -> None:
    """ChatOpenAI(base_url=..., api_key=...).bind_tools([...]) with a named tool."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    @tool
    def get_time(zone: str) -> str:
        """The time in a time zone."""
        return "noon"

    chat = ChatOpenAI(model=MODEL, base_url=base_v1, api_key=KEY, temperature=0, max_tokens=80, max_retries=0,
                      timeout=CALL_TIMEOUT_S)
    chat.bind_tools([get_time, get_weather], tool_choice="get_weather").invoke("Tell me a joke.")


LLM_MODEL_ID = "mlxd"  # the extra OpenAI model's name in llm (`llm -m mlxd`)
LLM_FUNCTIONS = 'def get_weather(city: str) -> str:\n    """The weather in a city."""\n    return f"Sunny in {city}"\n'


def llm_user_dir(user_dir: Path, base_v1: str, key: str) -> Path:
    """llm's user dir (LLM_USER_PATH), mlxd in it as an OpenAI-compatible
    model (extra-openai-models.yaml), its key as `llm keys set mlxd` keeps it."""
    user_dir.mkdir(parents=True, exist_ok=True)
    (user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: {LLM_MODEL_ID}\n  model_name: {MODEL}\n  api_base: {base_v1}\n  api_key_name: mlxd\n"
        "  supports_tools: true\n  supports_schema: true\n")
    (user_dir / "keys.json").write_text(json.dumps({"mlxd": key}))
    return user_dir


@dataclass(frozen=True)
class Library:
    title: str
    package: str  # on PyPI: the one whose version is recorded
    call: Callable[[str], None] | None  # made in `--call NAME`'s process; None: a command of its own (llm)


LIBRARIES = {
    "openai-agents": Library("OpenAI Agents SDK (Chat Completions)", "openai-agents", call_openai_agents),
    "openai-agents-responses": Library("OpenAI Agents SDK (Responses API)", "openai-agents",
                                       lambda base_v1: call_openai_agents(base_v1, "responses")),
    "pydantic-ai": Library("Pydantic AI", "pydantic-ai-slim", call_pydantic_ai),
    "instructor": Library("instructor", "instructor", call_instructor),
    "langchain-openai": Library("LangChain (langchain-openai)", "langchain-openai", call_langchain_openai),
    "llm": Library("LLM (llm CLI)", "llm", None),
}


def library_env(home: Path) -> dict[str, str]:
    """ac.base_env's, and every library's tracing and telemetry off."""
    env = ac.base_env(home)
    env.update(OPENAI_AGENTS_DISABLE_TRACING="1", LANGSMITH_TRACING="false", LANGCHAIN_TRACING_V2="false",
               LANGCHAIN_TRACING="false", LOGFIRE_SEND_TO_LOGFIRE="false", HF_HUB_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def library_argv(name: str, base_v1: str, home: Path, env: dict[str, str]) -> list[str]:
    if name == "llm":  # the CLI installed beside this Python: its default (streamed), one Python function tool
        env["LLM_USER_PATH"] = str(llm_user_dir(home / "llm", base_v1, KEY))
        return [str(Path(sys.executable).parent / "llm"), "-m", LLM_MODEL_ID, "--functions", LLM_FUNCTIONS,
                WEATHER_PROMPT]
    return [sys.executable, str(Path(__file__).resolve()), "--call", name, "--base-url", base_v1]


def record_library(name: str, base: Path, timeout: float) -> dict[str, Any] | None:
    library = LIBRARIES[name]
    recorder = Recorder().start()
    project = base / name
    project.mkdir(parents=True, exist_ok=True)
    env = library_env(project / "home")
    argv = library_argv(name, recorder.url + "/v1", project / "home", env)
    say(f"{name}: {library.package} {installed_version(library.package)} against the recorder")
    first = capture(argv, project, env, recorder, timeout)
    if first is None:
        say(f"{name}: no model request in {timeout:.0f} s ({len(recorder.records)} other requests)")
        return None
    return fixture_of(first, library.title, library.package, installed_version(library.package),
                      replacements_for(base, project))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="cli,libraries",
                   help="client names, or `cli` (the CLI clients) and `libraries` (the Python libraries)")
    p.add_argument("--cache", type=Path, default=ac.CACHE)
    p.add_argument("--out", type=Path, default=FIXTURES)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--call", choices=[n for n, lib in LIBRARIES.items() if lib.call], help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.call:  # one library's call, in this process of its own (record_library's)
        LIBRARIES[args.call].call(args.base_url)  # type: ignore[misc]
        return 0
    groups = {"cli": list(ac.CLIENTS), "libraries": list(LIBRARIES)}
    names = [n for part in args.only.split(",") for n in groups.get(part, [part])]
    if unknown := [n for n in names if n not in ac.CLIENTS and n not in LIBRARIES]:
        raise SystemExit(f"unknown clients {unknown}; known: {', '.join([*ac.CLIENTS, *LIBRARIES])}")
    if not args.in_netns:  # again, inside a namespace with only loopback
        argv = [*ac.netns_prefix(False), sys.executable, __file__, "--in-netns", "--only", ",".join(names),
                "--cache", str(args.cache), "--out", str(args.out), "--timeout", str(args.timeout)]
        return subprocess.call(argv)
    network = ac.loopback_only()
    if not network["isolated"]:
        raise SystemExit(f"not isolated: {network}")
    args.out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="client-requests-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        for name in names:
            got = (record_library(name, base, args.timeout) if name in LIBRARIES
                   else record_client(name, args.cache, base, args.timeout))
            if got is None:
                continue
            if missed := leftovers(got, replacements_for(base, base / name)):
                say(f"{name}: not written: scrubbing left {missed} in it")
                continue
            path = args.out / f"{name}.json"
            path.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
            body = got["body"]
            tools = [(t.get("function") or t).get("name") or t.get("type") for t in body.get("tools") or []]
            say(f"{name} {got['version']}: {got['path']}, {len(json.dumps(body))} bytes, tools {tools[:12]}, "
                f"response_format {(body.get('response_format') or body.get('text', {}).get('format') or {})}, "
                f"keys {sorted(body)} -> {path}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
