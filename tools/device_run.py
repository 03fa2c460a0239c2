"""The one device command (docs/deploy.md "The device command"): on a bare GPU machine without
network, from the checkout's root, in at most --budget-s (530 s) and with at most 8 files in
--out:

    python3 tools/device_run.py --out "$OUT"

0. setup: the wheels of .whl/ (tools/download_wheels.sh: what the image lacks, and a numpy
   older than 2.5) installed with --target into a folder put first on PYTHONPATH, the
   checkout linked as `ringserve` beside it (nothing is installed into the image). If the
   image's compiled packages refuse that numpy, it is set aside and a sitecustomize shim
   (np.row_stack = np.vstack) stands in, and device_run.txt says so. The two random 1B-shape
   models (bfloat16, float16) are written in the background meanwhile.
1. preflight (tools/gpu_preflight.py)                          -> preflight.txt
2. the `gpu` tests (tests/test_gpu_serve.py, test_gpu_cuda.py, test_gpu_graph_memory.py) -> gpu_tests.txt
3. gpu_check, fp16 / bf16 and quantized tables (--table all)   -> gpu_check.json, .txt, .log
   (its quantized linear and decode tables echoed into device_run.txt and the output tail)
4. the serve sweep (tools/serve_sweep.py: c = 1, 8, 64, 256, ring and HTTP; bfloat16, float16 and
   Q4_K_M models of the shape)
                                                               -> serve_sweep.json, .txt
5. speculative decoding (tools/bench_spec.py: n-gram, and the sweep's tiny random model as a
   draft model: tok/s with and without at c = 1, the bfloat16 model)
                                                               -> device_run.txt
and device_run.txt: this driver's log (setup, each phase's command, status and seconds).

Each phase runs in a process session of its own with its own time limit, never past what the
later phases need at least (their min_s), and is killed with its whole group when it passes it;
one hang costs that phase only. This file imports nothing outside the standard library: it runs
before the wheels are installed. --dry-run prints the plan (commands and limits) and runs
nothing; tests/test_device_run.py runs the driver on the CPU (the serve phase, a tiny model).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULT_FILES = ("device_run.txt", "preflight.txt", "gpu_check.json", "gpu_check.txt", "gpu_check.log",
                "gpu_tests.txt", "serve_sweep.json", "serve_sweep.txt")
# The servers' start first; then every other tests/test_gpu_*.py (as gpu_check runs them).
GPU_TESTS = ("tests/test_gpu_serve.py", "tests/test_gpu_cuda.py", "tests/test_gpu_graph_memory.py")
# Stands in for numpy's np.row_stack where the carried numpy < 2.5 cannot be used (gpu/devices.py
# cuda_stack_problem: numba-cuda 0.30.4 registers it, numpy 2.5 removed it).
SHIM = ("import numpy as np  # ringserve tools/device_run.py: numba-cuda registers np.row_stack\n"
        "if not hasattr(np, 'row_stack'):\n    np.row_stack = np.vstack\n")
# The image's compiled packages that must import with the numpy put ahead of theirs.
NUMPY_PROBE = ("import importlib.util, numpy\n"
               "for m in ('cupy', 'numba', 'torch'):\n"
               "    if importlib.util.find_spec(m):\n        __import__(m)\n"
               "print(numpy.__version__, numpy.__file__)\n")


@dataclass
class Phase:
    name: str
    limit_s: float      # its own time limit
    min_s: float        # what it needs at least: kept free for it by the phases before
    log: str            # the file of --out its output goes to
    command: Callable[[argparse.Namespace, float], list[str]]  # (args, seconds it has) -> argv


def _py(*argv: str) -> list[str]:
    return [sys.executable, "-u", *argv]


# Limits add up to 520 s of the 530: setup (~15 s: the wheels) comes out of the last phase's.
# The gpu tests come before the benchmarks: correctness first when a phase must be cut short.
PHASES = (
    Phase("preflight", 50, 20, "preflight.txt", lambda a, s: _py("-m", "ringserve.tools.gpu_preflight")),
    Phase("gpu tests", 190, 60, "gpu_tests.txt", lambda a, s: _py(
        "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider",
        *GPU_TESTS)),
    Phase("gpu_check", 130, 60, "gpu_check.log", lambda a, s: _py(
        "-m", "ringserve.tools.gpu_check", "--out", str(a.out), "--skip-tests", "--skip-preflight",
        "--table", "all", "--budget-s", str(int(s - 10)))),
    Phase("serve sweep", 90, 40, "device_run.txt", lambda a, s: _py(
        "-m", "ringserve.tools.serve_sweep", "--out", str(a.out), "--device", a.device, "--shape", a.shape,
        "--dtypes", a.dtypes, "--concurrency", a.concurrency, "--budget-s", str(int(s - 10)),
        "--input-len", str(a.lens[0]), "--output-len", str(a.lens[1]),
        "--serve-flags", "--workers", "2")),
    # three engines of the sweep's model (one process: Numba compiles once; plain, n-gram and a
    # tiny draft model), c = 1 only, 64 tokens a request to fit the phase
    Phase("spec bench", 60, 30, "device_run.txt", lambda a, s: _py(
        "-m", "ringserve.tools.bench_spec", "--device", a.device, "--sweep-shape", a.shape,
        "--dtype", "bfloat16", "--concurrency", "1", "--max-tokens", "64", "--with-ngram",
        "--draft-sweep-shape", "tiny")),
)
MODEL_PHASES = ("gpu tests", "serve sweep", "spec bench")  # they wait for the models to be written


class Log:
    """device_run.txt: every line also on stdout (the device tool's output tail)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        with open(self.path, "a") as f:
            f.write(stamped + "\n")


def run_phase(cmd: list[str], log: Path, timeout: float, env: dict) -> str:
    """cmd in a session of its own, output appended to log; 'ok', 'failed (rc N)' or 'timed out'
    (the whole group killed)."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None or rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return "timed out" if rc is None else "ok" if rc == 0 else f"failed (rc {rc})"


def setup(args: argparse.Namespace, log: Log, work: Path) -> dict:
    """The children's environment: the wheels of args.wheels installed into a folder of `work`
    first on PYTHONPATH, the checkout linked as `ringserve`, numpy checked (the shim if it must)."""
    site, pkg, shim = work / "site", work / "pkg", work / "shim"
    pkg.mkdir()
    (pkg / "ringserve").symlink_to(ROOT)
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    path = [str(pkg)]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--target", str(site), *map(str, wheels)]
        log(f"setup: {len(wheels)} wheels -> {site}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            log(f"setup: pip failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}")
        path.insert(0, str(site))
    else:
        log(f"setup: no wheels in {args.wheels}: the environment as it is")
    if os.environ.get("PYTHONPATH"):  # kept, after ours
        path.append(os.environ["PYTHONPATH"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
               RINGSERVE_SWEEP_MODELS=str(args.models or work / "models"))
    probe = subprocess.run([sys.executable, "-c", NUMPY_PROBE], capture_output=True, text=True, env=env)
    if probe.returncode != 0 and list(site.glob("numpy*")):
        why = next((ln for ln in reversed(probe.stderr.splitlines()) if "Error" in ln), "see above")
        log(f"setup: the image's packages refuse the carried numpy ({why}); set aside, the "
            "np.row_stack shim instead")
        for p in site.glob("numpy*"):
            subprocess.run(["rm", "-rf", str(p)], check=False)
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SHIM)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), *path])
        probe = subprocess.run([sys.executable, "-c", NUMPY_PROBE], capture_output=True, text=True, env=env)
    log(f"setup: numpy {probe.stdout.strip() or probe.stderr.strip()[-300:]}")
    return env


def seconds_for(chosen: list[Phase], i: int, left: float) -> float:
    """What phase chosen[i] gets when `left` seconds remain: its limit, never more than what is
    left once the later phases' min_s are kept."""
    return min(chosen[i].limit_s, left - sum(p.min_s for p in chosen[i + 1:]))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="the result folder ($OUT)")
    ap.add_argument("--budget-s", type=float, default=530.0, help="the whole run, setup included")
    ap.add_argument("--phases", type=lambda s: s.split(","), default=[p.name for p in PHASES],
                    help="a comma list of: " + ", ".join(p.name for p in PHASES))
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    ap.add_argument("--models", type=Path, default=None, help="where the sweep's models are written")
    ap.add_argument("--device", default="cuda", help="the serve sweep's --device")
    ap.add_argument("--shape", default="1B", help="the serve sweep's model shape (tools/serve_sweep.py)")
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--dtypes", default="bfloat16,float16,q4_k_m",
                    help="the serve sweep's models (q4_k_m: a random GGUF, packed on the device)")
    ap.add_argument("--lens", type=lambda s: [int(n) for n in s.split(",")], default=[128, 128],
                    help="the serve sweep's prompt and output tokens")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out or $OUT is required")
    if unknown := set(args.phases) - {p.name for p in PHASES}:
        ap.error(f"unknown phases {sorted(unknown)}")
    return args


