"""Several engines behind one gateway (issue 15): a model's `hosts` become
one LiteLLM model group. Real processes on loopback: the stack (supervisord,
the local engine, the gateway), more `mlxd engine`s standing in for other
Macs (each with its own home, requiring the engine key), and the Ollama
stand-in. A busy host's request goes to another host, not to Ollama; a host
that dies costs no request and serves again once restarted; Ollama answers
only when every host is out; a host with the wrong key is passed over.
LiteLLM picks among hosts at random, so the tests ask until the host in
question was picked (with a deadline), never a fixed number of times."""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading

import anthropic
import openai
import pytest
import requests

from conftest import engine_toml
from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.devkit.ports import free_port
from mlxd.keyfile import ENGINE_KEY_PREFIX, ensure_key_file
from mlxd.paths import StatePaths
from mlxd.toml_text import dumps, table_lines
from testkit import EngineProcess, spawn_engine, wait_healthy, wait_until

pytestmark = pytest.mark.timeout(600)
OLLAMA_MODEL = "llama3.2:3b"
OCCUPY = "occupy this host"  # a prompt that hangs the worker of an engine with the fault file below
# Remote hosts keep no queue, so a busy one answers 429 at once; no shutdown grace for a hung one.
# The occupied host's hang must read as busy (429, /health 200) for the whole module, however slow
# the machine: its stuck check (default 30 s) would otherwise turn it into a 503 partway through.
REMOTE_ENGINE = {"require_key": True, "max_queue": 0, "shutdown_grace_s": 0, "stuck_grace_s": 3600}


def served(ep: EngineProcess, key: str, status: str = "200") -> float:
    """Chat completions this engine answered with `status` (its own /metrics)."""
    text = requests.get(ep.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=5).text
    pattern = rf'^mlxd_engine_requests_total{{[^}}]*endpoint="/v1/chat/completions"[^}}]*status="{status}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def ask(client: openai.OpenAI, model: str = "demo-a", stream: bool = False) -> str:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=4, temperature=0, stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return answer.choices[0].message.content


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield standin


@pytest.fixture(scope="module")
def fleet(module_stack, tmp_path_factory, demo_models, ollama):
    """The stack with model demo-a on three engines (two 'other Macs' first,
    then this Mac's), and model `far` on two hosts that never answer."""
    remote_ports = [free_port(), free_port()]
    dead = [free_port(), free_port()]
    hosts = [f"127.0.0.1:{p}" for p in remote_ports] + ["local"]
    st = module_stack(gateway=table_lines({"ollama_url": ollama.url, "host_cooldown_s": 1}),
                      models=table_lines({"hosts": hosts, "ollama": OLLAMA_MODEL})
                      + dumps({"models": {"far": {"path": demo_models.a, "ollama": OLLAMA_MODEL,
                                                  "hosts": [f"127.0.0.1:{p}" for p in dead]}}}))
    key = st.paths.engine_key.read_text().strip()  # the gateway made it; every host gets a copy
    remotes = []
    try:
        for port in remote_ports:
            home = tmp_path_factory.mktemp("mac")
            shutil.copy(st.paths.engine_key, StatePaths(home).engine_key)
            (home / "fault").write_text("hang@start")
            remotes.append(spawn_engine(home, engine_toml(demo_models, REMOTE_ENGINE), port=port, env={
                "MLXD_FAULT_FILE": str(home / "fault"), "MLXD_FAULT_MATCH": OCCUPY}))
        for ep in remotes:
            wait_healthy(ep)
        client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
        yield st, remotes, key, client
    finally:
        for ep in remotes:
            ep.stop()


def test_a_busy_host_sends_its_request_to_another_host_not_to_ollama(fleet, ollama):
    st, (first, _), key, client = fleet
    # Keep the first host (the one LiteLLM tries first) busy with a request that never ends.
    def occupy() -> None:
        try:  # until it is admitted (the probe below may hold the worker for a moment); then it never ends
            while requests.post(first.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "demo-a", "messages": [{"role": "user", "content": OCCUPY}]},
                                timeout=600).status_code == 429:
                pass
        except requests.RequestException:
            pass  # the engine was stopped at the end of the module

    hung = threading.Thread(target=occupy, daemon=True)
    hung.start()

    def busy() -> bool:
        return requests.post(first.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "demo-a", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 1}, timeout=60).status_code == 429

    wait_until(busy, 60, what="the host busy")
    refused_before = served(first, key, "429")
    ollama_before = ollama.stats()["chat_requests"]
    answers: list[str] = []

    def refused_by_the_busy_host() -> bool:  # LiteLLM picks hosts at random: ask until it picked that one
        answers.append(ask(client, stream=len(answers) % 2 == 1))
        return served(first, key, "429") > refused_before

    wait_until(refused_by_the_busy_host, 60, interval=0, what="a request sent to the busy host")
    assert not any(a.startswith(marker(OLLAMA_MODEL).strip()) for a in answers), answers
    assert ollama.stats()["chat_requests"] == ollama_before  # MLX answered every one, that one too
    hung.join(10)


