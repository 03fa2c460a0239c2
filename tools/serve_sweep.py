"""End to end on one machine: `ringserve serve` on a random-weight Llama, then `ringserve loadgen`
in ring and HTTP mode at each concurrency (issue 25's table: out tok/s and TPOT p50, failures),
and the ratios issue 28 names: ring over the forward's own decode rate at batch c (the same
model, tools/forward_rate.py, timed first in its own process), HTTP over ring.

    python -m ringserve.tools.serve_sweep --out DIR [--device cuda] [--dtypes bfloat16,float16]
        [--concurrency 1,8,64,256] [--shape 1B] [--budget-s 150]

The model is written once per shape and dtype into --models (tools/tiny_llama.py; the 1B shape
with a 384-token vocabulary as on the H200, ~20 s each) and reused: the device run writes them
while other phases run, and the `gpu` tests (tests/test_gpu_serve.py) read the same folders.
Each dtype gets one server (its log's tail goes into DIR/serve_sweep.txt); a load point runs
only while the budget lasts, each loadgen in its own process with a time limit, so a hang
costs one point. DIR/serve_sweep.json and .txt are rewritten after every point.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# make_tiny_llama's arguments per shape: "1B" is Llama-3.2-1B's layers with a 384-token vocabulary
# (the tokenizer is trained at write time); "tiny" is the tests' CPU model.
SHAPES: dict[str, dict[str, Any]] = {
    "1B": dict(num_layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=384,
               max_position_embeddings=4096),
    "tiny": dict(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=384),
}
MODES = ("ring", "http")


def default_models_dir() -> Path:
    return Path(os.environ.get("RINGSERVE_SWEEP_MODELS", Path(tempfile.gettempdir()) / "ringserve-sweep"))


# --dtypes entries that are GGUF layouts (tools/random_gguf.py), not checkpoint dtypes: the
# model is a random GGUF of the shape, kept packed on the device (quant.cu)
GGUF_LAYOUTS = ("q4_k_m",)


def gguf_model(shape: str, layout: str, root: Path | None = None) -> Path:
    """The random GGUF of `shape` in `layout` (a 1B Q4_K_M: about a minute), written as
    model_dir's models are (a temporary name, then renamed)."""
    from ringserve.tools.random_gguf import Shape, write_random_gguf
    root = root or default_models_dir()
    path = root / f"llama-{shape}-{layout}.gguf"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        s = SHAPES[shape]
        tmp = root / f".{path.name}-{os.getpid()}"
        write_random_gguf(tmp, Shape(hidden=s["hidden"], layers=s["num_layers"], heads=s["heads"],
                                     kv_heads=s["kv_heads"], ffn=s["ffn"], vocab=s["vocab"],
                                     context=s.get("max_position_embeddings", 8192)), layout, progress=False)
        tmp.rename(path)
    return path


