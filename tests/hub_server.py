"""A Hugging Face Hub-protocol server for tests: standard library only, 127.0.0.1, ephemeral ports.

It speaks the subset of the Hub's HTTP API that the real ``huggingface_hub`` client (validated against
2.4.0, with ``HF_HUB_DISABLE_XET=1``) uses for ``create_repo`` / ``create_branch`` / ``preupload_lfs_files`` /
``create_commit`` / ``model_info`` / ``snapshot_download`` (see ../shared/reference/hub.md, section 2.3):

    POST /api/repos/create                          POST /api/validate-yaml
    POST /api/models/{repo}/preupload/{rev}         POST /{repo}.git/info/lfs/objects/batch
    PUT  <cdn>/lfs/{repo}/{oid}  (LFS "basic")      POST /api/models/{repo}/lfs-verify
    POST /api/models/{repo}/commit/{rev}  (NDJSON)  POST /api/models/{repo}/branch/{branch}
    GET  /api/models/{repo}[/revision/{rev}]        GET  /api/models/{repo}/refs
    GET  /api/models/{repo}/tree/{rev}[/{path}]     HEAD|GET /{repo}/resolve/{rev}/{path}
    GET  <cdn>/blobs/{sha256}  (LFS downloads are 302-redirected to a second "CDN" server, another origin)

Why a project-owned server: no upload-capable Hub clone installs here, and request-mocking libraries are
tied to one HTTP client (huggingface_hub moved requests -> httpx -> httpx2). This one is transport-agnostic
and strict: a route it does not know, or a known route called with a payload it does not expect, is answered
with HTTP 599 and recorded in ``protocol_errors`` -- tests assert that list is empty, so a client change
shows up as a failing test instead of a silent pass.

Storage is in memory: repos -> refs -> commits -> {path: entry}; LFS objects per repo by sha256 (checked
on upload). Auth follows the Hub: unknown token -> 401 "Invalid credentials in Authorization header",
writes without a token -> 401, writes outside the token's namespaces -> 403, missing or invisible repos ->
404 with ``X-Error-Code: RepoNotFound``. Failures can be injected per route: any status (401, 403, 404,
409, 429, 5xx ...) or a dropped connection, N times, then normal service.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["HubServer", "Request", "git_blob_oid", "VALIDATED_AGAINST"]

#: huggingface_hub version whose request shapes this server was checked against
VALIDATED_AGAINST = "2.4.0"

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy", ".npz", ".h5", ".onnx", ".msgpack",
                ".ckpt", ".tar", ".gz", ".zip")
LFS_SIZE_LIMIT = 10 * 1024 * 1024
RELATIONS = {"adapter", "merge", "quantized", "finetune"}
GITATTRIBUTES = ("*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
                 "*.gguf filter=lfs diff=lfs merge=lfs -text\n*.pt filter=lfs diff=lfs merge=lfs -text\n").encode()


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Entry:
    """One file in a commit: regular content, or an LFS pointer to a blob in the repo's LFS store."""

    size: int
    sha256: str
    lfs: bool
    content: bytes | None = None  # regular files only

    @property
    def git_oid(self) -> str:
        return git_blob_oid(lfs_pointer(self.sha256, self.size) if self.lfs else (self.content or b""))


@dataclass
class Commit:
    oid: str
    parent: str | None
    summary: str
    files: dict[str, Entry]
    date: float


@dataclass
class Repo:
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main", "dev", "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes
    prs: int = 0


@dataclass
class Request:
    """What the server saw: the route it matched (or None), method, path, query, status it answered."""

    route: str | None
    method: str
    path: str
    query: str
    status: int = 0
    authorized: bool = False
    body_bytes: int = 0


class _Fail:
    def __init__(self, route: str, status: int | None, times: int, headers: dict[str, str] | None,
                 message: str | None, drop: bool, match: str | None):
        self.route, self.status, self.remaining = route, status, times
        self.headers, self.message, self.drop, self.match = headers or {}, message, drop, match


