"""The `Host` header check of every HTTP port mlxd opens (DNS rebinding).

A web page the user opens can reach a loopback port by DNS rebinding: its
own name (evil.example) is made to resolve to 127.0.0.1, and the browser
then sends the page's requests there, with `Host: evil.example` (Ollama's
CVE-2024-28224). A server that answers only the names it serves refuses
them. An address written as an IP literal cannot be rebound, so every IP
literal passes, as do `localhost`, Docker's name for the host
(`host.docker.internal`, how a container reaches a Mac's services), this
machine's own names and the names a config adds (`allowed_hosts`, or `"*"`
for any). The key check stays the boundary; this closes the browser's way
around it. Pure, but for HostCheck, its thin ASGI shell.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable
from typing import Any

from mlxd.api_errors import error_body_for

BUILT_IN_NAMES = ("localhost", "host.docker.internal", "gateway.docker.internal")
ANY_HOST = "*"


def host_name(host_header: str) -> str:
    """The name in a `Host` header value, without its port, lower case and
    without a trailing dot (pure): `[::1]:4000` -> `::1`, `Example.:80` -> `example`."""
    value = host_header.strip().lower()
    if value.startswith("["):  # an IPv6 literal, maybe with a port
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])  # an IPv6 zone (fe80::1%en0) is still a literal
    except ValueError:
        return False
    return True


def served_names(bind_host: str, allowed: Iterable[str], own: Iterable[str] = ()) -> frozenset[str]:
    """The names a server answers to (pure): the built-in ones, its bind
    address's name, this machine's `own` names and the configured `allowed`."""
    names = {*BUILT_IN_NAMES, *(n.strip().lower().rstrip(".") for n in (*allowed, *own) if n.strip())}
    if bind_host and not is_ip_literal(host_name(bind_host)):
        names.add(host_name(bind_host))
    return frozenset(names)


def host_allowed(host_header: str | None, names: frozenset[str]) -> bool:
    """Whether a request with this `Host` may be answered (pure). No header
    at all is allowed: browsers always send one (HTTP/1.0 tools may not)."""
    if host_header is None or ANY_HOST in names:
        return True
    name = host_name(host_header)
    return is_ip_literal(name) or name in names


def machine_names() -> tuple[str, ...]:
    """This machine's own names, as other machines on a LAN may call it
    (`mac-studio`, `mac-studio.local`, its fully qualified name)."""
    short = socket.gethostname().lower().rstrip(".")
    names = {short, short.split(".", 1)[0] + ".local"}
    try:
        names.add(socket.getfqdn().lower().rstrip("."))
    except OSError:
        pass
    return tuple(n for n in names if n)


class HostCheck:
    """ASGI middleware: a request whose `Host` is not one of `names` gets
    400 in the route's error shape before anything else reads it."""

    def __init__(self, app: Any, names: frozenset[str], setting: str) -> None:
        self.app = app
        self.names = names
        self.setting = setting  # where to add a name, for the error's message

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope.get("headers") or () if k == b"host"), None)
            if not host_allowed(host, self.names):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 4400})
                    return
                message = (f"this server does not answer to the name {host_name(host or '')!r} (a DNS-rebinding "
                           f"guard): use its address, or add the name to {self.setting}")
                body = json.dumps(error_body_for(scope.get("path", ""), 400, message, "invalid_host")).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
