"""A loopback HTTP server that speaks enough of the Hugging Face Hub's API for the real ``huggingface_hub``
client (``snapshot_download``, ``hf_hub_download``, ``HfApi.model_info``/``list_repo_tree``/``resolve_revision``).
127.0.0.1 only, stdlib only.

What it serves, the way huggingface.co does:
- ``GET /api/models/{repo}[/revision/{rev}]``: model info with ``sha`` and ``siblings`` (sizes, blob ids and
  LFS data with ``?blobs=true``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file tree at a revision (``recursive``);
- ``GET /api/models/{repo}/refs``: branches and tags with their ``targetCommit`` (``pullRequests`` too with
  ``?include_prs=1``), which llama.cpp's ``-hf`` asks first to pin the commit it lists and downloads;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: small files straight away with ``ETag`` (git blob id) and
  ``X-Repo-Commit``; LFS files (weights, GGUF) as a 302 to a second origin (the "CDN", another port) with
  ``X-Linked-Size``, ``X-Linked-Etag`` (sha256) and ``X-Repo-Commit``;
- HTTP ``Range`` (206 with ``Content-Range``) on both origins;
- errors with the ``X-Error-Code`` the client keys on: ``RepoNotFound`` (404, or 401 for a private repo and
  no valid token), ``GatedRepo`` (401 without a token, 403 with one the repo did not grant),
  ``RevisionNotFound``, ``EntryNotFound``; an unknown token gets 401 "Invalid credentials".

And the writes ``HfApi.create_repo``, ``create_branch``, ``get_paths_info`` and ``create_commit`` make, with a
token (none: 401): ``POST /api/repos/create`` (409 when the repo exists), ``POST /api/models/{repo}/branch/{name}``,
``POST /api/models/{repo}/paths-info/{rev}``, ``POST /api/validate-yaml``, ``POST .../preupload/{rev}`` (``lfs``
for weights and GGUF files, with the remote ``oid`` of a file already there), the LFS batch API
(``{repo}.git/info/lfs/objects/batch``: no action for content the Hub already stores), the upload ``PUT`` and its
verify ``POST``, and ``POST .../commit/{rev}`` (NDJSON: files, LFS files, deletions) which makes a new commit.

A :class:`FakeRepo` has a history: ``push`` moves a branch to a new commit, so a pinned old commit and a newer
``main`` are both served. :class:`FakeHub` logs every request and can cut a file's download after N bytes
(the connection is closed mid-body), to exercise resume. With ``rate``, every file body (both origins, every
connection together) is sent at that many bytes per second in total, a link of that speed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".onnx", ".ckpt")


_DIGESTS: dict[tuple[str, int], tuple[bytes, str]] = {}  # (kind, id of the bytes) -> (the bytes, kept alive; hex)
_DIGESTS_LOCK = threading.Lock()


def _digest(kind: str, data: bytes) -> str:
    """A file's hash, computed once per content object: the Hub stores these with the file and answers every request
    from them, so a loopback Hub that hashed gigabytes on each HEAD and range request would time itself, not us."""
    key = (kind, id(data))
    with _DIGESTS_LOCK:
        hit = _DIGESTS.get(key)
    if hit is not None and hit[0] is data:
        return hit[1]
    h = hashlib.sha256(data) if kind == "sha256" else hashlib.sha1(b"blob %d\0" % len(data) + data)
    hexdigest = h.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[key] = (data, hexdigest)
    return hexdigest


def git_blob_id(data: bytes) -> str:
    """The git object id of a file, which the Hub sends as ``oid`` and as the ETag of a non-LFS file."""
    return _digest("blob", data)


def content_sha256(data: bytes) -> str:
    """The sha256 the Hub sends for an LFS file (``lfs.oid``, ``X-Linked-Etag``, the CDN's ETag)."""
    return _digest("sha256", data)


def is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


class FakeRepo:
    """A model repo with commits, branches and tags. ``FakeRepo(files)`` is one commit on ``main``."""

    def __init__(self, files: dict[str, bytes], sha: str = "", *, gated: bool = False, private: bool = False,
                 tokens: Iterable[str] = ()) -> None:
        self.commits: dict[str, dict[str, bytes]] = {}
        self.refs: dict[str, str] = {}
        self.tags: set[str] = set()  # the names in ``refs`` that are tags; the rest are branches
        self.gated, self.private, self.tokens = gated, private, set(tokens)
        self.push(files, sha=sha)

    @classmethod
    def of_folder(cls, folder: Path) -> FakeRepo:
        """One commit holding the files at the top of ``folder`` (a fixture repo made on disk)."""
        return cls({p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()})

    def push(self, files: dict[str, bytes], *, branch: str = "main", sha: str = "") -> str:
        """A new commit with exactly ``files`` on ``branch`` (created if new); returns its sha."""
        parent = self.refs.get(branch, "")
        if not sha:
            h = hashlib.sha1(parent.encode())
            for name in sorted(files):
                h.update(name.encode() + hashlib.sha1(files[name]).digest())
            sha = h.hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        self.tags.discard(branch)
        return sha

    def tag(self, name: str, commit: str) -> None:
        self.refs[name] = commit
        self.tags.add(name)

    def git_refs(self, include_prs: bool = False) -> dict[str, list[dict[str, str]]]:
        """The body of ``GET /api/models/{repo}/refs`` as huggingface.co sends it."""
        def entries(tags: bool) -> list[dict[str, str]]:
            kind = "tags" if tags else "heads"
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": c}
                    for n, c in sorted(self.refs.items()) if (n in self.tags) == tags]
        out = {"branches": entries(False), "converts": [], "tags": entries(True)}
        return out | {"pullRequests": []} if include_prs else out

    @property
    def sha(self) -> str:
        """The commit ``main`` points at now."""
        return self.refs["main"]

    @property
    def files(self) -> dict[str, bytes]:
        return self.commits[self.sha]

    def at(self, revision: str) -> str | None:
        """The commit a branch, tag or full commit sha names, else None."""
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