_REPO = r"(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)"
_ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    (m, name, re.compile(rx + r"$")) for m, name, rx in [
        ("POST", "create_repo", r"/api/repos/create"),
        ("POST", "validate_yaml", r"/api/validate-yaml"),
        ("GET", "whoami", r"/api/whoami-v2"),
        ("POST", "preupload", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)"),
        ("POST", "commit", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)"),
        ("POST", "create_branch", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)"),
        ("POST", "lfs_verify", rf"/api/models/{_REPO}/lfs-verify"),
        ("GET", "refs", rf"/api/models/{_REPO}/refs"),
        ("GET", "tree", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?"),
        ("GET", "revision_info", rf"/api/models/{_REPO}/revision/(?P<rev>[^/]+)"),
        ("GET", "model_info", rf"/api/models/{_REPO}"),
        ("POST", "lfs_batch", rf"/{_REPO}\.git/info/lfs/objects/batch"),
        ("HEAD", "resolve", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
        ("GET", "resolve", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
    ]
]
_CDN_ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    ("PUT", "lfs_upload", re.compile(rf"/lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})$")),
    ("GET", "cdn_get", re.compile(r"/blobs/(?P<repo>[^/]+)/(?P<oid>[0-9a-f]{64})$")),
    ("HEAD", "cdn_get", re.compile(r"/blobs/(?P<repo>[^/]+)/(?P<oid>[0-9a-f]{64})$")),
]


class _Reply(Exception):
    """Raised by a route to answer with an error status (and Hub-style error headers)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None):
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.extra = extra or {}


class _Protocol(Exception):
    """The client sent something this server (and, as far as we know, the Hub) does not expect."""


class HubServer:
    """The server. ``with HubServer() as hub: ... hub.endpoint ...``.

    ``tokens`` maps a bearer token to ``{"user": name, "orgs": [...], "write": bool}``.
    """

    def __init__(self, tokens: dict[str, dict[str, Any]] | None = None):
        self.tokens = dict(tokens or {})
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.protocol_errors: list[str] = []
        self.validated_cards: list[str] = []
        self._fails: list[_Fail] = []
        self._lock = threading.RLock()
        self._nonce = secrets.token_hex(8)
        self._counter = 0
        self._api: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "HubServer":
        self._api = _make_server(self, _ROUTES, "api")
        self._cdn = _make_server(self, _CDN_ROUTES, "cdn")
        for srv in (self._api, self._cdn):
            t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        for srv in (self._api, self._cdn):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._api is not None, "server not started"
        return f"http://127.0.0.1:{self._api.server_address[1]}"

    @property
    def cdn(self) -> str:
        assert self._cdn is not None, "server not started"
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    # -- test controls -------------------------------------------------------------------------
    def fail(self, route: str, status: int, *, times: int = 1, headers: dict[str, str] | None = None,
             message: str | None = None, match: str | None = None) -> None:
        """Answer the next ``times`` requests of ``route`` (whose path contains ``match``) with ``status``."""
        with self._lock:
            self._fails.append(_Fail(route, status, times, headers, message, False, match))

    def drop(self, route: str, *, times: int = 1, match: str | None = None) -> None:
        """Close the connection without answering, the next ``times`` requests of ``route``."""
        with self._lock:
            self._fails.append(_Fail(route, None, times, None, None, True, match))

    def count(self, route: str, *, status: int | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.route == route and (status is None or r.status == status))

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """The content of every file at ``rev`` (tests compare it with what was pushed)."""
        with self._lock:
            repo = self.repos[repo_id]
            commit = repo.commits[self._resolve(repo, rev)]
            return {p: (repo.lfs[e.sha256] if e.lfs else (e.content or b"")) for p, e in commit.files.items()}

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, *, private: bool = False) -> str:
        """Create a repo directly (for download tests); returns the head commit."""
        with self._lock:
            repo = self._new_repo(repo_id, private)
            entries = dict(repo.commits[repo.refs["main"]].files)
            for path, data in (files or {}).items():
                sha = hashlib.sha256(data).hexdigest()
                lfs = _wants_lfs(path, len(data), data[:512])
                if lfs:
                    repo.lfs[sha] = data
                entries[path] = Entry(len(data), sha, lfs, None if lfs else data)
            return self._commit(repo, "main", "add files", entries)

    # -- state helpers (lock held) -------------------------------------------------------------
    def _new_commit_oid(self, *parts: str) -> str:
        self._counter += 1
        return hashlib.sha1("\0".join((self._nonce, str(self._counter)) + parts).encode()).hexdigest()

    def _new_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id, private)
        self.repos[repo_id] = repo
        oid = self._new_commit_oid(repo_id, "initial")
        attrs = Entry(len(GITATTRIBUTES), hashlib.sha256(GITATTRIBUTES).hexdigest(), False, GITATTRIBUTES)
        repo.commits[oid] = Commit(oid, None, "initial commit", {".gitattributes": attrs}, time.time())
        repo.refs["main"] = oid
        return repo

    def _commit(self, repo: Repo, ref: str, summary: str, files: dict[str, Entry]) -> str:
        parent = repo.refs.get(ref)
        oid = self._new_commit_oid(repo.repo_id, ref, summary)
        repo.commits[oid] = Commit(oid, parent, summary, files, time.time())
        repo.refs[ref] = oid
        return oid

    @staticmethod
    def _resolve(repo: Repo, rev: str) -> str:
        rev = unquote(rev)
        if rev in repo.refs:
            return repo.refs[rev]
        if re.fullmatch(r"[0-9a-f]{40}", rev) and rev in repo.commits:
            return rev
        raise _Reply(404, f"Invalid rev id: {rev}", code="RevisionNotFound")


def _wants_lfs(path: str, size: int, sample: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or size > LFS_SIZE_LIMIT or b"\0" in sample


def _make_server(hub: HubServer, routes: list[tuple[str, str, re.Pattern[str]]], kind: str) -> ThreadingHTTPServer:
    class Handler(_Handler):
        pass

    Handler.hub, Handler.routes, Handler.kind = hub, routes, kind
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    return srv


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # huggingface_hub keeps connections alive
    hub: HubServer
    routes: list[tuple[str, str, re.Pattern[str]]]
    kind: str

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    # every method goes through one dispatcher
    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    # -- plumbing ------------------------------------------------------------------------------
    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              ctype: str = "application/json") -> None:
        self._rec.status = status
        self.send_response(status)
        hdrs = {"Content-Type": ctype, "Content-Length": str(len(body))}
        hdrs.update(headers or {})
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc).encode(), headers)

    def _user(self) -> dict[str, Any] | None:
        auth = self.headers.get("Authorization") or ""
        if not auth:
            return None
        if not auth.startswith("Bearer "):
            raise _Reply(401, "Invalid credentials in Authorization header")
        info = self.hub.tokens.get(auth[len("Bearer "):])
        if info is None:
            raise _Reply(401, "Invalid credentials in Authorization header")
        return info

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        raw_path, query = split.path, split.query
        route, params = None, {}
        for method, name, rx in self.routes:
            if method == self.command:
                m = rx.match(raw_path)
                if m:
                    route, params = name, {k: v for k, v in m.groupdict().items() if v is not None}
                    break
        self._rec = Request(route, self.command, raw_path, query)
        try:
            body = self._read_body()
        except (OSError, ValueError):
            self.close_connection = True
            return
        self._rec.body_bytes = len(body)
        hub = self.hub
        with hub._lock:
            hub.requests.append(self._rec)
        if route is None:
            msg = f"hub_server: no route {self.command} {raw_path} ({self.kind})"
            with hub._lock:
                hub.protocol_errors.append(msg)
            self._json(599, {"error": msg})
            return
        with hub._lock:
            for f in hub._fails:
                if f.route == route and f.remaining > 0 and (f.match is None or f.match in raw_path):
                    f.remaining -= 1
                    if f.drop:
                        self._rec.status = -1
                        self.close_connection = True
                        return
                    self._json(f.status or 500, {"error": f.message or f"injected failure {f.status}"},
                               headers=f.headers)
                    return
        try:
            self._rec.authorized = bool(self.headers.get("Authorization"))
            getattr(self, "r_" + route)(params, parse_qs(query), body)
        except _Reply as r:
            headers = dict(r.headers)
            if r.code:
                headers["X-Error-Code"] = r.code
            headers["X-Error-Message"] = r.message
            self._json(r.status, {"error": r.message, **r.extra}, headers)
        except _Protocol as exc:
            msg = f"hub_server: unexpected {self.command} {raw_path}: {exc}"
            with hub._lock:
                hub.protocol_errors.append(msg)
            self._json(599, {"error": msg})

    # -- access control ------------------------------------------------------------------------
    def _repo_for_read(self, repo_id: str) -> Repo:
        user = self._user()
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not _may_write(user, repo_id)):
            raise _Reply(404, "Repository not found", code="RepoNotFound")
        return repo

    def _repo_for_write(self, repo_id: str) -> Repo:
        user = self._user()
        if user is None:
            raise _Reply(401, "You must be authenticated to write to a repository")
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _Reply(404, "Repository not found", code="RepoNotFound")
        if not _may_write(user, repo_id):
            raise _Reply(403, f"You don't have the rights to write to {repo_id}")
        return repo

    # -- routes --------------------------------------------------------------------------------
    def r_whoami(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        user = self._user()
        if user is None:
            raise _Reply(401, "Invalid credentials in Authorization header")
        self._json(200, {"type": "user", "name": user["user"], "orgs": [{"name": o} for o in user.get("orgs", [])]})

    def r_create_repo(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        doc = _json_body(body)
        if not isinstance(doc.get("name"), str) or set(doc) - {"name", "organization", "visibility", "type",
                                                                 "private"}:
            raise _Protocol(f"create payload {sorted(doc)}")
        if doc.get("type", "model") != "model":
            raise _Protocol(f"repo type {doc.get('type')!r}")
        user = self._user()
        if user is None:
            raise _Reply(401, "You must be authenticated to create a repository")
        ns = doc.get("organization") or user["user"]
        repo_id = f"{ns}/{doc['name']}"
        if not _may_write(user, repo_id):
            raise _Reply(403, f"You don't have the rights to create a model under the namespace \"{ns}\"")
        with self.hub._lock:
            if repo_id in self.hub.repos:
                raise _Reply(409, "You already created this model repo",
                             extra={"url": f"{self.hub.endpoint}/{repo_id}"})
            self.hub._new_repo(repo_id, doc.get("visibility") == "private" or bool(doc.get("private")))
        self._json(200, {"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id})

    def r_validate_yaml(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        doc = _json_body(body)
        if not isinstance(doc.get("content"), str) or doc.get("repoType", "model") != "model":
            raise _Protocol(f"validate-yaml payload {sorted(doc)}")
        with self.hub._lock:
            self.hub.validated_cards.append(doc["content"])
        errors = [{"message": m} for m in _check_card(doc["content"])]
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def r_preupload(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        doc = _json_body(body)
        files = doc.get("files")
        if not isinstance(files, list) or set(doc) - {"files", "gitIgnore"} or set(q) - {"create_pr"}:
            raise _Protocol(f"preupload payload {sorted(doc)} query {sorted(q)}")
        with self.hub._lock:
            repo = self._repo_for_write(p["repo"])
            head = repo.commits[self.hub._resolve(repo, p["rev"])]
            out = []
            for f in files:
                if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                        and isinstance(f.get("sample"), str)):
                    raise _Protocol(f"preupload file entry {f!r}")
                sample = base64.b64decode(f["sample"])
                lfs = _wants_lfs(f["path"], f["size"], sample)
                entry = head.files.get(f["path"])
                oid = None if entry is None else (entry.sha256 if entry.lfs else entry.git_oid)
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
        self._json(200, {"files": out, "commitOid": head.oid})

    def r_lfs_batch(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        if "application/vnd.git-lfs+json" not in (self.headers.get("Content-Type") or ""):
            raise _Protocol(f"LFS batch content type {self.headers.get('Content-Type')!r}")
        doc = _json_body(body)
        if doc.get("operation") != "upload" or "basic" not in (doc.get("transfers") or []) \
                or doc.get("hash_algo") != "sha256" or not isinstance(doc.get("objects"), list):
            raise _Protocol(f"LFS batch payload {json.dumps(doc)[:200]}")
        with self.hub._lock:
            repo = self._repo_for_write(p["repo"])
            objects = []
            for o in doc["objects"]:
                oid, size = o.get("oid"), o.get("size")
                if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid) and isinstance(size, int)):
                    raise _Protocol(f"LFS object {o!r}")
                obj: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
                if oid not in repo.lfs:  # already stored -> no actions: the client skips it
                    token = secrets.token_hex(8)
                    obj["actions"] = {
                        "upload": {"href": f"{self.hub.cdn}/lfs/{p['repo']}/{oid}?sig={token}",
                                   "expires_at": "2999-01-01T00:00:00Z"},
                        "verify": {"href": f"{self.hub.endpoint}/api/models/{p['repo']}/lfs-verify",
                                   "expires_at": "2999-01-01T00:00:00Z"},
                    }
                objects.append(obj)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
                   ctype="application/vnd.git-lfs+json")

    def r_lfs_upload(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        if "sig" not in q:
            raise _Reply(403, "missing upload signature")
        if self.headers.get("Authorization"):
            raise _Protocol("the Hub token was sent to the storage host")
        if hashlib.sha256(body).hexdigest() != p["oid"]:
            raise _Reply(400, "sha256 of the uploaded content does not match the object id")
        with self.hub._lock:
            repo = self.hub.repos.get(p["repo"])
            if repo is None:
                raise _Reply(404, "no such repo")
            repo.lfs[p["oid"]] = body
        self._send(200, b"")

    def r_lfs_verify(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        doc = _json_body(body)
        with self.hub._lock:
            repo = self._repo_for_write(p["repo"])
            data = repo.lfs.get(doc.get("oid", ""))
        if data is None or len(data) != doc.get("size"):
            raise _Reply(404, "object not found or size differs")
        self._json(200, {"success": True})

    def r_commit(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        if "application/x-ndjson" not in (self.headers.get("Content-Type") or ""):
            raise _Protocol(f"commit content type {self.headers.get('Content-Type')!r}")
        if set(q) - {"create_pr", "hot_reload"}:
            raise _Protocol(f"commit query {sorted(q)}")
        try:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Protocol(f"commit body is not NDJSON ({exc})") from None
        if not lines or lines[0].get("key") != "header" or not isinstance(lines[0].get("value", {}).get("summary"),
                                                                           str):
            raise _Protocol("commit NDJSON must start with a header carrying a summary")
        header = lines[0]["value"]
        with self.hub._lock:
            repo = self._repo_for_write(p["repo"])
            base_ref = unquote(p["rev"])
            head_oid = self.hub._resolve(repo, base_ref)
            parent = header.get("parentCommit")
            if parent and not head_oid.startswith(parent):
                raise _Reply(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[head_oid].files)
            for item in lines[1:]:
                key, val = item.get("key"), item.get("value") or {}
                path = val.get("path")
                if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
                    raise _Protocol(f"commit operation path {path!r}")
                if key == "file":
                    if val.get("encoding") != "base64":
                        raise _Protocol(f"file encoding {val.get('encoding')!r}")
                    data = base64.b64decode(val["content"])
                    files[path] = Entry(len(data), hashlib.sha256(data).hexdigest(), False, data)
                elif key == "lfsFile":
                    if val.get("algo") != "sha256":
                        raise _Protocol(f"lfsFile algo {val.get('algo')!r}")
                    blob = repo.lfs.get(val.get("oid", ""))
                    if blob is None or len(blob) != val.get("size"):
                        raise _Reply(422, f"LFS pointer of {path} points to an object that was not uploaded")
                    files[path] = Entry(len(blob), val["oid"], True)
                elif key == "deletedFile":
                    if path not in files:
                        raise _Reply(404, "A file with this name doesn't exist", code="EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    for f in [f for f in files if f.startswith(path.rstrip("/") + "/")]:
                        del files[f]
                else:
                    raise _Protocol(f"commit operation {key!r}")
            pr_url = None
            ref = base_ref
            if q.get("create_pr") == ["1"]:
                repo.prs += 1
                ref = f"refs/pr/{repo.prs}"
                repo.refs[ref] = head_oid
                pr_url = f"{self.hub.endpoint}/{repo.repo_id}/discussions/{repo.prs}"
            oid = self.hub._commit(repo, ref, header["summary"], files)
        self._json(200, {"success": True, "commitOid": oid, "pullRequestUrl": pr_url, "hookOutput": "",
                         "commitUrl": f"{self.hub.endpoint}/{repo.repo_id}/commit/{oid}"})

    def r_create_branch(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        doc = _json_body(body) if body else {}
        with self.hub._lock:
            repo = self._repo_for_write(p["repo"])
            branch = unquote(p["branch"])
            if branch in repo.refs:
                raise _Reply(409, "Reference already exists")
            start = doc.get("startingPoint") or "main"
            repo.refs[branch] = self.hub._resolve(repo, start)
        self._json(200, {})

    def r_refs(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        with self.hub._lock:
            repo = self._repo_for_read(p["repo"])
            branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in repo.refs.items()
                        if not n.startswith("refs/")]
        self._json(200, {"branches": branches, "converts": [], "tags": []})

    def _info(self, repo: Repo, oid: str) -> dict[str, Any]:
        commit = repo.commits[oid]
        return {"_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
                "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": oid,
                "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(commit.date)),
                "private": repo.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
                "tags": [], "siblings": [{"rfilename": f} for f in sorted(commit.files)],
                "createdAt": "2026-01-01T00:00:00.000Z"}

    def r_model_info(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        with self.hub._lock:
            repo = self._repo_for_read(p["repo"])
            doc = self._info(repo, repo.refs["main"])
        self._json(200, doc)

    def r_revision_info(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        with self.hub._lock:
            repo = self._repo_for_read(p["repo"])
            doc = self._info(repo, self.hub._resolve(repo, p["rev"]))
        self._json(200, doc)

    def r_tree(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        if set(q) - {"recursive", "expand", "limit", "cursor"}:
            raise _Protocol(f"tree query {sorted(q)}")
        recursive = (q.get("recursive") or ["false"])[0].lower() in ("1", "true")
        with self.hub._lock:
            repo = self._repo_for_read(p["repo"])
            commit = repo.commits[self.hub._resolve(repo, p["rev"])]
            prefix = unquote(p.get("path", "")).strip("/")
            prefix = prefix + "/" if prefix else ""
            out, dirs = [], set()
            for path in sorted(commit.files):
                if not path.startswith(prefix):
                    continue
                rest = path[len(prefix):]
                parts = rest.split("/")
                for i in range(1, len(parts) if recursive else min(len(parts), 2)):
                    d = prefix + "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                    "path": d})
                if len(parts) > 1 and not recursive:
                    continue
                e = commit.files[path]
                item: dict[str, Any] = {"type": "file", "oid": e.git_oid, "size": e.size, "path": path}
                if e.lfs:
                    item["lfs"] = {"oid": e.sha256, "size": e.size,
                                   "pointerSize": len(lfs_pointer(e.sha256, e.size))}
                out.append(item)
            if prefix and not out:
                raise _Reply(404, f"{prefix} does not exist", code="EntryNotFound")
        self._json(200, out)

    def r_resolve(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        with self.hub._lock:
            repo = self._repo_for_read(p["repo"])
            oid = self.hub._resolve(repo, p["rev"])
            path = unquote(p["path"])
            e = repo.commits[oid].files.get(path)
            if e is None:
                raise _Reply(404, "Entry not found", code="EntryNotFound")
        common = {"X-Repo-Commit": oid, "Accept-Ranges": "bytes"}
        if e.lfs:
            loc = f"{self.hub.cdn}/blobs/{quote(repo.repo_id, safe='')}/{e.sha256}"
            self._send(302, b"", {**common, "Location": loc, "ETag": f'"{e.git_oid}"',
                                  "X-Linked-Etag": f'"{e.sha256}"', "X-Linked-Size": str(e.size)},
                       ctype="text/plain")
            return
        self._send_bytes(e.content or b"", {**common, "ETag": f'"{e.git_oid}"'})

    def _send_bytes(self, data: bytes, headers: dict[str, str]) -> None:
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            part = data[start:end + 1]
            self._send(206, part, {**headers, "Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}"},
                       ctype="application/octet-stream")
            return
        self._send(200, data, headers, ctype="application/octet-stream")

    def r_cdn_get(self, p: dict[str, str], q: dict[str, list[str]], body: bytes) -> None:
        if self.headers.get("Authorization"):
            raise _Protocol("the Hub token was sent to the storage host")
        with self.hub._lock:
            repo = self.hub.repos.get(unquote(p["repo"]))
            data = None if repo is None else repo.lfs.get(p["oid"])
        if data is None:
            raise _Reply(404, "no such object")
        self._send_bytes(data, {"ETag": f'"{p["oid"]}"'})


def _may_write(user: dict[str, Any] | None, repo_id: str) -> bool:
    if not user or not user.get("write", True):
        return False
    ns = repo_id.split("/")[0]
    return ns == user["user"] or ns in user.get("orgs", [])


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body or b"{}")
    except ValueError as exc:
        raise _Protocol(f"body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _Protocol("body is not a JSON object")
    return doc


# -- a small reader for the YAML front matter the Hub validates --------------------------------------
def _scalar(text: str) -> Any:
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t in ("null", "~", ""):
        return None
    if t in ("true", "false"):
        return t == "true"
    if t.startswith("[") and t.endswith("]"):
        return [_scalar(x) for x in t[1:-1].split(",") if x.strip()]
    return t


def parse_front_matter(content: str) -> dict[str, Any] | None:
    """Top-level keys of a README's YAML block (scalars and lists of scalars; nested blocks kept as text).

    Enough for the keys the Hub checks on a model card; returns None when there is no front matter.
    """
    lines = content.replace("\r\n", "\n").split("\n")
    if not lines or lines[0].strip() != "---":
        return None
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        raise ValueError("front matter is not closed by '---'") from None
    out: dict[str, Any] = {}
    key = None
    for raw in lines[1:end]:
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError("tabs are not allowed for indentation in YAML")
        if raw[0] not in " -":
            m = re.fullmatch(r"([A-Za-z0-9_\-]+):(.*)", raw)
            if not m:
                raise ValueError(f"cannot read YAML line {raw!r}")
            key, rest = m.group(1), m.group(2)
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = _scalar(rest) if rest.strip() else None
        elif key is not None and raw.lstrip().startswith("- ") and (out[key] is None or isinstance(out[key], list)):
            if out[key] is None:
                out[key] = []
            out[key].append(_scalar(raw.lstrip()[2:]))
        elif key is not None:
            out[key] = out[key] if out[key] is not None else {"__nested__": True}
        else:
            raise ValueError(f"cannot read YAML line {raw!r}")
    return out


def _check_card(content: str) -> list[str]:
    try:
        meta = parse_front_matter(content)
    except ValueError as exc:
        return [str(exc)]
    if meta is None:
        return []
    errors = []
    rel = meta.get("base_model_relation")
    if rel is not None and rel not in RELATIONS:
        errors.append(f'"base_model_relation" must be one of {sorted(RELATIONS)}')
    if rel is not None and not meta.get("base_model"):
        errors.append('"base_model_relation" needs "base_model"')
    for key in ("license", "library_name", "pipeline_tag"):
        if key in meta and meta[key] is not None and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    bm = meta.get("base_model")
    if bm is not None and not (isinstance(bm, str) or (isinstance(bm, list) and all(isinstance(x, str) for x in bm))):
        errors.append('"base_model" must be a string or a list of strings')
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        errors.append('"tags" must be a list of strings')
    return errors