def model_dir(shape: str, dtype: str, root: Path | None = None) -> Path:
    """The folder of the random model of `shape` in `dtype` (float32, float16 or bfloat16),
    written on first use (into a temporary name, then renamed: a reader never sees half); a
    GGUF_LAYOUTS entry: gguf_model's file."""
    from ringserve.tools.tiny_llama import make_tiny_llama
    if dtype in GGUF_LAYOUTS:
        return gguf_model(shape, dtype, root)
    root = root or default_models_dir()
    path = root / f"llama-{shape}-{dtype}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{path.name}-"))
        make_tiny_llama(tmp, dtype=dtype, **SHAPES[shape])
        try:
            tmp.rename(path)
        except OSError:  # written meanwhile by another process: theirs is as good
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `ringserve serve` started by launch_server; wait_up() until it answers, stop() ends it
    (SIGTERM: it drains; SIGKILL to its session past the timeout)."""
    proc: subprocess.Popen
    url: str
    log: Path
    terminated: bool = False  # SIGTERM sent: a second one could land after its handler is gone

    def wait_up(self, timeout: float) -> Server:
        """Until /health answers 200; RuntimeError (with the log's tail) if it exits first or
        takes longer than timeout (then it is stopped)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{tail(self.log)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop(10)
                raise RuntimeError(f"the server was not up after {timeout:.0f} s:\n{tail(self.log)}")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM once, unless it has exited: the launcher drains and exits."""
        if not self.terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 60) -> int | None:
        """terminate(), then its exit status (SIGKILL to its session past the timeout)."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def launch_server(model: Path, log: Path, *flags: str) -> Server:
    """`ringserve serve --model MODEL FLAGS` on 127.0.0.1 in a session of its own, its output
    into `log`; not waited for (several can start at once: Server.wait_up)."""
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve.tools.cli", "serve", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", log)


def start_server(model: Path, log: Path, *flags: str, timeout: float = 180) -> Server:
    """launch_server, then wait until it is up."""
    return launch_server(model, log, *flags).wait_up(timeout)


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def loadgen(url: str, model: Path, mode: str, concurrency: int, out: Path, *, input_len: int,
            output_len: int, num_prompts: int, timeout: float) -> dict:
    """One `ringserve loadgen` point in its own process: its summary, or {"error": ...}."""
    cmd = [sys.executable, "-m", "ringserve.tools.cli", "loadgen", "--mode", mode, "--base-url", url,
           "--tokenizer", str(model), "--concurrency", str(concurrency), "--num-prompts", str(num_prompts),
           "--input-len", str(input_len), "--output-len", str(output_len), "--warmup", "1",
           "--json", str(out), "--no-progress", "--seed", "0"]
    got = _json_of(cmd, out, timeout, "loadgen")
    return got if "error" in got else got["points"][0]["summary"]


def forward(model: Path, device: str, batches: list[int], context: int, out: Path, timeout: float) -> dict:
    """The served model's forward decode rate per batch (tools/forward_rate.py) in its own process
    (its device memory gone before the server starts): {"batch": tok/s}, or {"error": ...}."""
    cmd = [sys.executable, "-m", "ringserve.tools.forward_rate", "--model", str(model), "--device", device,
           "--batches", ",".join(map(str, batches)), "--context", str(context), "--json", str(out)]
    return _json_of(cmd, out, timeout, "forward_rate")


def _json_of(cmd: list[str], out: Path, timeout: float, name: str) -> dict:
    """Run a tool that writes its result to `out` as JSON: that result, or {"error": ...}."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{name} past its {timeout:.0f} s limit"}
    if not out.exists():
        return {"error": f"{name} exited {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(out.read_text())


@dataclass
class Sweep:
    """What one run measured; written as DIR/serve_sweep.json and the table DIR/serve_sweep.txt."""
    device: str
    shape: str
    input_len: int
    output_len: int
    points: list[dict] = field(default_factory=list)   # dtype, mode, concurrency, summary or error
    forward: dict[str, dict] = field(default_factory=dict)  # dtype -> {"batch": forward tok/s} or error
    servers: dict[str, dict] = field(default_factory=dict)  # dtype -> start seconds, log tail, exit
    skipped: list[str] = field(default_factory=list)

    def failures(self) -> int:
        """Requests that failed plus points that gave no result, plus servers that did not
        start or did not stop cleanly."""
        bad = sum(int(p["summary"].get("failed", 0)) if "error" not in p["summary"] else 1
                  for p in self.points)
        return bad + sum(1 for s in self.servers.values() if s.get("error") or s.get("exit") not in (0, None))

    def table(self) -> str:
        rows = [f"serve sweep: {self.shape} shape on {self.device}, {self.input_len} in / "
                f"{self.output_len} out, out tok/s and TPOT p50 (ms)",
                f"{'dtype':9} {'mode':5} {'c':>4} {'done':>5} {'failed':>6} {'out tok/s':>10} "
                f"{'TPOT p50':>9} {'TTFT p50':>9}"]
        rows += [point_row(p) for p in self.points]
        rows += self.ratio_rows()
        rows += [f"skipped: {m}" for m in self.skipped]
        for dtype, s in self.servers.items():
            error = f"; {s['error']}" if s.get("error") else ""
            rows.append(f"\nserver {dtype}: up in {s.get('start_s', float('nan')):.1f} s, exit "
                        f"{s.get('exit')}{error}\n{s.get('log_tail', '')}")
        return "\n".join(rows) + "\n"

    def ratio_rows(self) -> list[str]:
        """Issue 28's item 4 per dtype and concurrency c: ring out tok/s over the forward's tok/s
        at batch c (tools/forward_rate.py, the same model; goal >= 85 %), HTTP over ring (>= 90 %)."""
        rate = {(p["dtype"], p["mode"], p["concurrency"]): p["summary"].get("output_throughput")
                for p in self.points}
        rows = ["", f"{'dtype':9} {'c':>4} {'forward tok/s':>13} {'ring/forward':>12} {'http/ring':>9}"
                    "  (issue 28: >= 85 %, >= 90 %)"]
        for dtype, fwd in self.forward.items():
            if "error" in fwd:
                rows.append(f"{dtype:9} forward: {fwd['error']}")
                continue
            for c in sorted({p["concurrency"] for p in self.points if p["dtype"] == dtype}):
                f, ring, http = fwd.get(str(c)), rate.get((dtype, "ring", c)), rate.get((dtype, "http", c))
                rows.append(f"{dtype:9} {c:>4} {_num(f, '.0f'):>13} {_pct(ring, f):>12} "
                            f"{_pct(http, ring):>9}")
        return rows

    def write(self, out: Path) -> None:
        (out / "serve_sweep.json").write_text(json.dumps(self.__dict__, indent=2, default=str))
        (out / "serve_sweep.txt").write_text(self.table())


def point_row(p: dict) -> str:
    s = p["summary"]
    head = f"{p['dtype']:9} {p['mode']:5} {p['concurrency']:>4}"
    if "error" in s:
        return f"{head}  error: {s['error']}"
    return (f"{head} {s['completed']:>5} {s['failed']:>6} {s['output_throughput']:>10.0f} "
            f"{_ms(s['tpot']):>9} {_ms(s['ttft']):>9}")


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{100 * a / b:.0f} %"


def _ms(d: dict) -> str:
    return "-" if d.get("median") is None else f"{d['median']:.2f}"


def num_prompts_for(concurrency: int, minimum: int) -> int:
    """Enough requests to hold `concurrency` in flight for a while, few enough to be quick."""
    return max(minimum, 2 * concurrency)


def run(args: argparse.Namespace) -> Sweep:
    """Each dtype: its model (written if absent), one server, every mode x concurrency while its
    share of the budget lasts; results rewritten after every point."""
    deadline = time.monotonic() + args.budget_s
    sweep = Sweep(args.device, args.shape, args.input_len, args.output_len)
    args.out.mkdir(parents=True, exist_ok=True)
    # server logs and loadgen JSON: not in DIR (its files are counted); their tails go into the table
    logs = Path(tempfile.mkdtemp(prefix="serve-sweep-"))
    try:
        for i, dtype in enumerate(args.dtypes):
            # each dtype gets an equal share of what is left: one slow model cannot starve the next
            share = time.monotonic() + (deadline - time.monotonic()) / (len(args.dtypes) - i)
            if share - time.monotonic() < 10:
                sweep.skipped.append(f"{dtype}: no time left")
                continue
            sweep_one(args, sweep, dtype, share, logs)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return sweep


def sweep_one(args: argparse.Namespace, sweep: Sweep, dtype: str, until: float, logs: Path) -> None:
    """One dtype's server and its points, until the monotonic time `until`."""
    model = model_dir(args.shape, dtype, args.models)
    info: dict = {}
    sweep.servers[dtype] = info
    if args.forward:  # the reference rate first, in its own process (gone before the server starts)
        sweep.forward[dtype] = forward(model, args.device, args.concurrency,
                                       args.input_len + args.output_len // 2, logs / f"forward-{dtype}.json",
                                       timeout=max(5.0, (until - time.monotonic()) / 3))
        sweep.write(args.out)
    t = time.monotonic()
    try:
        server = start_server(model, logs / f"serve-{dtype}.log", "--device", args.device,
                              *args.serve_flags, timeout=min(args.start_timeout_s, until - t))
    except RuntimeError as e:
        info.update(error=str(e).splitlines()[0], log_tail=tail(logs / f"serve-{dtype}.log"))
        sweep.write(args.out)
        return
    info["start_s"] = time.monotonic() - t
    try:
        for mode in MODES:
            for c in args.concurrency:
                left = until - time.monotonic()
                if left < 5:
                    sweep.skipped.append(f"{dtype} {mode} c={c}: {left:.0f} s left")
                    continue
                summary = loadgen(server.url, model, mode, c, logs / f"{dtype}-{mode}-{c}.json",
                                  input_len=args.input_len, output_len=args.output_len,
                                  num_prompts=num_prompts_for(c, args.min_prompts), timeout=left)
                sweep.points.append(dict(dtype=dtype, mode=mode, concurrency=c, summary=summary))
                print(point_row(sweep.points[-1]), flush=True)
                sweep.write(args.out)
    finally:
        info.update(exit=server.stop(), log_tail=tail(server.log, 12))
        sweep.write(args.out)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for serve_sweep.json and .txt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1B")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float16"],
                    help="the checkpoints' dtypes, one server each (float32, float16, bfloat16; "
                         "q4_k_m: a random GGUF of the shape, kept packed)")
    ap.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 64, 256])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-forward", dest="forward", action="store_false",
                    help="skip the forward's own rate (tools/forward_rate.py), the ratios' reference")
    ap.add_argument("--min-prompts", type=int, default=16, help="requests per point: max(this, 2 x c)")
    ap.add_argument("--models", type=Path, default=None,
                    help="where the models are written and reused (default $RINGSERVE_SWEEP_MODELS "
                         "or TMPDIR/ringserve-sweep)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="the whole sweep, model writing included")
    ap.add_argument("--start-timeout-s", type=float, default=120.0)
    ap.add_argument("--write-models", action="store_true",
                    help="only write the models (tools/device_run.py: while other phases run)")
    ap.add_argument("--serve-flags", nargs=argparse.REMAINDER, default=["--workers", "2"],
                    help="the rest of the line: flags for every `ringserve serve`")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_models:
        for dtype in args.dtypes:
            t = time.monotonic()
            print(f"serve_sweep: {model_dir(args.shape, dtype, args.models)} in {time.monotonic() - t:.0f} s",
                  flush=True)
        return 0
    sweep = run(args)
    print(sweep.table(), end="")
    return 0 if sweep.points and not sweep.failures() and not sweep.skipped else 1


if __name__ == "__main__":
    sys.exit(main())
