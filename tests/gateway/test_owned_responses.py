"""Stored responses belong to the key that made them (issue 52, item 2):
through the gateway, on the fast path and on LiteLLM's, a response is read,
continued and deleted with the key that made it; under another key (after
`mlxd key rotate`), by a client that forges the gateway's owner header, or
by a caller of the engine's own port, it is as an unknown id. Stored
responses expire (`engine.stored_responses_ttl`)."""

from __future__ import annotations

import openai
import pytest
import requests

from mlxd.gateway.keys import owner_of_key
from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
FEW = {"max_output_tokens": 4, "temperature": 0}


def client_of(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=60)


def stored(st, response_id: str, method: str = "GET", **headers) -> requests.Response:
    return requests.request(method, f"{st.gateway_url}/v1/responses/{response_id}", timeout=30,
                            headers={"Authorization": f"Bearer {st.key}", **headers})


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_a_response_is_read_continued_and_deleted_by_its_key_alone(stack, fast_path):
    st = stack(gateway=f"engine_fast_path = {str(fast_path).lower()}")
    client = client_of(st)
    r = client.responses.create(model="default", input="remember the word plum", **FEW)
    got = stored(st, r.id)
    assert got.status_code == 200 and got.json()["id"] == r.id
    assert got.json()["output"][-1]["content"][0]["text"] == r.output_text
    follow = client.responses.create(model="default", previous_response_id=r.id, input="and?", **FEW)
    assert follow.usage.input_tokens > r.usage.input_tokens  # it continued the conversation

    # A forged owner header is the gateway's to set: a client's own is dropped.
    forged = stored(st, r.id, **{"x-mlxd-owner": owner_of_key("sk-mlxd-someone-else")})
    assert forged.status_code == 200
    # The engine's own port, with the engine's key but not the caller's: as an unknown id.
    assert requests.get(f"{st.url}/v1/responses/{r.id}", timeout=10).status_code == 404

    old_key = st.key
    assert st.mlxd("key", "rotate").returncode == 0 and st.key != old_key
    other = client_of(st)  # the new key: another caller
    assert stored(st, r.id).status_code == 404 and stored(st, r.id, "DELETE").status_code == 404
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's answer for an id it does not know
        other.responses.create(model="default", previous_response_id=follow.id, input="tell me", **FEW)
    assert info.value.body["code"] == "previous_response_not_found", info.value.body["message"]
    before = set(st.paths.responses.iterdir())  # the other key's two, kept unread
    mine = other.responses.create(model="default", input="a new one", **FEW)
    assert len(set(st.paths.responses.iterdir()) - before) == 1
    deleted = stored(st, mine.id, "DELETE")
    assert deleted.status_code == 200 and deleted.json() == {"id": mine.id, "object": "response.deleted",
                                                             "deleted": True}
    assert stored(st, mine.id).status_code == 404
    assert set(st.paths.responses.iterdir()) == before and len(before) == 2


def test_a_stored_response_expires(stack):
    st = stack(engine="stored_responses_ttl = \"2s\"\n", gateway="")
    r = client_of(st).responses.create(model="default", input="short-lived", **FEW)
    assert stored(st, r.id).status_code == 200
    wait_until(lambda: stored(st, r.id).status_code == 404, 30, 0.25, what="the response to expire")
    assert not (st.paths.responses / f"{r.id}.json").exists()


def test_stored_routes_without_the_engine_say_so(stack):
    st = stack(gateway="")
    r = client_of(st).responses.create(model="default", input="kept", **FEW)
    from mlxd.supervisor.control import rpc

    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        down = stored(st, r.id)
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
        assert down.headers["retry-after"] == "2"
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
        wait_until(st.healthy, 60, what="engine back")
    assert stored(st, r.id).status_code == 200
