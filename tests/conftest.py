"""Shared fixtures. Other test files may add fixtures here."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ringserve.tools.tiny_llama import make_tiny_llama


def child_pids(pid: int) -> list[int]:
    """pid's children now (every thread's, /proc/PID/task/*/children); [] once it is gone."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(p) for p in (task / "children").read_text().split()]
            except OSError:  # the thread ended meanwhile
                pass
    except FileNotFoundError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """Every descendant of pid now (a server's: engines, the Gunicorn master, its workers)."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    """pid's command line, its arguments joined by spaces; "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_pids(launcher_pid: int) -> list[int]:
    """A server's engine processes: its launcher's children running _engine_main (server/launch.py
    _start_python names the function on their command line)."""
    return [c for c in child_pids(launcher_pid) if "_engine_main" in cmdline(c)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA 4/2, vocab 384) in an HF-layout folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


TINY_CUDA_MODELS = {  # head_dim 64, the smallest attention.cu compiles for
    "tied-g3": dict(hidden=192, heads=3, kv_heads=1, ffn=256),  # SmolLM2's GQA group, tied
    "untied-g2": dict(hidden=256, heads=4, kv_heads=2, ffn=256, tie_embeddings=False, seed=1),
}


@pytest.fixture(scope="session")
def tiny_cuda_models(tmp_path_factory):
    """name -> folder, each made on first use (tiny_cuda_model_dir)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_llama(tmp_path_factory.mktemp(f"tiny-llama-{name}"),
                                         **TINY_CUDA_MODELS[name])
        return made[name]
    return get


@pytest.fixture(scope="session", params=list(TINY_CUDA_MODELS))
def tiny_cuda_model_dir(request, tiny_cuda_models) -> Path:
    """Each of TINY_CUDA_MODELS in turn: a test using it runs for both."""
    return tiny_cuda_models(request.param)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the cache folder
    (`make test` fetches it before pytest runs)."""
    from ringserve.gpu.loader.model_store import resolve_model
    return resolve_model(None)


def with_chat_template(model_dir: Path, folder: Path, template: str) -> Path:
    """`model_dir` in `folder` with another chat template in its tokenizer_config.json, every
    other file linked, not copied."""
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def no_segment_left_behind():
    """The module must leave no ringserve segment in /dev/shm made by this process or by a
    process now dead (live servers of other runs may own some). NOTE: a few seconds' grace: under
    `make test`'s two workers, the other worker's engine may have just died with its parent about
    to unlink its segments; a leak stays."""
    from ringserve.ipc.shm import list_segments
    before = set(list_segments())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = []
        for name in set(list_segments()) - before:
            pid = int(name.split("-")[1])
            if pid == os.getpid() or not Path(f"/proc/{pid}").exists():
                left.append(name)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == [], "shared-memory segments left in /dev/shm"


@pytest.fixture
def unused_port() -> int:
    return free_port()


@dataclass
class ServeProcess:
    """A real `ringserve serve` (the launcher process) on 127.0.0.1."""
    proc: subprocess.Popen
    port: int
    log: Path
    terminated: bool = False     # SIGTERM sent: a second one could land after its handler is gone

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def terminate(self) -> None:
        """SIGTERM once (unless it has already exited): the launcher drains and exits."""
        if not self.terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self) -> str:
        """SIGTERM (unless it has already exited): it must exit 0 with no traceback in its log.
        Returns the log."""
        self.terminate()
        assert self.proc.wait(60) == 0, self.log.read_text()
        text = self.log.read_text()
        assert "Traceback" not in text, text
        return text


def start_serve(model_dir: Path, flags: tuple[str, ...], log: Path, started: list[ServeProcess],
                timeout: float, **popen) -> ServeProcess:
    """Start `ringserve serve --model MODEL_DIR FLAGS...` (added to `started` at once, so that
    the caller stops it whatever happens next) and wait until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve.tools.cli", "serve", "--model", str(model_dir),
           "--port", str(port), *flags]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **popen)
    server = ServeProcess(proc, port, log)
    started.append(server)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """Start a real `ringserve serve --model MODEL_DIR FLAGS...` and wait until /health answers
    200: call it as serve(model_dir, *flags, timeout=...), get a ServeProcess. Every server it
    started is stopped after the module (ServeProcess.stop: exit 0, no traceback)."""
    started: list[ServeProcess] = []

    def start(model_dir: Path, *flags: str, timeout: float = 120.0) -> ServeProcess:
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        return start_serve(model_dir, flags, log, started, timeout)

    yield start
    for server in started:  # SIGTERM them all first, so that they drain in parallel
        server.terminate()
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server(serve, tiny_model_dir):
    """Start a real `ringserve serve` on the tiny model (1 worker, CPU): call it with extra serve
    flags, get its base URL. Stopped after the module as `serve` stops its servers."""
    def start(*extra: str) -> str:
        return serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu",
                     "--drain-timeout", "2", *extra).url
    return start


@pytest.fixture(scope="session")
def cuda_host(tmp_path_factory):
    """The CUDA C kernels compiled for the host, each variant once per session
    (tests/cuda_host_kernels.py); skips the test where g++ is missing."""
    from cuda_host_kernels import HostBuild, find_gxx
    gxx = find_gxx()
    if gxx is None:
        pytest.skip("g++ not found: the CUDA C host tests compile the .cu files with it")
    return HostBuild(gxx, tmp_path_factory.mktemp("cuda_host"))


SIMULATOR_LAUNCHER = "test_simulator_tests_pass_in_their_own_process"

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # Numba's simulator runs a block's threads as Python threads while its BlockManager polls
    # them holding the GIL, so each barrier waits out switch intervals: at the default 5 ms the
    # simulator tests ran ~2.5x longer. The same kernels run; only the GIL changes hands sooner.
    sys.setswitchinterval(1e-4)


@pytest.fixture(scope="session")
def simulator_tests(request):
    """Call it with a test file's path: that file's simulator tests (which need
    NUMBA_ENABLE_CUDASIM=1 before numba is first imported) must all pass, none skipped, in a
    pytest process of their own. One process runs `-m sim` over every collected file with a
    SIMULATOR_LAUNCHER test (tests/test_cuda_sim.py, tests/test_cuda_sampler.py), on the first
    call: one interpreter and one numba import for them all; each file run alone runs its own."""
    root = request.config.rootpath
    files = sorted({item.nodeid.split("::")[0] for item in request.session.items
                    if item.name == SIMULATOR_LAUNCHER})
    run: list[subprocess.CompletedProcess] = []

    def check(test_file: str) -> None:
        mine = [f for f in files if (root / f).resolve() == Path(test_file).resolve()]
        assert mine, f"{test_file}: no {SIMULATOR_LAUNCHER} collected from it"
        path = mine[0]
        if not run:
            env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
            run.append(subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "sim",
                 *files], cwd=root, env=env, capture_output=True, text=True, timeout=600))
        proc = run[0]
        out = proc.stdout[-6000:] + proc.stderr[-3000:]
        assert proc.returncode in (0, 1), out  # 1: some test failed; anything else: no results
        summary = proc.stdout.partition("short test summary info")[2].splitlines()
        lines = [line for line in summary if f" {path}:" in line]
        assert lines and all(line.startswith("PASSED ") for line in lines), out
    return check
