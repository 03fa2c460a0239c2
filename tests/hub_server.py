"""A Hugging Face Hub on 127.0.0.1 for tests: the repositories are the folders ``ORG/NAME`` of a
root folder, served over the endpoints huggingface_hub's HfApi.list_repo_files, snapshot_download
and hf_hub_download call (point HF_ENDPOINT at `url`):

- GET  /api/models/ORG/NAME[/revision/REV]  the repository's info: its commit (sha), its files
- GET  /api/models/ORG/NAME/tree/REV         its files (the listing snapshot_download reads)
- HEAD|GET /ORG/NAME/resolve/REV/PATH          a file, with ETag, X-Repo-Commit, Content-Length

REV is "main" or the commit. Errors carry the Hub's X-Error-Code (RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo), which huggingface_hub turns into its exceptions. Every request path is
kept in `requests`, so that a test can tell a cache hit (no request) from a download.
"""
from __future__ import annotations

import hashlib
import json
import threading
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@cache
def _blob_id(path: Path, size: int, mtime_ns: int) -> str:
    """git's blob id of a file (what the Hub gives as a small file's oid and ETag)."""
    h = hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class HubServer:
    def __init__(self, root: Path, gated: frozenset[str] = frozenset()):
        self.root = root
        self.gated = gated  # repo ids answered with GatedRepo
        self.requests: list[str] = []
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"hub": self}))
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()

    def files(self, repo: str) -> list[Path]:
        folder = self.root / repo
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def oid(self, path: Path) -> str:
        st = path.stat()
        return _blob_id(path, st.st_size, st.st_mtime_ns)

    def commit(self, repo: str) -> str:
        """The repository's one commit: a digest of its files' names and contents."""
        h = hashlib.sha1(repo.encode())
        for p in self.files(repo):
            h.update(f"{p.relative_to(self.root / repo)}:{self.oid(p)}".encode())
        return h.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set by HubServer on its subclass

    def log_message(self, *args) -> None:  # quiet: the test reads self.hub.requests
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2] + "/" + parts[3], parts[4:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
        return self._error(404, "RepoNotFound")

    def _repo_and_revision(self, repo: str, revision: str) -> bool:
        if repo in self.hub.gated:
            self._error(403, "GatedRepo")
            return False
        if not (self.hub.root / repo).is_dir():
            self._error(404, "RepoNotFound")
            return False
        if revision not in ("main", self.hub.commit(repo)):
            self._error(404, "RevisionNotFound")
            return False
        return True

    def _api(self, repo: str, rest: list[str]) -> None:
        kind, revision = (rest[0], rest[1]) if len(rest) >= 2 else ("revision", "main")
        if not self._repo_and_revision(repo, revision):
            return
        files = [(p.relative_to(self.hub.root / repo).as_posix(), p) for p in self.hub.files(repo)]
        if kind == "tree":
            self._json([{"type": "file", "path": name, "size": p.stat().st_size, "oid": self.hub.oid(p)}
                        for name, p in files])
        else:
            self._json({"id": repo, "modelId": repo, "sha": self.hub.commit(repo), "private": False,
                        "gated": False, "siblings": [{"rfilename": name} for name, _ in files]})

    def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
        if not self._repo_and_revision(repo, revision):
            return
        path = self.hub.root / repo / name
        if not path.is_file():
            return self._error(404, "EntryNotFound")
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("ETag", f'"{self.hub.oid(path)}"')
        self.send_header("X-Repo-Commit", self.hub.commit(repo))
        self.end_headers()
        if body:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    self.wfile.write(chunk)

    def _json(self, value) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)
