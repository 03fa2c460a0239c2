"""`ringserve serve`: resolve the model once, start the engine process(es), then Gunicorn.

Process tree:  launcher ─┬─ engine 0..E-1   (a Python of its own: an engine on a control socket)
                         └─ gunicorn master ── W Uvicorn workers (the Falcon app, one engine client each)

The launcher is the only process that resolves (downloads/converts) the model; workers get the
folder. It restarts an engine that dies, and kills (SIGKILL) and restarts one that hangs: no
heartbeat, or one step running, for --engine-hang-timeout seconds (ipc/stats.hang_reason). The
launcher is the only judge: a worker fails an engine's streams when the engine's control socket
closes, which the kill does, never on a heartbeat of its own (workers answer 503 meanwhile).

On SIGTERM/SIGINT it lets Gunicorn drain open streams for --drain-timeout seconds, then stops
the engines and removes its runtime folder (control sockets, Prometheus files) and any shared
memory left behind. The children run in sessions of their own, so a signal to the launcher's
process group (Ctrl-C in a terminal, `kill -- -PGID`) reaches only the launcher, which drains
as for SIGTERM; they die with it if it is killed (server/supervision.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ringserve.ipc.shm import Segment, remove_stale_segments
from ringserve.ipc.stats import (
    BLOCK_SIZE,
    DRAFT_KV_CACHE_BYTES,
    DRAFT_WEIGHT_BYTES,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    EngineStats,
    ThroughputLog,
    hang_reason,
)
from ringserve.server.config import WORKER_CONFIG_ENV
from ringserve.server.memory import release_free_heap
from ringserve.server.supervision import (
    LAUNCHER_PID_ENV,
    die_with_parent,
    make_runtime_dir,
    remove_stale_runtime_dirs,
)

log = logging.getLogger("ringserve.launch")

ENGINE_START_TIMEOUT_S = 600.0
# Seconds between two throughput lines while there is traffic (vLLM's VLLM_LOG_STATS_INTERVAL).
LOG_STATS_INTERVAL_ENV = "RINGSERVE_LOG_STATS_INTERVAL"

EXIT_REFUSED = 3  # an engine that cannot serve with these settings, having printed why in one line


class EngineRefused(RuntimeError):
    """An engine refused to start and printed why (its one line): `serve` adds no other."""


def serve_sections() -> list[tuple[str, type]]:
    """The settings classes whose setting fields are the `serve` flags, in --help order
    (EngineConfig brings its model fields and holds the next three as parts). Imported here, not
    at module level, so that --help stays light (engine/config.py and gpu/settings.py load
    neither numba nor CuPy; the engine process does)."""
    from ringserve.engine.config import EngineConfig, SchedulerConfig
    from ringserve.gpu.settings import CacheConfig, DeviceConfig
    from ringserve.server.config import ParallelConfig, RequestLimits, ServerConfig, StructuredOutputsConfig
    return [("model", EngineConfig), ("device", DeviceConfig), ("KV cache", CacheConfig),
            ("scheduler", SchedulerConfig), ("processes", ParallelConfig), ("server", ServerConfig),
            ("per-request limits (400 above them)", RequestLimits),
            ("structured outputs and tools (400 above the limits)", StructuredOutputsConfig)]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags, generated from the settings classes (server/config.py add_arguments):
    named as vLLM names them where they overlap."""
    from ringserve.server.config import add_arguments
    for title, cls in serve_sections():
        add_arguments(p, cls, title)


@dataclass
class _Engine:
    index: int
    control_path: str
    process: subprocess.Popen  # _start_python("_engine_main", ...)
    segment: Segment | None = None    # its stats segment, attached once it is ready
    stats: EngineStats | None = None  # a view of it: what the hang check reads

    def detach(self) -> None:
        if self.stats is not None:
            self.stats.release()
        if self.segment is not None:
            self.segment.close()
        self.stats = self.segment = None


