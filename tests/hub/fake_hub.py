"""A fake Hugging Face Hub on 127.0.0.1 that answers what huggingface_hub's real client asks.

Tests point the client at it with HF_ENDPOINT=hub.url (read when huggingface_hub is imported, so the client runs in a
subprocess). It speaks the plain-HTTP protocol of huggingface_hub 2.4 (file_download.py, _snapshot_download.py,
hf_api.py, utils/_http.py):

- `GET /api/models/{repo}[/revision/{rev}]`: model info with `sha`, `siblings`, `gated`, `private`, `safetensors`.
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`: files (type/oid/size/path, `lfs` for LFS files) and
  directories; one page, no `Link` header.
- `GET /api/models/{repo}/refs`: branches and tags.
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: 200 (no redirect: a mirror serves LFS files itself) with X-Repo-Commit,
  ETag (git blob sha1, or the sha256 for LFS files with X-Linked-Etag/X-Linked-Size), Content-Length,
  Accept-Ranges; `Range: bytes=a-b | a- | -n` gives 206 + Content-Range, an unsatisfiable one 416.
- Errors carry X-Error-Code (RepoNotFound: 401 unauthenticated / 404 with a token, RevisionNotFound 404,
  EntryNotFound 404 with X-Repo-Commit, GatedRepo 401 without a token / 403 with a wrong one) and X-Error-Message,
  and a JSON body `{"error": ...}`.

It never sends Xet headers (X-Xet-Hash, the xet-auth link) nor `xetHash` in the tree, so the client takes the plain
HTTP path even when hf_xet is installed; the Xet transfer path of the real hub is not exercised. An interrupted GET
(`cut_next_get`) ends the connection after part of the body: the client sees an incomplete body
(RemoteProtocolError) and resumes with a Range request, as it does against the real hub.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import pathlib
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_THRESHOLD = 1 << 20  # bytes: bigger files are LFS files, as are all *.safetensors
_DATE = "2026-01-01T00:00:00.000Z"


@dataclass(frozen=True)
class HubFile:
    """One file of a commit, with the hashes the hub reports for it."""

    path: str
    content: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.content)

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file that git stores in place of an LFS file."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @functools.cached_property
    def blob_id(self) -> str:
        """The git blob sha1 of what git stores: the content, or the pointer of an LFS file."""
        stored = self.pointer if self.lfs else self.content
        return hashlib.sha1(b"blob %d\0" % len(stored) + stored).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class HubRepo:
    """A model repo: commits (sha -> files), branches and tags (name -> sha), access rules."""

    repo_id: str
    gated: bool = False
    private: bool = False
    token: str | None = None
    default_branch: str = "main"
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        """The commit sha a branch, tag or (full or unique prefix of a) commit sha names, or None."""
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.tags:
            return self.tags[revision]
        if revision in self.commits:
            return revision
        if len(revision) >= 7 and all(c in "0123456789abcdef" for c in revision):
            matches = [sha for sha in self.commits if sha.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        return None


class HubError(Exception):
    """An error answer: status, X-Error-Code, X-Error-Message and optional extra headers."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class FakeHub:
    """A Hugging Face Hub on 127.0.0.1 for huggingface_hub's real client (HF_ENDPOINT=hub.url)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._repos: dict[str, HubRepo] = {}
        self._cuts: dict[tuple[str, str], int] = {}
        self._commit_counter = itertools.count()
        self.bytes_served: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)

    # --- repos -----------------------------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes | pathlib.Path],
        branch: str = "main",
        gated: bool = False,
        token: str | None = None,
        private: bool = False,
    ) -> str:
        """A new commit of `repo_id` holding exactly `files` (path in repo -> content); `branch` points at it.

        Returns the commit sha (40 hex). Files > 1 MiB or *.safetensors are LFS files (ETag = sha256 hex, as the
        real hub: X-Linked-Etag / X-Linked-Size); others are regular (ETag = git blob sha1).
        gated=True: 401/403 with X-Error-Code: GatedRepo on file downloads unless the request carries
        `Authorization: Bearer <token>` (any token when `token` is None). private=True: RepoNotFound everywhere
        without that token. The access flags of the latest call win.
        """
        tree: dict[str, HubFile] = {}
        for path, content in files.items():
            data = content.read_bytes() if isinstance(content, pathlib.Path) else bytes(content)
            lfs = len(data) > LFS_THRESHOLD or path.endswith(".safetensors")
            tree[path] = HubFile(path=path, content=data, lfs=lfs)
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                repo = self._repos[repo_id] = HubRepo(repo_id=repo_id, default_branch=branch)
            repo.gated, repo.private, repo.token = gated, private, token
            digest = hashlib.sha1(f"{repo_id}\0{branch}\0{next(self._commit_counter)}".encode())
            for path in sorted(tree):
                digest.update(f"\0{path}\0{tree[path].etag}".encode())
            sha = digest.hexdigest()
            repo.commits[sha] = tree
            repo.branches[branch] = sha
        return sha

    def add_tag(self, repo_id: str, tag: str, sha: str) -> None:
        """Tag commit `sha` of `repo_id` as `tag`."""
        with self._lock:
            repo = self._repos[repo_id]
            if sha not in repo.commits:
                raise KeyError(f"{repo_id} has no commit {sha}")
            repo.tags[tag] = sha

    def cut_next_get(self, repo_id: str, path: str, after: int) -> None:
        """The next GET of that file sends `after` body bytes and then drops the connection (once)."""
        with self._lock:
            self._cuts[(repo_id, path)] = after

    # --- request handling (called from the handler threads) --------------------------------------------------------

    def _record(self, method: str, raw_path: str) -> None:
        with self._lock:
            self.requests.append((method, raw_path))

    def _count(self, repo_id: str, path: str, sent: int) -> None:
        with self._lock:
            key = f"{repo_id}/{path}"
            self.bytes_served[key] = self.bytes_served.get(key, 0) + sent

    def _take_cut(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            return self._cuts.pop((repo_id, path), None)

    def _repo(self, repo_id: str, bearer: str | None) -> HubRepo:
        """The repo if this caller may see it; RepoNotFound (401 without a token, 404 with one) otherwise."""
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None or (repo.private and not _token_ok(repo, bearer)):
            raise HubError(404 if bearer else 401, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: HubRepo, revision: str) -> str:
        sha = repo.resolve(revision)
        if sha is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _split_repo(self, segments: list[str]) -> tuple[str, list[str]]:
        """(repo id, the segments after it): a known `owner/name` or `name`, else `owner/name`."""
        with self._lock:
            known = set(self._repos)
        if len(segments) >= 2 and f"{segments[0]}/{segments[1]}" in known:
            return f"{segments[0]}/{segments[1]}", segments[2:]
        if segments and segments[0] in known:
            return segments[0], segments[1:]
        if len(segments) >= 2:
            return f"{segments[0]}/{segments[1]}", segments[2:]
        return (segments[0] if segments else ""), []


def _token_ok(repo: HubRepo, bearer: str | None) -> bool:
    return bearer is not None and (repo.token is None or bearer == repo.token)


def _safetensors_parameters(files: dict[str, HubFile]) -> dict[str, object] | None:
    """The `safetensors` field of model info: parameters per dtype over the weights a loader reads."""
    index = files.get("model.safetensors.index.json")
    if index is not None:
        names = set(json.loads(index.content).get("weight_map", {}).values())
    else:
        names = {"model.safetensors"} if "model.safetensors" in files else set()
    parameters: dict[str, int] = {}
    for name in sorted(names & set(files)):
        content = files[name].content
        try:
            (length,) = struct.unpack("<Q", content[:8])
            header = json.loads(content[8 : 8 + length])
        except (struct.error, ValueError):  # not a safetensors file: the hub then reports nothing
            return None
        for key, info in header.items():
            if key != "__metadata__":
                count = 1
                for dim in info["shape"]:
                    count *= dim
                parameters[info["dtype"]] = parameters.get(info["dtype"], 0) + count
    if not parameters:
        return None
    return {"parameters": parameters, "total": sum(parameters.values())}


def _model_info(repo: HubRepo, sha: str, blobs: bool) -> dict[str, object]:
    files = repo.commits[sha]
    siblings = []
    for path in sorted(files):
        entry: dict[str, object] = {"rfilename": path}
        if blobs:
            hub_file = files[path]
            entry.update(size=hub_file.size, blobId=hub_file.blob_id)
            if hub_file.lfs:
                entry["lfs"] = {"sha256": hub_file.sha256, "size": hub_file.size, "pointerSize": len(hub_file.pointer)}
        siblings.append(entry)
    config: dict[str, object] = {}
    if "config.json" in files:
        try:
            full = json.loads(files["config.json"].content)
        except ValueError:
            full = {}
        config = {k: full[k] for k in ("architectures", "model_type", "quantization_config") if k in full}
    author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
    return {
        "_id": sha[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": author,
        "sha": sha,
        "lastModified": _DATE,
        "createdAt": _DATE,
        "private": repo.private,
        "gated": "manual" if repo.gated else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": "transformers",
        "config": config,
        "siblings": siblings,
        "safetensors": _safetensors_parameters(files),
        "usedStorage": sum(f.size for f in files.values()),
    }


def _tree(files: dict[str, HubFile], prefix: str, recursive: bool) -> list[dict[str, object]]:
    """Tree entries under `prefix` ('' = root): files and directories, directly below or all the way down."""
    base = f"{prefix}/" if prefix else ""
    entries: dict[str, dict[str, object]] = {}
    for path in sorted(files):
        if not path.startswith(base):
            continue
        parts = path[len(base) :].split("/")
        depth = len(parts) if recursive else 1
        for i in range(1, min(depth, len(parts))):  # the directories on the way
            directory = base + "/".join(parts[:i])
            oid = hashlib.sha1(f"tree {directory}".encode()).hexdigest()
            entries.setdefault(directory, {"type": "directory", "oid": oid, "size": 0, "path": directory})
        if len(parts) == 1 or recursive:
            hub_file = files[path]
            entry: dict[str, object] = {"type": "file", "oid": hub_file.blob_id, "size": hub_file.size, "path": path}
            if hub_file.lfs:
                entry["lfs"] = {"oid": hub_file.sha256, "size": hub_file.size, "pointerSize": len(hub_file.pointer)}
            entries[path] = entry
    return [entries[key] for key in sorted(entries)]


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte of `bytes=a-b | a- | -n` within a file of `size` bytes; None if unsatisfiable."""
    spec = header.strip()
    if not spec.lower().startswith("bytes=") or "," in spec:
        return None
    first_text, _, last_text = spec[6:].strip().partition("-")
    try:
        if not first_text.strip():
            suffix = int(last_text)
            if suffix <= 0:
                return None
            return max(size - suffix, 0), size - 1
        first = int(first_text)
        last = int(last_text) if last_text.strip() else size - 1
    except ValueError:
        return None
    last = min(last, size - 1)
    if first > last or first >= size:
        return None
    return first, last


