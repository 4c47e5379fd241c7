"""Bystanders of a crash are answered by the engine (issue 52, item 4),
through the whole stack: four agents' requests decoded in one batch, one of
them poison (it aborts the engine at its 6th token, every time). The
engine dies with all four in flight; the gateway holds what it lost for the
restart and sends it again (routing.hold_for_restart). The quarantine
blames nobody for a crash in a batch: all four are suspects, decoded alone
from then on. The poison one is sent first, so its retry comes first to the
restarted engine and the bystanders' queue behind it: its second crash
loses them again, and as they were lost with others the first time, the
gateway sends them a second time (once only, they went to Ollama: the
issue's 4 of 5). The three bystanders are answered by the engine; the
poison one, quarantined at its second crash, by Ollama."""

from __future__ import annotations

import openai
import pytest

from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.toml_text import table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
POISON_WORD = "poison"
OLLAMA_MODEL = "llama3.2:3b"


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL,)) as standin:
        yield standin


def test_bystanders_of_a_crash_are_answered_by_the_engine(stack, ollama):
    st = stack(engine=table_lines({"max_concurrency": 4, "batching": "always", "max_queue": 8}),
               gateway=table_lines({"ollama_url": ollama.url, "default_ollama_model": OLLAMA_MODEL}),
               env={"MLXD_FAULT_MATCH": POISON_WORD}, fault="abort@token:6")
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=240)
    prompts = [f"the {POISON_WORD} pill"] + [f"Agent {i}: summarise the build log, part {i}." for i in range(3)]

    def ask(content: str) -> str:
        r = client.chat.completions.create(model="default", max_tokens=64, temperature=0,
                                           messages=[{"role": "user", "content": content}])
        return r.choices[0].message.content or ""

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    from_ollama = [a.startswith(marker(OLLAMA_MODEL).split(":")[0]) for a in answers]
    assert from_ollama == [True, False, False, False], answers
    records = st.records()
    assert len(records) >= 2 and max(len(r.fingerprints()) for r in records) >= 2  # a crash with others in flight
    wait_until(lambda: st.healthy(), 60, what="the engine back")
    assert st.status()["quarantined_requests"] == 1