@dataclass(frozen=True)
class Request:
    """One request as the server saw it (``origin`` is "hub" or "cdn")."""

    method: str
    path: str
    origin: str
    range: str | None
    authorization: str | None


@dataclass
class _Cut:
    path: str  # file path in the repo (fnmatch pattern)
    after: int  # bytes sent before the connection is closed
    times: int  # how many downloads are cut


class _Throttle:
    """One link's bandwidth shared by every connection: each chunk waits for its share of time."""

    CHUNK = 64 * 1024

    def __init__(self, rate: float) -> None:
        self.rate, self.lock, self.free_at = rate, threading.Lock(), 0.0

    def send(self, out: BinaryIO, body: bytes) -> None:
        for i in range(0, len(body), self.CHUNK):
            chunk = body[i:i + self.CHUNK]
            with self.lock:
                start = max(time.monotonic(), self.free_at)
                self.free_at = start + len(chunk) / self.rate
                until = self.free_at
            time.sleep(max(0.0, until - time.monotonic()))
            out.write(chunk)


@dataclass
class FakeHub:
    """The running server: ``url`` for HF_ENDPOINT, the request log, the cut switch and the link's rate."""

    repos: dict[str, FakeRepo]
    valid_tokens: set[str] | None = None  # None: any token is valid (only repo grants matter)
    url: str = ""
    cdn_url: str = ""
    requests: list[Request] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    lfs: dict[str, bytes] = field(default_factory=dict)  # uploaded LFS content by sha256
    throttle: _Throttle | None = None  # serve(rate=...): file bodies at that many bytes per second in total

    def uploads(self) -> list[str]:
        """sha256 of each LFS object whose bytes were uploaded (PUT), in order."""
        return [r.path.rsplit("/", 1)[-1] for r in self.requests if r.method == "PUT" and "/lfs-upload/" in r.path]

    def commits(self) -> list[Request]:
        """The commit requests made."""
        return [r for r in self.requests if r.method == "POST" and "/commit/" in r.path]

    def cut(self, path: str, after: int, times: int = 1) -> None:
        """Close the connection after ``after`` body bytes on the next ``times`` GETs of ``path`` (any repo)."""
        with self.lock:
            self.cuts.append(_Cut(path, after, times))

    def take_cut(self, path: str) -> int | None:
        with self.lock:
            for c in self.cuts:
                if c.times > 0 and fnmatchcase(path, c.path):
                    c.times -= 1
                    return c.after
        return None

    def downloads(self, method: str = "GET") -> list[str]:
        """Repo file paths whose bytes were requested (``resolve`` on the Hub, or the CDN)."""
        return [f for r in self.requests if r.method == method for f in _file_of(r.path, r.origin)]

    def requested(self, pattern: str) -> list[Request]:
        """Requests (any method, any origin) touching a repo file matching ``pattern``."""
        return [r for r in self.requests if any(fnmatchcase(p, pattern) for p in _file_of(r.path, r.origin))]


