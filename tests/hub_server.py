"""A loopback HTTP server that speaks enough of the Hugging Face Hub's download API for the real
``huggingface_hub`` client (``hf_hub_download``, ``snapshot_download``): model info, file tree, and
HEAD/GET on ``/{repo}/resolve/{rev}/{path}`` with the headers the client checks. 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str = field(default="")

    def __post_init__(self) -> None:
        if not self.sha:
            h = hashlib.sha1()
            for name in sorted(self.files):
                h.update(name.encode() + hashlib.sha1(self.files[name]).digest())
            self.sha = h.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    repos: dict[str, FakeRepo] = {}
    requests: list[str] = []

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _not_found(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> None:
        path = unquote(self.path.split("?")[0])
        self.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self.repos.get(f"{parts[2]}/{parts[3]}")
            if repo is None:
                return self._not_found("RepoNotFound")
            if len(parts) >= 6 and parts[4] == "tree":
                return self._json([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for p, b in sorted(repo.files.items())])
            return self._json({"id": f"{parts[2]}/{parts[3]}", "sha": repo.sha,
                               "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repos.get(f"{parts[0]}/{parts[1]}")
            if repo is None:
                return self._not_found("RepoNotFound")
            if parts[3] not in ("main", repo.sha):
                return self._not_found("RevisionNotFound")
            data = repo.files.get("/".join(parts[4:]))
            if data is None:
                return self._not_found("EntryNotFound")
            self.send_response(200)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)
            return None
        return self._not_found("RepoNotFound")

    do_GET = _route
    do_HEAD = _route


@contextmanager
def fake_hub(repos: dict[str, FakeRepo]) -> Iterator[str]:
    """Serve ``repos`` on 127.0.0.1; yields the endpoint URL for ``HF_ENDPOINT``."""
    handler = type("Handler", (_Handler,), {"repos": repos, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
