"""The Host header check (core/host_check.py) and the engine key's header
forms (core/keyfile.py), as tables."""

from __future__ import annotations

import base64

import pytest

from mlxd.host_check import ANY_HOST, host_allowed, host_name, is_ip_literal, served_names
from mlxd.keyfile import authorization_key

NAMES = served_names("127.0.0.1", ["studio.lan"], own=["mac-studio", "mac-studio.local"])


@pytest.mark.parametrize("header, name", [
    ("localhost:4000", "localhost"), ("LOCALHOST", "localhost"), ("example.com.", "example.com"),
    ("[::1]:8080", "::1"), ("[fe80::1%en0]", "fe80::1%en0"), ("::1", "::1"), ("10.0.0.2:80", "10.0.0.2"),
    (" studio.lan ", "studio.lan"),
])
def test_the_name_in_a_host_header(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("header, allowed", [
    (None, True),  # no header: not a browser
    ("127.0.0.1:8080", True), ("[::1]:4000", True), ("192.168.1.20", True), ("10.1.2.3:9", True),
    ("localhost", True), ("localhost.:4000", True), ("host.docker.internal:4000", True),
    ("gateway.docker.internal", True), ("mac-studio", True), ("Mac-Studio.local:4000", True),
    ("studio.lan:8080", True),
    ("evil.example", False), ("evil.example:4000", False), ("127.0.0.1.nip.io", False),
    ("localhost.evil.example", False), ("studio.lan.evil.example", False), ("", False), ("laptop.lan", False),
])
def test_which_hosts_are_answered(header, allowed):
    assert host_allowed(header, NAMES) is allowed


def test_a_bind_name_is_served_and_any_host_turns_the_check_off():
    assert host_allowed("mybox.lan", served_names("mybox.lan", []))
    assert not host_allowed("mybox.lan", served_names("0.0.0.0", []))
    assert host_allowed("anything.example", served_names("127.0.0.1", [ANY_HOST]))


@pytest.mark.parametrize("name, literal", [
    ("127.0.0.1", True), ("::1", True), ("fe80::1%en0", True), ("localhost", False), ("1.2.3", False),
    ("999.1.1.1", False),
])
def test_ip_literals(name, literal):
    assert is_ip_literal(name) is literal


def basic(userinfo: str) -> str:
    return "Basic " + base64.b64encode(userinfo.encode()).decode()


@pytest.mark.parametrize("header, key", [
    ("Bearer sk-1", "sk-1"), ("bearer  sk-1 ", "sk-1"), (basic("mlxd:sk-1"), "sk-1"), (basic(":sk-1"), "sk-1"),
    (basic("sk-1"), None), (basic("mlxd:"), None), ("Basic !!!", None), ("Basic " + base64.b64encode(b"\xff:x")
                                                                           .decode(), None),
    ("Token sk-1", None), ("", None), (None, None),
])
def test_the_key_in_an_authorization_header(header, key):
    assert authorization_key(header) == key