def test_a_host_that_dies_costs_no_request_and_serves_again_once_back(fleet, ollama):
    st, (_, second), key, client = fleet
    second.proc.send_signal(signal.SIGKILL)
    second.proc.wait(10)
    ollama_before = ollama.stats()["chat_requests"]
    # With the first host still busy (the test above), a request may meet both the dead and the busy
    # host before the healthy one: each host that failed it is left out of its next pick.
    answers = [ask(client, stream=i % 2 == 1) for i in range(20)]
    claude = anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=120)
    answers += [block.text for _ in range(4) for block in claude.messages.create(
        model="demo-a", max_tokens=4, messages=[{"role": "user", "content": "hello"}]).content]
    assert all(a and not a.startswith(marker(OLLAMA_MODEL).strip()) for a in answers), answers
    assert ollama.stats()["chat_requests"] == ollama_before  # the other engines took them all
    # Restarted on its port, it gets traffic again on its own once its cooldown (1 s) ends.
    back = spawn_engine(second.home, (second.home / "mlxd.toml").read_text(), env=second.extra_env,
                        port=second.port)
    fleet[1][1] = back  # stopped by the fixture
    wait_healthy(back)

    def served_by_it() -> bool:
        ask(client)
        return served(back, key) >= 1

    wait_until(served_by_it, 60, interval=0.2, what="the host back in rotation")


def test_ollama_answers_only_when_every_host_is_out(fleet, ollama):
    _, _, _, client = fleet
    before = ollama.stats()["chat_requests"]
    for stream in (False, True):
        assert ask(client, model="far", stream=stream).startswith(marker(OLLAMA_MODEL).strip())
    assert ollama.stats()["chat_requests"] == before + 2


def test_a_host_with_another_key_is_passed_over(stack, tmp_path_factory, demo_models, ollama):
    home = tmp_path_factory.mktemp("mac")
    other_key = ensure_key_file(StatePaths(home).engine_key, ENGINE_KEY_PREFIX)  # not the gateway's key
    port = free_port()
    st = stack(gateway=table_lines({"ollama_url": ollama.url}),
               models=table_lines({"hosts": [f"127.0.0.1:{port}", "local"], "ollama": OLLAMA_MODEL}))
    wrong = spawn_engine(home, engine_toml(demo_models, REMOTE_ENGINE), port=port)
    try:
        wait_healthy(wrong)
        client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
        before = ollama.stats()["chat_requests"]
        answers: list[str] = []

        def refused_by_the_wrong_host() -> bool:
            answers.append(ask(client))
            return served(wrong, other_key, "401") >= 1

        wait_until(refused_by_the_wrong_host, 60, interval=0, what="a request sent to the host with another key")
        assert not any(a.startswith(marker(OLLAMA_MODEL).strip()) for a in answers), answers
        assert ollama.stats()["chat_requests"] == before  # this Mac's engine answered, that one too
        assert served(wrong, other_key) == 0
    finally:
        wrong.stop()


def test_status_shows_every_host(fleet):
    st, remotes, _, _ = fleet
    status = json.loads(st.mlxd("status", "--json").stdout)
    hosts = {h["url"]: h for h in status["hosts"]}
    far = [u for u, h in hosts.items() if h["models"] == ["far"]]
    assert len(far) == 2 and all(hosts[u]["http_status"] is None for u in far)  # nobody there
    for ep in remotes:
        assert hosts[ep.bare_url]["models"] == ["demo-a"] and hosts[ep.bare_url]["http_status"] == 200
    text = st.mlxd("status").stdout
    assert all(f"host          {ep.bare_url}  " in text for ep in remotes), text
    assert text.count("no answer") >= 2 and "(serves far)" in text