def _start_python(entry: str, *args, **kwargs) -> subprocess.Popen:
    """A fresh Python running this module's function `entry`(*args, **kwargs) (its command line
    names it, for ps), the arguments pickled through its stdin; stdout and stderr are ours.
    NOTE: not multiprocessing (spawn, since a process that may hold CUDA is never forked): its
    spawn starts a resource-tracker process (~9 MB) that nothing here needs, for the server's
    lifetime, and re-runs the launcher's main module in every child."""
    proc = subprocess.Popen([sys.executable, "-c", "from ringserve.server.launch import _python_entry;"
                             " _python_entry()", entry], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    with proc.stdin:
        pickle.dump((args, kwargs), proc.stdin)
    return proc


def _python_entry() -> None:
    """The child's side of _start_python: the call read from stdin, which is then /dev/null."""
    args, kwargs = pickle.load(sys.stdin.buffer)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    entries: dict[str, Callable[..., None]] = {"_engine_main": _engine_main, "_compile_main": _compile_main}
    entries[sys.argv[1]](*args, **kwargs)


def _engine_main(gpu: str | None, config, control_path: str, launcher_pid: int, log_level: str,
                 **kwargs) -> None:
    """An engine process's entry: in a session of its own (group signals are the launcher's to
    handle), killed with the launcher; its GPU is CUDA_VISIBLE_DEVICES (it then sees one
    device, 0), set before anything in it initializes CUDA. It logs as the launcher does (a
    spawned process starts with logging unconfigured: its info lines were lost)."""
    _configure_logging(log_level)
    os.setsid()
    die_with_parent(launcher_pid)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from ringserve.engine.kv_events import KVEventsError
    from ringserve.engine.process import serve_engine, start_engine
    from ringserve.gpu.errors import ModelError
    if config.device_config.device == "cpu":
        _compile_apart(config, log_level)
    try:
        engine = start_engine(config, control_path, **kwargs)
    except (ModelError, KVEventsError, ValueError) as e:  # cannot serve: its one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
    serve_engine(engine)


def _compile_apart(config, log_level: str) -> None:
    """A CPU engine's first start (Numba's cache without its kernels) compiles them in a process
    of its own, which exits, and then loads them from the cache as a later start does: a process
    that compiled a kernel keeps the compiler's module of it (Numba keeps them to link later
    kernels against) for as long as it lives, ~100 MB on the 1B shape, which one that loaded it
    does not hold. What fails there is the engine's own to report: it then starts as before."""
    from ringserve.gpu.cpu.runner import kernels_cached
    if kernels_cached():
        return
    code = _start_python("_compile_main", config, os.getpid(), log_level).wait()
    if code != 0:
        log.warning("compiling the kernels apart failed (exit code %s): the engine compiles them",
                    code)


def _compile_main(config, engine_pid: int, log_level: str) -> None:
    """The compile process: the engine's model and step kernels built (the runner's warm-up
    compiles them into Numba's cache), then gone."""
    _configure_logging(log_level)
    die_with_parent(engine_pid)
    from ringserve.engine.core import EngineCore
    try:
        EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - the engine reports it, in its own words
        log.debug("compile process: %s", exc)
        sys.exit(1)


class Launcher:
    def __init__(self, args: argparse.Namespace, model_dir: Path, max_model_len: int,
                 tokenizer_dir: Path | None = None):
        """args: the parsed `serve` flags. Each settings class is built from them here, so a bad
        flag fails (ValueError) before anything starts."""
        from ringserve.engine.config import EngineConfig
        from ringserve.gpu.devices import cpu_threads_per_engine, cuda_stack_problem, plan_engines
        from ringserve.gpu.loader.config import generation_defaults
        from ringserve.gpu.loader.model_store import served_model_name
        from ringserve.server.config import (
            ParallelConfig,
            RequestLimits,
            ServerConfig,
            StructuredOutputsConfig,
            from_args,
        )
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir  # --tokenizer, resolved (None: the model's)
        self.model_name = served_model_name(args.model, model_dir)  # when --served-model-name is not given
        self.max_model_len = max_model_len
        self.server: ServerConfig = from_args(ServerConfig, args)
        self.parallel: ParallelConfig = from_args(ParallelConfig, args)
        self.request_limits: RequestLimits = from_args(RequestLimits, args)
        choice = self.server.generation_config  # vLLM's --generation-config: auto | vllm | a folder
        self.default_sampling = generation_defaults(choice, model_dir)
        if self.default_sampling:
            log.info("default sampling parameters from %s's generation_config.json: %s",
                     "the model" if choice == "auto" else choice, self.default_sampling)
        self.structured: StructuredOutputsConfig = from_args(StructuredOutputsConfig, args)
        # Counted without initializing CUDA here (gpu/devices.py); one engine per GPU by default.
        self.device, self.engine_gpus = plan_engines(args.device, self.parallel.engines)
        if self.device == "cuda" and (problem := cuda_stack_problem()) is not None:
            raise ValueError(problem)  # one line now, not an engine's AttributeError later
        # With the device resolved, EngineConfig resolves its by-device defaults without CUDA.
        resolved = argparse.Namespace(**{**vars(args), "device": self.device})
        self.engine_config: EngineConfig = from_args(
            EngineConfig, resolved, model=str(model_dir),  # max_model_len: the flag's (None: not given)
            tokenizer=None if tokenizer_dir is None else str(tokenizer_dir))
        device_config = self.engine_config.device_config
        if self.device == "cpu" and device_config.cpu_threads is None and len(self.engine_gpus) > 1:
            # several CPU engines share the cores (each alone would take them all)
            device_config.cpu_threads = cpu_threads_per_engine(len(self.engine_gpus))
        if (busy := self.kv_events_ports_in_use()) is not None:
            raise ValueError(busy)
        # What a launcher killed before its cleanup left: runtime folders, segments.
        remove_stale_runtime_dirs()
        remove_stale_segments()
        self.runtime, self._runtime_lock = make_runtime_dir()  # 0700, locked while we live
        self.engines: list[_Engine] = []
        self.gunicorn: subprocess.Popen | None = None
        self._stopping = False

    # -- engines -----------------------------------------------------------------------------
    def _debug_path(self, index: int) -> str | None:
        """Where engine `index` publishes its debug snapshot (None: debug endpoints off)."""
        if not self.server.enable_debug_endpoints:
            return None
        return str(self.runtime / f"engine-{index}.debug.json")

    def _start_engine(self, index: int) -> _Engine:
        path = str(self.runtime / f"engine-{index}.sock")
        proc = _start_python("_engine_main", self.engine_gpus[index], self.engine_config, path,
                             os.getpid(), self.server.log_level,
                             max_slots=max(64, 2 * self.parallel.workers),
                             debug_path=self._debug_path(index), data_parallel_rank=index)
        return _Engine(index, path, proc)

    def _wait_ready(self, engine: _Engine) -> EngineStats:
        """Block until the engine takes connections; its published stats (kept attached in
        engine.stats for the hang check)."""
        from ringserve.ipc import control
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while True:
            if (code := engine.process.poll()) is not None:
                if code == EXIT_REFUSED:  # it said why, in one line
                    raise EngineRefused(f"engine {engine.index} refused to start (its error above)")
                raise RuntimeError(f"engine {engine.index} exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine.index} did not start in {ENGINE_START_TIMEOUT_S} s")
            if os.path.exists(engine.control_path):
                try:
                    conn, welcome, fds = control.connect(engine.control_path)
                except (OSError, control.HandshakeError):
                    time.sleep(0.1)
                    continue
                try:
                    engine.segment = Segment.attach(welcome.stats_segment)
                    engine.stats = EngineStats(engine.segment.buf)
                    return engine.stats
                finally:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
            time.sleep(0.1)

    # -- gunicorn ----------------------------------------------------------------------------
    def _start_gunicorn(self) -> subprocess.Popen:
        a = self.server
        prom = self.runtime / "prometheus"
        prom.mkdir()
        names = a.served_model_name or [self.model_name]
        worker_config = {
            "model_dir": str(self.model_dir),
            "served_model_names": names,
            "max_model_len": self.max_model_len,
            "api_key": a.api_key,
            "max_body_bytes": a.max_body_bytes,
            "request_limits": vars(self.request_limits),
            "structured_outputs": vars(self.structured),
            "vocab_size": _model_vocab_size(self.model_dir),
            "max_stream_backlog": a.max_stream_backlog,
            # "auto" tool choice is served only with --enable-auto-tool-choice (vLLM's rule)
            "tool_call_parser": a.tool_call_parser if a.enable_auto_tool_choice else None,
            "tokenizer_dir": str(self.tokenizer_dir or self.model_dir),
            "chat_template": a.chat_template,
            "default_sampling": self.default_sampling,
            "disable_log_requests": a.disable_log_requests,
            "allowed_origins": a.allowed_origins,
            "allowed_methods": a.allowed_methods,
            "allowed_headers": a.allowed_headers,
            "allow_credentials": a.allow_credentials,
            "root_path": a.root_path,
            "reasoning_parser": a.reasoning_parser,
            "control_paths": [e.control_path for e in self.engines],
            "debug_paths": ([self._debug_path(e.index) for e in self.engines]
                            if a.enable_debug_endpoints else None),
            "metrics_prefix": a.metrics_prefix,
            "server_info": self._server_info(),
            "kv_event_sources": self.kv_event_sources(),
        }
        env = dict(os.environ,
                   PROMETHEUS_MULTIPROC_DIR=str(prom),
                   RINGSERVE_BIND=f"{a.host}:{a.port}",
                   RINGSERVE_WORKERS=str(self.parallel.workers),
                   RINGSERVE_DRAIN_TIMEOUT=str(a.drain_timeout),
                   RINGSERVE_LOG_LEVEL=a.log_level,
                   RINGSERVE_UVICORN_LOG_LEVEL=a.uvicorn_log_level,
                   RINGSERVE_SSL_KEYFILE=a.ssl_keyfile or "",
                   RINGSERVE_SSL_CERTFILE=a.ssl_certfile or "",
                   RINGSERVE_TIMEOUT_KEEP_ALIVE=str(a.timeout_keep_alive),
                   RINGSERVE_TIMEOUT_HEADER_READ=str(a.timeout_header_read),
                   RINGSERVE_TIMEOUT_BODY_READ=str(a.timeout_body_read),
                   RINGSERVE_H11_MAX_INCOMPLETE_EVENT_SIZE=str(a.h11_max_incomplete_event_size),
                   **{WORKER_CONFIG_ENV: json.dumps(worker_config)})
        # What an outside engine client (`ringserve loadgen` in ring mode) needs to attach to
        # the engines as a worker does; the runtime folder is 0700, the key stays out anyway.
        server_info = dict(worker_config, url=self.url, pid=os.getpid())
        del server_info["api_key"]
        (self.runtime / "server.json").write_text(json.dumps(server_info))
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        cmd = [sys.executable, "-m", "gunicorn", "-c", "python:ringserve.server.gunicorn_conf",
               "ringserve.server.worker:worker_app()"]
        # Its own session: a signal to our process group must not reach Gunicorn, which takes
        # SIGINT as a quick (stream-cutting) stop; we drain it with SIGTERM (shutdown).
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        a = self.server
        return f"{'https' if a.ssl_certfile else 'http'}://{a.host}:{a.port}{a.root_path or ''}"

    def _server_info(self) -> dict:
        """The static facts /get_server_info shows (server/app.py ServerInfo): one instance id
        for all workers of this server, and the scheduler settings routers size replicas by."""
        e = self.engine_config
        sched = e.scheduler_config
        return {"instance_id": uuid.uuid4().hex, "engines": len(self.engines),
                "device": e.device_config.device,
                "max_num_seqs": sched.max_num_seqs, "max_running_requests": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "enable_prefix_caching": e.cache_config.enable_prefix_caching,
                "kv_events_config": None if e.kv_events is None else asdict(e.kv_events)}

    def kv_event_sources(self) -> dict[str, dict]:
        """GET /kv_event_sources: each engine's publisher, keyed by its rank (vllm-router's
        kv_index discovery reads this shape: its config with the rank's ports); {} when off."""
        kv = self.engine_config.kv_events
        if kv is None or not kv.enabled:
            return {}
        return {str(i): dict(asdict(kv.for_rank(i)), data_parallel_rank=i)
                for i in range(len(self.engine_gpus))}

    def kv_events_ports_in_use(self) -> str | None:
        """Why an engine's KV-event endpoint cannot be bound, or None (checked before any
        engine starts, so that a port in use is one line, not an engine that fails)."""
        from ringserve.engine.kv_events import bind_address
        for source in self.kv_event_sources().values():
            for name in ("endpoint", "replay_endpoint"):
                address = source[name] and bind_address(source[name])
                if address and (busy := _address_in_use(*address)) is not None:
                    return f"--kv-events-config: cannot bind {source[name]}: {busy}"
        return None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def control_paths(self) -> list[str]:
        return [e.control_path for e in self.engines]

    def start(self) -> None:
        """Start the engines, wait until they take connections, then start Gunicorn."""
        self.engines = [self._start_engine(i) for i in range(len(self.engine_gpus))]
        ready = [self._wait_ready(e) for e in self.engines]
        if self._stopping:
            return
        # An engine whose KV pool holds fewer tokens clamped it (engine/config.py fit_max_model_len).
        self.max_model_len = min([self.max_model_len, *(s[MAX_MODEL_LEN] for s in ready if s[MAX_MODEL_LEN])])
        self.gunicorn = self._start_gunicorn()
        for e, stats in zip(self.engines, ready, strict=True):
            gpu = self.engine_gpus[e.index]
            weights = stats.weight_bytes()
            blocks, bs = stats[NUM_BLOCKS], stats[BLOCK_SIZE]
            log.info("engine %d: device %s%s, weights %s (%s), KV pool %d blocks x %d = %d tokens, %s",
                     e.index, self.device, "" if gpu is None else f" (CUDA_VISIBLE_DEVICES={gpu})",
                     _size(sum(weights.values())),
                     ", ".join(f"{k} {_size(v)}" for k, v in sorted(weights.items(), key=lambda kv: -kv[1])),
                     blocks, bs, blocks * bs, _size(stats[KV_CACHE_BYTES]))
            if stats[DRAFT_WEIGHT_BYTES]:  # speculative decoding's draft model, in the same engine
                log.info("engine %d: draft model weights %s, its KV pool %s (the same %d blocks)",
                         e.index, _size(stats[DRAFT_WEIGHT_BYTES]), _size(stats[DRAFT_KV_CACHE_BYTES]),
                         blocks)
        log.info("serving %s (%s) as %s on %s with %d workers, max_model_len %d",
                 self.model_dir.name, self.model_dir,
                 ", ".join(self.server.served_model_name or [self.model_name]),
                 self.url, self.parallel.workers, self.max_model_len)
        if self.server.enable_debug_endpoints:
            log.info("dashboard: %s/dashboard (engines: /debug/engines)", self.url)
        release_free_heap()  # what reading the model's metadata and starting the rest left freed

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.start()
            return 0 if self.gunicorn is None else self._supervise(self.gunicorn)
        finally:
            self.shutdown()

    def _log_stats(self, logs: dict[int, ThroughputLog]) -> None:
        """Each engine's throughput line since the last call (none while it is idle)."""
        label = "GPU KV cache" if self.device == "cuda" else "KV cache"
        for e in self.engines:
            if e.stats is None:
                continue
            tl = logs.get(e.index)
            if tl is None or tl.stats is not e.stats:  # new, or restarted: count from now
                logs[e.index] = ThroughputLog(e.index, e.stats, label)
            elif (line := tl.line()) is not None:
                log.info("%s", line)

    def _supervise(self, gunicorn: subprocess.Popen) -> int:
        interval = float(os.environ.get(LOG_STATS_INTERVAL_ENV, "10"))
        logs: dict[int, ThroughputLog] = {}
        next_stats = time.monotonic()
        while not self._stopping:
            if time.monotonic() >= next_stats:
                self._log_stats(logs)
                next_stats = time.monotonic() + interval
            code = gunicorn.poll()
            if code is not None:
                log.error("gunicorn exited with code %s", code)
                return 1
            for i, e in enumerate(self.engines):
                if self._stopping:
                    break
                if (code := e.process.poll()) is not None:
                    log.error("engine %d died (exit code %s); restarting it", e.index, code)
                elif e.stats is not None and (why := hang_reason(e.stats, self.server.engine_hang_timeout)):
                    # SIGKILL works on a stopped process too. Its control sockets close: the
                    # workers fail its open requests and reconnect to the new one.
                    log.error("engine %d (pid %d) is hung: %s (--engine-hang-timeout %g); "
                              "killing and restarting it", e.index, e.process.pid, why,
                              self.server.engine_hang_timeout)
                    e.process.kill()
                    e.process.wait()
                else:
                    continue
                e.detach()
                self.engines[i] = self._start_engine(e.index)
                try:
                    self._wait_ready(self.engines[i])
                except RuntimeError as exc:
                    log.error("%s", exc)
                    return 1
            time.sleep(0.2)
        return 0

    def _on_signal(self, signum, frame) -> None:
        self._stopping = True

    def shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.gunicorn is not None and self.gunicorn.poll() is None:
            log.info("draining open streams (up to %.0f s)", self.server.drain_timeout)
            self.gunicorn.send_signal(signal.SIGTERM)  # graceful: workers finish their streams
            try:
                self.gunicorn.wait(self.server.drain_timeout + 10)
            except subprocess.TimeoutExpired:
                self.gunicorn.kill()
                self.gunicorn.wait()
        for e in self.engines:
            if e.process.poll() is None:
                e.process.terminate()
        for e in self.engines:
            try:
                e.process.wait(10)
            except subprocess.TimeoutExpired:
                e.process.kill()
                e.process.wait()
            e.detach()
        remove_stale_segments()
        shutil.rmtree(self.runtime, ignore_errors=True)
        os.close(self._runtime_lock)
        log.info("stopped")


def _model_vocab_size(model_dir: Path) -> int:
    from ringserve.gpu.loader.config import ModelConfig
    return ModelConfig.from_dir(model_dir).vocab_size


def _address_in_use(host: str, port: int) -> str | None:
    """Why host:port cannot be bound, or None. The workers bind with SO_REUSEPORT, which would
    silently share the port with another server of the same user: check that none is there."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Gunicorn binds
            s.bind(addr)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _configure_logging(level: str) -> None:
    """The launcher's and the engines' log lines: time, logger, level, message, on stderr."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _model_folder(args: argparse.Namespace) -> Path | None:
    """The model's folder (gpu/loader/model_store.py resolve_model). Anything but a folder is
    resolved by `ringserve download` in a child process (its progress and errors on our
    stderr; None where it failed): a download imports huggingface_hub (~13 MB) and a GGUF
    conversion gguf and numpy, which the launcher would keep for the server's lifetime. A
    folder is checked here (a ModelError if it holds no model)."""
    from ringserve.gpu.loader.model_store import resolve_model
    if args.model is not None and Path(args.model).expanduser().is_dir():
        return resolve_model(args.model)
    cmd = [sys.executable, "-m", "ringserve.tools.cli", "download"]
    cmd += [] if args.revision is None else ["--revision", args.revision]
    cmd += [] if args.download_dir is None else ["--download-dir", args.download_dir]
    cmd += [] if args.model is None else ["--", args.model]  # NOTE: a name may start with "-"
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.splitlines()[-1]) if done.returncode == 0 else None


