"""Gunicorn settings for `ringserve serve` (loaded with `-c python:ringserve.server.gunicorn_conf`).

The launcher passes everything through RINGSERVE_* environment variables, so this file is the
one place the Gunicorn side of the deployment is written down.
"""
import logging
import os

from ringserve.server.config import WORKER_CONFIG_ENV, ServerConfig
from ringserve.server.metrics import mark_process_dead
from ringserve.server.supervision import LAUNCHER_PID_ENV, die_with_parent

# Defaults (server/config.py) only where this file is loaded without the launcher.
bind = [os.environ.get("RINGSERVE_BIND", f"{ServerConfig.host}:{ServerConfig.port}")]
workers = int(os.environ.get("RINGSERVE_WORKERS", "1"))
# An ASGI worker: gthread cannot hold hundreds of open SSE streams (docs/design.md §4). Uvicorn's,
# with header-read and idle timeouts and a way to cut a stream nobody reads (http_worker.py).
worker_class = "ringserve.server.http_worker.Worker"
# Each worker binds its own listening socket (SO_REUSEPORT) and the kernel spreads new
# connections over them by address hash: with one shared socket, whichever worker's event
# loop wakes first takes the connection, and one busy worker can end up with most of them.
# (A worker that exits resets the connections still queued in its own socket's backlog.)
reuse_port = True
# Hundreds of clients may connect in the same instant.
backlog = int(os.environ.get("RINGSERVE_BACKLOG", "2048"))
# SIGTERM: stop accepting, let open streams finish for this long, then stop the workers.
graceful_timeout = int(float(os.environ.get("RINGSERVE_DRAIN_TIMEOUT", ServerConfig.drain_timeout)))
# A worker blocked this long (not streaming, not heartbeating) is restarted.
timeout = 120
# Uvicorn's timeout_keep_alive: an idle connection (none sent yet, or between two requests)
# is closed after this many seconds (--timeout-keep-alive, as vLLM's).
keepalive = int(os.environ.get("RINGSERVE_TIMEOUT_KEEP_ALIVE", ServerConfig.timeout_keep_alive))
# Parallel servers on one machine must not fight over one control socket file.
control_socket_disable = True
accesslog = os.environ.get("RINGSERVE_ACCESS_LOG") or None
loglevel = os.environ.get("RINGSERVE_LOG_LEVEL", ServerConfig.log_level)
# --ssl-keyfile/--ssl-certfile: Gunicorn's TLS, which the Uvicorn worker serves.
keyfile = os.environ.get("RINGSERVE_SSL_KEYFILE") or None
certfile = os.environ.get("RINGSERVE_SSL_CERTFILE") or None


def child_exit(server, worker):
    mark_process_dead(worker.pid)


# Signals and supervision. The launcher starts the master in a session of its own, so a signal
# to the launcher's process group (Ctrl-C: SIGINT, which Gunicorn takes as a quick, stream-
# cutting stop) never reaches us; the launcher drains us with SIGTERM. If the launcher dies
# (SIGKILL), the kernel kills the master, and the master's death kills each worker.
def on_starting(server):
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:
        die_with_parent(int(launcher))
    server.log.error_log.addFilter(_ListenAddress(server.cfg.bind))
    if os.environ.get(WORKER_CONFIG_ENV):  # the workers' imports and tokenizer, shared by the fork
        from ringserve.server.worker import preload
        preload()


def post_fork(server, worker):
    if os.environ.get(LAUNCHER_PID_ENV):
        die_with_parent(server.pid)  # the master forks from its only thread
    # --uvicorn-log-level: Uvicorn's own loggers (its "trace" is below debug, level 5)
    level = os.environ.get("RINGSERVE_UVICORN_LOG_LEVEL")
    if level:
        numeric = 5 if level == "trace" else getattr(logging, level.upper())
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(numeric)
    # The app's loggers (ringserve.*: access lines, engine-client warnings) write where and as
    # Gunicorn's own do, at --log-level; without this only warnings reached stderr, bare.
    ours = logging.getLogger("ringserve")
    ours.handlers = list(server.log.error_log.handlers)
    ours.setLevel(server.log.error_log.level)
    ours.propagate = False


class _ListenAddress(logging.Filter):
    """Gunicorn's "Listening at: %s (%s)" with the address in it. With reuse_port each worker
    binds a socket of its own (gunicorn 27's arbiter, when SO_REUSEPORT exists, creates none
    and its LISTENERS stay empty), so the master prints an empty address: put back what the
    workers bind."""

    def __init__(self, bind: list[str]):
        super().__init__()
        self._address = ",".join(f"http://{b}" for b in bind)

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.msg == "Listening at: %s (%s)" and isinstance(record.args, tuple)
                and record.args[:1] == ("",)):
            record.args = (self._address, *record.args[1:])
        return True
