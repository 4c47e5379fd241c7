"""A Hugging Face Hub mirror for tests: a folder of repos (`root/org/name/...`)
served over HTTP as the parts of the Hub's API that `huggingface_hub` calls to
look at a repo and download it (what `HF_ENDPOINT` points a client at; the
tests run offline). Not the Hub: no auth, one revision per repo, no Xet.

  GET  /api/models/{org}/{name}[/revision/{rev}]  {"id", "sha", "siblings": [{"rfilename", "size"}]}
  GET  /api/models/{org}/{name}/tree/{rev}        [{"type": "file", "path", "size", "oid"}]
  HEAD/GET /{org}/{name}/resolve/{rev}/{path}     the file, with X-Repo-Commit, ETag and Content-Length;
                                                  a Range request gets 206 (a download resumed)
Test-only: `mirror.requests` lists the paths asked for.

    with serve_mirror(root) as mirror:   # a thread on a free loopback port
        env["HF_ENDPOINT"] = mirror.url
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse


class Mirror:
    def __init__(self, root: Path, server: ThreadingHTTPServer) -> None:
        self.root = root
        self.server = server
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def repo_sha(self, repo: str) -> str:
        """The repo's one revision: a hash of its files' names, sizes and times (a listing reads no file: a
        test's weights may be a sparse file of many GiB)."""
        h = hashlib.sha1()
        for f in sorted((self.root / repo).rglob("*")):
            if f.is_file():
                h.update(file_oid(f, self.root / repo).encode())
        return h.hexdigest()


def file_oid(f: Path, folder: Path) -> str:
    st = f.stat()
    return hashlib.sha1(f"{f.relative_to(folder).as_posix()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def _handler(mirror: Mirror) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _not_found(self, head: bool) -> None:
            body = json.dumps({"error": "Repository not found"}).encode()
            self._send(404, body, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                                   "X-Error-Code": "RepoNotFound"}, head)

        def _serve(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            mirror.requests.append(path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = "/".join(parts[2:4])
                folder = mirror.root / repo
                if not folder.is_dir():
                    return self._not_found(head)
                files = sorted(f for f in folder.rglob("*") if f.is_file())
                if len(parts) >= 6 and parts[4] == "tree":  # the file listing snapshot_download walks
                    body = json.dumps([{"type": "file", "path": f.relative_to(folder).as_posix(),
                                        "size": f.stat().st_size, "oid": file_oid(f, folder)}
                                       for f in files]).encode()
                    return self._send(200, body, {"Content-Type": "application/json",
                                                  "Content-Length": str(len(body))}, head)
                body = json.dumps({"id": repo, "modelId": repo, "sha": mirror.repo_sha(repo), "private": False,
                                   "siblings": [{"rfilename": f.relative_to(folder).as_posix(), "size": f.stat().st_size}
                                                for f in files]}).encode()
                return self._send(200, body, {"Content-Type": "application/json", "Content-Length": str(len(body))},
                                  head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                f = mirror.root / repo / name
                if not f.is_file():
                    return self._not_found(head)
                data = f.read_bytes()
                headers = {"X-Repo-Commit": mirror.repo_sha(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
                wanted = self.headers.get("Range", "")
                if wanted.startswith("bytes=") and not head:
                    start = int(wanted[6:].split("-")[0] or 0)
                    part = data[start:]
                    headers.update({"Content-Length": str(len(part)),
                                    "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
                    return self._send(206, part, headers, head)
                headers["Content-Length"] = str(len(data))
                return self._send(200, data, headers, head)
            return self._not_found(head)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._serve(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(head=True)

    return Handler


@contextmanager
def serve_mirror(root: Path) -> Iterator[Mirror]:
    """The mirror on a free loopback port, in a thread, for the `with` block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    mirror = Mirror(root, server)
    server.RequestHandlerClass = _handler(mirror)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield mirror
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