def _file_of(path: str, origin: str) -> list[str]:
    parts = path.strip("/").split("/")
    if origin == "cdn" and len(parts) >= 5:
        return ["/".join(parts[4:])]
    if origin == "hub" and len(parts) >= 5 and parts[2] == "resolve":
        return ["/".join(parts[4:])]
    return []


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    origin: str = "hub"

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    # -- responses --

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _json(self, obj: object) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(obj).encode())

    # -- auth --

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def _deny(self, name: str, repo: FakeRepo, content: bool) -> bool:
        """Answer as the Hub does when this request may not see ``repo`` (``content``: file bytes asked for)."""
        token = self._token()
        if token is not None and self.hub.valid_tokens is not None and token not in self.hub.valid_tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return True
        if repo.private and token not in repo.tokens:
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            return True
        if repo.gated and content and token not in repo.tokens:
            if token is None:
                self._error(401, "GatedRepo", f"Access to model {name} is restricted. You must have access to it "
                                              "and be authenticated to access it. Please log in.")
            else:
                self._error(403, "GatedRepo", f"Access to model {name} is restricted and you are not in the "
                                              f"authorized list. Visit {self.hub.url}/{name} to ask for access.")
            return True
        return False

    # -- routes --

    def _route(self) -> None:
        split = urlsplit(self.path)
        parts = [unquote(p) for p in split.path.strip("/").split("/")]
        query = parse_qs(split.query)
        self.hub.requests.append(Request(self.command, "/".join(["", *parts]), self.origin,
                                         self.headers.get("Range"), self.headers.get("Authorization")))
        if self.origin == "cdn":
            return self._cdn(parts)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts, query)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts)
        return self._error(404, "RepoNotFound", "Repository not found")

    def _repo(self, org: str, name: str) -> tuple[str, FakeRepo] | None:
        full = f"{org}/{name}"
        repo = self.hub.repos.get(full)
        if repo is None:
            self._error(401 if self._token() is None else 404, "RepoNotFound", "Repository not found")
            return None
        return full, repo

    def _commit(self, repo: FakeRepo, rev: str) -> str | None:
        commit = repo.at(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _api(self, parts: list[str], query: dict[str, list[str]]) -> None:
        found = self._repo(parts[2], parts[3])
        if found is None or self._deny(*found, content=False):
            return None
        name, repo = found
        rest = parts[4:]
        if rest == ["refs"]:
            include_prs = query.get("include_prs", ["0"])[0].lower() in ("1", "true")
            return self._json(repo.git_refs(include_prs))
        if rest and rest[0] == "tree" and len(rest) >= 2:
            commit = self._commit(repo, rest[1])
            if commit is None:
                return None
            return self._json(self._tree(repo.commits[commit], "/".join(rest[2:]),
                                         query.get("recursive", ["false"])[0].lower() == "true"))
        if rest and rest[0] != "revision":
            return self._error(404, None, "Not found")
        commit = self._commit(repo, rest[1] if len(rest) >= 2 else "main")
        if commit is None:
            return None
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        files = repo.commits[commit]
        siblings = []
        for p in sorted(files):
            entry: dict[str, object] = {"rfilename": p}
            if blobs:
                entry |= {"size": len(files[p]), "blobId": git_blob_id(files[p])}
                if is_lfs(p):
                    entry["lfs"] = {"sha256": content_sha256(files[p]), "size": len(files[p]),
                                    "pointerSize": 134}
            siblings.append(entry)
        return self._json({"_id": hashlib.md5(name.encode()).hexdigest()[:24], "id": name, "modelId": name,
                           "sha": commit, "private": repo.private, "gated": "manual" if repo.gated else False,
                           "disabled": False, "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
                           "siblings": siblings})

    @staticmethod
    def _tree(files: dict[str, bytes], under: str, recursive: bool) -> list[dict[str, object]]:
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        out: dict[str, dict[str, object]] = {}
        for p in sorted(files):
            if not p.startswith(prefix):
                continue
            rel = p[len(prefix):].split("/")
            for depth in range(1, len(rel)):  # folders on the way
                folder = prefix + "/".join(rel[:depth])
                if recursive or depth == 1:
                    out.setdefault(folder, {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                            "size": 0, "path": folder})
            if len(rel) > 1 and not recursive:
                continue
            entry: dict[str, object] = {"type": "file", "oid": git_blob_id(files[p]), "size": len(files[p]), "path": p}
            if is_lfs(p):
                entry["lfs"] = {"oid": content_sha256(files[p]), "size": len(files[p]), "pointerSize": 134}
            out[p] = entry
        return list(out.values())

    def _resolve(self, parts: list[str]) -> None:
        found = self._repo(parts[0], parts[1])
        if found is None or self._deny(*found, content=True):
            return None
        name, repo = found
        commit = self._commit(repo, parts[3])
        if commit is None:
            return None
        path = "/".join(parts[4:])
        data = repo.commits[commit].get(path)
        if data is None:
            return self._error(404, "EntryNotFound", f"Entry not found: {path}", {"X-Repo-Commit": commit})
        if is_lfs(path):
            sha256 = content_sha256(data)
            location = f"{self.hub.cdn_url}/cdn/{name}/{commit}/{quote(path)}"
            return self._send(302, {"Location": location, "X-Repo-Commit": commit, "X-Linked-Size": str(len(data)),
                                    "X-Linked-Etag": f'"{sha256}"', "ETag": f'"{git_blob_id(data)}"'})
        return self._body(path, data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'})

    def _cdn(self, parts: list[str]) -> None:
        # /cdn/{org}/{name}/{commit}/{path}: a signed-URL stand-in; no auth, no Hub headers.
        repo = self.hub.repos.get("/".join(parts[1:3])) if len(parts) >= 5 else None
        data = repo.commits.get(parts[3], {}).get("/".join(parts[4:])) if repo else None
        if data is None:
            return self._error(404, None, "NoSuchKey")
        return self._body("/".join(parts[4:]), data, {"ETag": f'"{content_sha256(data)}"'})

    def _body(self, path: str, data: bytes, headers: dict[str, str]) -> None:
        """The bytes, honouring Range, cut short when the cut switch says so."""
        start, end, status = 0, len(data) - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if m is None or (not m[1] and not m[2]):
                return self._error(416, None, "Invalid range")
            if m[1]:
                start, end = int(m[1]), min(int(m[2]), len(data) - 1) if m[2] else len(data) - 1
            else:
                start = max(len(data) - int(m[2]), 0)
            if start >= len(data) or start > end:
                return self._error(416, None, "Range not satisfiable", {"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
        body = data[start:end + 1]
        headers = {**headers, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "Content-Length": str(len(body))}
        after = self.hub.take_cut(path) if self.command == "GET" else None
        if after is None and self.hub.throttle is not None and self.command == "GET":
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            return self.hub.throttle.send(self.wfile, body)
        if after is None:
            return self._send(status, headers, body)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body[:after])
        self.wfile.flush()
        self.close_connection = True  # the client sees the body end early

    # -- writes --

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _write_route(self) -> None:
        split = urlsplit(self.path)
        parts = [unquote(p) for p in split.path.strip("/").split("/")]
        body = self._read_body()
        self.hub.requests.append(Request(self.command, "/".join(["", *parts]), self.origin,
                                         self.headers.get("Range"), self.headers.get("Authorization")))
        if self.origin != "hub":
            return self._error(404, None, "Not found")
        if self.command == "PUT" and parts[:1] == ["lfs-upload"]:
            if hashlib.sha256(body).hexdigest() != parts[1]:
                return self._error(400, None, "sha256 mismatch")
            self.hub.lfs[parts[1]] = body
            return self._send(200, {})
        if parts[:1] == ["lfs-verify"]:
            return self._json({}) if parts[1] in self.hub.lfs else self._error(404, None, "Object not found")
        token = self._token()
        if token is None or (self.hub.valid_tokens is not None and token not in self.hub.valid_tokens):
            return self._error(401, None, "Invalid credentials in Authorization header")
        if parts == ["api", "validate-yaml"]:
            return self._json({"errors": [], "warnings": []})
        if parts == ["api", "repos", "create"]:
            req = json.loads(body)
            name = f"{req.get('organization') or 'me'}/{req['name']}"
            if name in self.hub.repos:  # the Hub names the existing repo's url, which the client returns
                return self._send(409, {"Content-Type": "application/json", "X-Error-Message": "exists"},
                                  json.dumps({"error": "You already created this model repo",
                                              "url": f"{self.hub.url}/{name}"}).encode())
            private = req.get("visibility") == "private" or req.get("private") is True
            self.hub.repos[name] = FakeRepo({}, private=private, tokens=[token])
            return self._json({"url": f"{self.hub.url}/{name}", "name": name})
        if len(parts) >= 2 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
            req = json.loads(body)
            objects = [{"oid": o["oid"], "size": o["size"]} | ({} if o["oid"] in self.hub.lfs else {"actions": {
                "upload": {"href": f"{self.hub.url}/lfs-upload/{o['oid']}"},
                "verify": {"href": f"{self.hub.url}/lfs-verify/{o['oid']}"}}}) for o in req["objects"]]
            return self._json({"transfer": "basic", "objects": objects})
        if parts[:2] != ["api", "models"] or len(parts) < 6:
            return self._error(404, None, "Not found")
        found = self._repo(parts[2], parts[3])
        if found is None:
            return None
        name, repo = found
        if repo.private and token not in repo.tokens:
            return self._error(404, "RepoNotFound", "Repository not found")
        action, rev = parts[4], "/".join(parts[5:])
        if action == "branch":
            if rev in repo.refs:
                return self._error(409, None, "Reference already exists")
            repo.refs[rev] = repo.sha
            return self._json({})
        commit = repo.at(rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo.commits[commit]
        if action == "paths-info":
            paths = parse_qs(body.decode()).get("paths", [])
            return self._json([e for e in self._tree(files, "", True) if e["path"] in paths])
        if action == "preupload":
            req = json.loads(body)
            out = []
            for f in req["files"]:
                lfs = is_lfs(f["path"]) or f["size"] >= 10 << 20
                have = files.get(f["path"])
                oid = None if have is None else content_sha256(have) if lfs else git_blob_id(have)
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            return self._json({"files": out, "commitOid": commit})
        if action == "commit":
            new = dict(files)
            for line in body.splitlines():
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "file":
                    new[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "lfsFile":
                    if value["oid"] not in self.hub.lfs:
                        return self._error(422, None, f"LFS object {value['oid']} was never uploaded")
                    new[value["path"]] = self.hub.lfs[value["oid"]]
                elif item["key"] == "deletedFile":
                    new.pop(value["path"], None)
            sha = repo.push(new, branch=rev if rev in repo.refs else "main")
            return self._json({"commitUrl": f"{self.hub.url}/{name}/commit/{sha}", "commitOid": sha,
                               "pullRequestUrl": None})
        return self._error(404, None, "Not found")

    do_GET = _route
    do_HEAD = _route
    do_POST = _write_route
    do_PUT = _write_route


def _start(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@contextmanager
def serve(repos: dict[str, FakeRepo], *, valid_tokens: Iterable[str] | None = None,
          rate: float | None = None) -> Iterator[FakeHub]:
    """Serve ``repos`` on 127.0.0.1 (Hub and CDN on two ports); yields the :class:`FakeHub`. ``rate``: bytes per
    second of every file body together."""
    hub = FakeHub(repos, set(valid_tokens) if valid_tokens is not None else None,
                  throttle=_Throttle(rate) if rate else None)
    servers = []
    try:
        for origin in ("hub", "cdn"):
            server, _ = _start(type(f"{origin}Handler", (_Handler,), {"hub": hub, "origin": origin}))
            servers.append(server)
            setattr(hub, "url" if origin == "hub" else "cdn_url", f"http://127.0.0.1:{server.server_address[1]}")
        yield hub
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@contextmanager
def fake_hub(repos: dict[str, FakeRepo]) -> Iterator[str]:
    """Serve ``repos`` on 127.0.0.1; yields the endpoint URL for ``HF_ENDPOINT`` (see :func:`serve` for the log)."""
    with serve(repos) as hub:
        yield hub.url


def client_env(url: str, hf_home: Path) -> dict[str, str]:
    """This process's environment for the real Hub client against the loopback Hub at ``url``: no other HF_*
    variable, a fresh ``HF_HOME``, online, no xet, no proxy for 127.0.0.1."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {
        "HF_HOME": str(hf_home), "HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
        "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