class _QuietServer(ThreadingHTTPServer):
    """Handler threads die with the process; a client that hangs up mid-answer is not an error worth printing."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubRequestHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubRequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive: every answer carries Content-Length, HEAD answers carry no body."""

    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"
    timeout = 60  # seconds an idle keep-alive connection is held
    hub: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # --- dispatch ----------------------------------------------------------------------------------------------

    def _serve(self, method: str) -> None:
        self.hub._record(method, self.path)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        try:
            split = urlsplit(self.path)
            segments = split.path.strip("/").split("/")
            if segments[:2] == ["api", "models"] and method == "GET":
                self._api(segments[2:], parse_qs(split.query))
            elif method in ("GET", "HEAD") and "resolve" in segments[1:3]:
                self._resolve(method, segments)
            else:
                raise HubError(404, None, "Not Found")
        except HubError as error:
            self._send_error(method, error)
        except ConnectionError:
            raise
        except Exception as error:  # a bug in the fake hub: answer 500 with its text rather than hang up
            self._send_error(method, HubError(500, None, f"{type(error).__name__}: {error}"))

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return token.strip() or None

    def _api(self, segments: list[str], query: dict[str, list[str]]) -> None:
        repo_id, rest = self.hub._split_repo([unquote(s) for s in segments[:2]] + segments[2:])
        repo = self.hub._repo(repo_id, self._bearer())
        if not rest or rest[0] == "revision":
            revision = unquote(rest[1]) if len(rest) >= 2 else repo.default_branch
            sha = self.hub._commit(repo, revision)
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            self._send_json(_model_info(repo, sha, blobs))
        elif rest[0] == "tree" and len(rest) >= 2:
            sha = self.hub._commit(repo, unquote(rest[1]))
            prefix = "/".join(unquote(s) for s in rest[2:]).strip("/")
            files = repo.commits[sha]
            if prefix and prefix not in files and not any(p.startswith(prefix + "/") for p in files):
                raise HubError(404, "EntryNotFound", f'{prefix} does not exist on "{rest[1]}"', {"X-Repo-Commit": sha})
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            if prefix in files:  # the real hub lists a file path as that one file
                self._send_json([e for e in _tree(files, "", True) if e["path"] == prefix])
            else:
                self._send_json(_tree(files, prefix, recursive))
        elif rest == ["refs"]:
            self._send_json(
                {
                    "branches": [
                        {"name": n, "ref": f"refs/heads/{n}", "targetCommit": s}
                        for n, s in sorted(repo.branches.items())
                    ],
                    "converts": [],
                    "tags": [
                        {"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in sorted(repo.tags.items())
                    ],
                }
            )
        else:
            raise HubError(404, None, "Not Found")

    def _resolve(self, method: str, segments: list[str]) -> None:
        at = 2 if len(segments) > 2 and segments[2] == "resolve" else 1
        repo_id = "/".join(unquote(s) for s in segments[:at])
        if len(segments) < at + 3:
            raise HubError(404, "EntryNotFound", "Entry not found")
        revision = unquote(segments[at + 1])
        path = "/".join(unquote(s) for s in segments[at + 2 :])
        bearer = self._bearer()
        repo = self.hub._repo(repo_id, bearer)
        sha = self.hub._commit(repo, revision)
        if repo.gated and not _token_ok(repo, bearer):
            message = (
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                if bearer is None
                else f"Access to model {repo_id} is restricted and you are not in the authorized list."
            )
            raise HubError(401 if bearer is None else 403, "GatedRepo", message)
        hub_file = repo.commits[sha].get(path)
        if hub_file is None:
            raise HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha})
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{hub_file.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if hub_file.lfs:
            headers["X-Linked-Etag"] = f'"{hub_file.sha256}"'
            headers["X-Linked-Size"] = str(hub_file.size)
        body, status = hub_file.content, 200
        range_header = self.headers.get("Range")
        if range_header and method == "GET":
            span = _parse_range(range_header, hub_file.size)
            if span is None:
                raise HubError(
                    416, None, f"Range Not Satisfiable: {range_header}", {"Content-Range": f"bytes */{hub_file.size}"}
                )
            first, last = span
            body, status = body[first : last + 1], 206
            headers["Content-Range"] = f"bytes {first}-{last}/{hub_file.size}"
        if method == "HEAD":
            self._send(status, headers, b"", content_length=len(body))
            return
        cut = self.hub._take_cut(repo_id, path)
        if cut is not None and cut < len(body):  # (a cut past the end: the whole body, the cut spent)
            self._send(status, headers, body[:cut], content_length=len(body))
            self.hub._count(repo_id, path, cut)
            self.wfile.flush()
            self.close_connection = True
            try:  # a clean end of stream mid-body: the client sees an incomplete message
                self.connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        self._send(status, headers, body)
        self.hub._count(repo_id, path, len(body))

    # --- writing -------------------------------------------------------------------------------------------------

    def _send(self, status: int, headers: dict[str, str], body: bytes, content_length: int | None = None) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _send_json(self, payload: object) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(payload).encode())

    def _send_error(self, method: str, error: HubError) -> None:
        body = json.dumps({"error": error.message}).encode()
        headers = {"Content-Type": "application/json", "X-Error-Message": error.message, **error.headers}
        if error.code:
            headers["X-Error-Code"] = error.code
        if method == "HEAD":
            self._send(error.status, headers, b"", content_length=len(body))
        else:
            self._send(error.status, headers, body)
