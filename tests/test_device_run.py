"""tools/device_run.py, the one device command, without a device: its plan (every phase within
the 9 minutes, at most 8 result files), the `gpu` tests it runs collect here, and the driver
itself (setup: the checkout linked as `ringserve`, the models written in the background; a
phase in its own session) running the serve sweep on the CPU backend with the tiny shape."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tools" / "device_run.py"
sys.path.insert(0, str(DRIVER.parent))
import device_run  # noqa: E402  (a script: it runs before `ringserve` is importable on the device)


def test_the_plan_fits_nine_minutes_and_eight_files(tmp_path):
    proc = subprocess.run([sys.executable, str(DRIVER), "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    plan = [re.match(r"(.+?): (\d+) s -> (\S+): (.+)", ln).groups() for ln in lines]
    assert [p[0] for p in plan] == ["preflight", "gpu tests", "gpu_check", "serve sweep", "spec bench"]
    assert sum(int(p[1]) for p in plan) <= 530 <= 9 * 60
    assert {p[2] for p in plan} <= set(device_run.RESULT_FILES) and len(device_run.RESULT_FILES) <= 8
    commands = {p[0]: p[3] for p in plan}
    assert f"--out {tmp_path}" in commands["gpu_check"] and "--table all" in commands["gpu_check"]
    budget = int(re.search(r"--budget-s (\d+)", commands["gpu_check"]).group(1))
    assert budget < int(plan[2][1])  # gpu_check ends before its phase is killed
    assert "--concurrency 1,8,64,256" in commands["serve sweep"]
    assert "bench_spec --device cuda --sweep-shape 1B" in commands["spec bench"]
    assert "--concurrency 1 " in commands["spec bench"]
    assert "--dtypes bfloat16,float16,q4_k_m" in commands["serve sweep"]  # issue 29: a packed model too
    assert all(t in commands["gpu tests"] for t in device_run.GPU_TESTS)


def test_a_phase_gets_its_limit_but_never_what_later_phases_need():
    chosen = list(device_run.PHASES)
    assert device_run.seconds_for(chosen, 0, 1000) == chosen[0].limit_s
    late = device_run.seconds_for(chosen, 1, 200)  # 200 s left: the later phases keep theirs
    assert late == 200 - sum(p.min_s for p in chosen[2:])


def test_the_gpu_tests_collect_here():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                           "-p", "no:cacheprovider", *device_run.GPU_TESTS], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = re.findall(r"(test_\w+)\.py::", proc.stdout)
    assert set(collected) == {"test_gpu_cuda", "test_gpu_serve", "test_gpu_graph_memory"}
    assert collected.count("test_gpu_serve") == 8 and len(collected) > 80


def test_the_driver_runs_the_serve_sweep_on_the_cpu(tmp_path):
    out, wheels = tmp_path / "out", tmp_path / "no-wheels"
    wheels.mkdir()
    proc = subprocess.run([sys.executable, str(DRIVER), "--out", str(out), "--phases", "serve sweep",
                           "--device", "cpu", "--shape", "tiny", "--concurrency", "2", "--lens", "16,8",
                           "--dtypes", "bfloat16,float16",
                           "--wheels", str(wheels), "--models", str(tmp_path / "models"),
                           "--budget-s", "120"],
                          capture_output=True, text=True, timeout=180)
    log = (out / "device_run.txt").read_text()
    assert proc.returncode == 0, log
    assert "serve sweep: ok" in log and "setup: numpy" in log
    assert {p.name for p in out.iterdir()} == {"device_run.txt", "serve_sweep.json", "serve_sweep.txt"}
    sweep = json.loads((out / "serve_sweep.json").read_text())
    assert [(p["dtype"], p["mode"]) for p in sweep["points"]] == [
        ("bfloat16", "ring"), ("bfloat16", "http"), ("float16", "ring"), ("float16", "http")]
    for p in sweep["points"]:
        assert (p["summary"]["completed"], p["summary"]["failed"]) == (16, 0), p
    assert all(s["exit"] == 0 for s in sweep["servers"].values())
    # issue 28's ratios: each model's own forward rate at batch c (tools/forward_rate.py), then
    # ring over it and HTTP over ring, one row per dtype and c
    assert set(sweep["forward"]) == {"bfloat16", "float16"}
    assert all(f["2"] > 0 for f in sweep["forward"].values()), sweep["forward"]
    table = (out / "serve_sweep.txt").read_text()
    rows = [line.split() for line in table.splitlines() if line.startswith(("bfloat16", "float16"))
            and line.split()[1] == "2" and line.rstrip().endswith("%")]
    assert [r[0] for r in rows] == ["bfloat16", "float16"] and all(len(r) == 7 for r in rows), table
    models = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert models == ["llama-tiny-bfloat16", "llama-tiny-float16"]


def test_the_gpu_phase_runs_every_gpu_test_file():
    """A new tests/test_gpu_*.py is run on the device too, not only collected here."""
    files = {p.name for p in (ROOT / "tests").glob("test_gpu_*.py")}
    assert files == {Path(t).name for t in device_run.GPU_TESTS}


def test_the_sweeps_q4_k_m_model_is_a_random_gguf_written_once(tmp_path):
    """serve_sweep's q4_k_m entry: a random GGUF of the shape (tools/random_gguf.py), written
    under a temporary name and renamed, reused after; device_run writes it in a writer of its own."""
    import gguf

    from ringserve.tools import serve_sweep
    assert device_run.GGUF_DTYPES == serve_sweep.GGUF_LAYOUTS
    path = serve_sweep.model_dir("tiny", "q4_k_m", tmp_path)
    assert path.name == "llama-tiny-q4_k_m.gguf" and [p.name for p in tmp_path.iterdir()] == [path.name]
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == 2 + 9 * 2  # embedding, output norm; 9 tensors a layer
    mtime = path.stat().st_mtime_ns
    assert serve_sweep.model_dir("tiny", "q4_k_m", tmp_path) == path and path.stat().st_mtime_ns == mtime
