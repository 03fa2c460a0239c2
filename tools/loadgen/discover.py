"""Where a running `ringserve serve` keeps its engines' control sockets.

The launcher writes ``server.json`` into its private runtime folder (``$TMPDIR/ringserve-run-*``,
mode 0700): the URL it serves, its pid, the model folder and the control-socket paths — what a
Gunicorn worker is given. A load generator in ring mode attaches to those sockets exactly as a
worker does.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ringserve.ipc.shm import pid_alive

SERVER_FILE = "server.json"


@dataclass
class ServerInfo:
    url: str
    pid: int
    model_dir: str
    max_model_len: int
    served_model_names: list[str]
    control_paths: list[str]
    tokenizer_dir: str  # --tokenizer's folder, else the model's

    @classmethod
    def read(cls, path: Path) -> ServerInfo:
        d = json.loads(path.read_text())
        return cls(d["url"], d["pid"], d["model_dir"], d["max_model_len"],
                   d["served_model_names"], d["control_paths"], d.get("tokenizer_dir") or d["model_dir"])


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    hostname = u.hostname or ""
    host = {"localhost": "127.0.0.1", "0.0.0.0": "127.0.0.1", "": "127.0.0.1"}.get(hostname, hostname)
    return host, u.port or (443 if u.scheme == "https" else 80)


def find_server(url: str | None = None, server_dir: str | Path | None = None) -> ServerInfo:
    """The live server at ``url`` (matched by host and port), or the one whose runtime folder is
    ``server_dir``. Raises LookupError saying what was looked at."""
    if server_dir is not None:
        path = Path(server_dir) / SERVER_FILE
        if not path.is_file():
            raise LookupError(f"{path} does not exist: is {server_dir} a ringserve runtime folder?")
        return ServerInfo.read(path)
    root = Path(tempfile.gettempdir())
    live = []
    for path in root.glob(f"ringserve-*/{SERVER_FILE}"):
        try:
            info = ServerInfo.read(path)
        except (OSError, ValueError, KeyError):
            continue
        if pid_alive(info.pid):
            live.append(info)
    if url is not None:
        want = _host_port(url)
        live = [s for s in live if _host_port(s.url) == want]
    if len(live) != 1:
        found = ", ".join(s.url for s in live) or "none"
        raise LookupError(f"ring mode needs exactly one running ringserve server at "
                          f"{url or 'any address'} on this machine (looked in {root}/ringserve-*/"
                          f"{SERVER_FILE}; found: {found}); pass --server-dir")
    return live[0]