def serve_command(args: argparse.Namespace) -> int:
    _configure_logging(args.log_level)
    from ringserve.gpu.errors import ModelError
    from ringserve.gpu.loader.config import ModelConfig
    from ringserve.gpu.loader.model_store import resolve_tokenizer
    from ringserve.server.config import ParallelConfig, ServerConfig, from_args
    try:  # the frontend's settings first: a refused flag must not wait for a model's download
        from_args(ServerConfig, args)
        from_args(ParallelConfig, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if (model_dir := _model_folder(args)) is None:
            return 1  # `ringserve download` said why
        model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
        if args.quantization is not None:  # NOTE: weights.py imports numpy, which the launcher
            from ringserve.gpu.loader.weights import check_quantization  # would keep for life
            check_quantization(args.quantization, model_dir)
        tokenizer_dir = (None if args.tokenizer is None
                         else resolve_tokenizer(args.tokenizer, args.download_dir))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    max_model_len = model_len if args.max_model_len is None else args.max_model_len
    if max_model_len > model_len:
        print(f"error: --max-model-len {max_model_len} is longer than the model's "
              f"max_position_embeddings {model_len}", file=sys.stderr)
        return 1
    if (busy := _address_in_use(args.host, args.port)) is not None:
        print(f"error: cannot listen on {args.host}:{args.port}: {busy}", file=sys.stderr)
        return 1
    try:
        return Launcher(args, model_dir, max_model_len, tokenizer_dir).run()
    except EngineRefused:
        return 1
    except (RuntimeError, ValueError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