GGUF_DTYPES = ("q4_k_m",)  # serve_sweep.GGUF_LAYOUTS (this file imports nothing of ringserve)


def write_models(args: argparse.Namespace, env: dict) -> dict[str, subprocess.Popen]:
    """The serve sweep's (and the gpu tests') models, written in the background: "plain" (the
    checkpoints the gpu tests use too) and "gguf" (a random GGUF: a 1B Q4_K_M takes about a
    minute; only the serve sweep waits for it), one process each."""
    dtypes = args.dtypes.split(",")
    groups = {"plain": [d for d in dtypes if d not in GGUF_DTYPES],
              "gguf": [d for d in dtypes if d in GGUF_DTYPES]}
    writers = {}
    with open(args.out / "device_run.txt", "ab") as f:
        for name, group in groups.items():
            if group:
                writers[name] = subprocess.Popen(
                    _py("-m", "ringserve.tools.serve_sweep", "--out", str(args.out), "--shape", args.shape,
                        "--dtypes", ",".join(group), "--write-models"),
                    stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return writers


def run_phases(args: argparse.Namespace, chosen: list[Phase], deadline: float, log: Log) -> dict[str, str]:
    """Setup, then each phase in turn within its seconds; phase name -> its status. The
    temporary folder (wheels, link, shim, models unless --models) goes at the end."""
    work = Path(tempfile.mkdtemp(prefix="ringserve-device-"))
    try:
        return _run_phases(args, chosen, deadline, log, setup(args, log, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_phases(args: argparse.Namespace, chosen: list[Phase], deadline: float, log: Log,
                env: dict) -> dict[str, str]:
    writers = write_models(args, env) if set(MODEL_PHASES) & set(args.phases) else {}
    # the phase -> the models it waits for (the spec bench runs the sweep's bfloat16 checkpoint)
    waits = {"gpu tests": ("plain",), "serve sweep": ("plain", "gguf"), "spec bench": ("plain",)}
    status: dict[str, str] = {}
    try:
        for i, phase in enumerate(chosen):
            for writer in (writers[w] for w in waits.get(phase.name, ()) if w in writers):
                with contextlib.suppress(subprocess.TimeoutExpired):  # a hang shows in the phase
                    writer.wait(timeout=max(1.0, seconds_for(chosen, i, deadline - time.monotonic()) / 2))
            seconds = seconds_for(chosen, i, deadline - time.monotonic())
            if seconds < phase.min_s / 2:
                status[phase.name] = f"skipped ({seconds:.0f} s left)"
                log(f"{phase.name}: {status[phase.name]}")
                continue
            cmd = phase.command(args, seconds)
            log(f"{phase.name}: {seconds:.0f} s: {shlex.join(cmd)}")
            t = time.monotonic()
            status[phase.name] = run_phase(cmd, args.out / phase.log, seconds, env)
            log(f"{phase.name}: {status[phase.name]} in {time.monotonic() - t:.0f} s")
    finally:
        for writer in writers.values():
            if writer.poll() is None:
                os.killpg(writer.pid, signal.SIGKILL)
                writer.wait()
    return status


# gpu_check.txt's sections that fill docs/deploy.md's device tables (the quantized linear and
# decode tables): echoed at the end, so that the run's output tail holds them.
QUANT_SECTIONS = ("quantized linear alone", "quantized weights, decode")
SECTION_ENDS = ("skipped: ", "failed: ", "phases (s): ")  # gpu_check print_tables' last lines


def quant_tables(text: str) -> list[str]:
    """The lines of QUANT_SECTIONS in gpu_check.txt's text (a section ends at a blank line or
    at print_tables' closing lines)."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith(QUANT_SECTIONS):
            inside = True
        elif not line.strip() or line.startswith(SECTION_ENDS):
            inside = False
        if inside:
            lines.append(line)
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = [p for p in PHASES if p.name in args.phases]
    deadline = time.monotonic() + args.budget_s
    if args.dry_run:
        left = args.budget_s
        for i, phase in enumerate(chosen):
            seconds = seconds_for(chosen, i, left)
            print(f"{phase.name}: {seconds:.0f} s -> {phase.log}: {shlex.join(phase.command(args, seconds))}")
            left -= seconds
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "device_run.txt")
    log(f"device_run: budget {args.budget_s:.0f} s, phases {', '.join(args.phases)}, out {args.out}")
    status = run_phases(args, chosen, deadline, log)
    table = args.out / "gpu_check.txt"
    for line in quant_tables(table.read_text()) if table.is_file() else []:
        log(line)
    log("device_run: " + "; ".join(f"{k} {v}" for k, v in status.items()))
    if extra := sorted(p.name for p in args.out.iterdir() if p.name not in RESULT_FILES):
        log(f"device_run: files in --out beyond the {len(RESULT_FILES)} expected: {extra}")
    return 0 if status and all(v == "ok" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
