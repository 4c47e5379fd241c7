"""Security sweep (part of it): the supervisor's control socket is the
owner's only, and nothing over HTTP can turn fault injection on."""

from __future__ import annotations

import os
import stat

import pytest
import requests

from testkit import chat

pytestmark = pytest.mark.timeout(180)


def test_control_socket_and_run_dir_are_the_owners_only(stack):
    st = stack()
    sock = os.stat(st.paths.socket)
    assert stat.S_ISSOCK(sock.st_mode) and sock.st_mode & 0o777 == 0o700
    assert os.stat(st.paths.run).st_mode & 0o777 == 0o700
    assert sock.st_uid == os.getuid()


def test_fault_injection_cannot_be_turned_on_over_http(stack):
    st = stack()
    pid = st.engine_pid()
    attempts = [
        {"headers": {"X-Mlxd-Fault": "abort@start", "MLXD_FAULT": "abort@start"}},
        {"params": {"fault": "abort@start", "MLXD_FAULT": "abort@start"}},
        {"extra": {"mlxd_fault": "abort@start", "MLXD_FAULT": "abort@start", "fault": "abort@token:1"}},
    ]
    for attempt in attempts:
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                **attempt.get("extra", {})}
        r = requests.post(st.url + "/v1/chat/completions", json=body, headers=attempt.get("headers"),
                          params=attempt.get("params"), timeout=60)
        assert r.status_code == 200, r.text
    assert chat(st.url).status_code == 200
    assert st.engine_pid() == pid and st.records() == []  # never crashed
    assert not st.fault_file.exists()
