"""Backend choice and GPU counting without a GPU (gpu/devices.py), and the `serve` flags that
carry them to the engines (server/launch.py)."""
from __future__ import annotations

import argparse
import shutil
import stat

import pytest

from ringserve.engine.config import EngineConfig
from ringserve.gpu import devices
from ringserve.gpu.devices import plan_engines, resolve_device, visible_gpus


def test_cuda_visible_devices_is_counted_without_cuda():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " 2, 5 "}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f1c,GPU-77aa"}) == ["GPU-8f1c", "GPU-77aa"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_nvidia_smi_lines_are_counted(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -L ] || exit 2\n"
                    "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)'\n"
                    "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)'\n"
                    "echo '  MIG 1g.10gb Device 0: (UUID: MIG-c)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert visible_gpus({}, nvidia_smi=str(fake)) == ["0", "1"]
    assert visible_gpus({}, nvidia_smi=str(tmp_path / "absent")) == []
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
    assert visible_gpus({}, nvidia_smi=str(failing)) == []


@pytest.mark.skipif(devices.cupy_installed(), reason="CuPy is installed here")
def test_auto_is_cpu_without_cupy():
    assert not devices.cuda_available()
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cuda") == "cuda"  # asked for explicitly: the runner reports what fails
    with pytest.raises(ValueError, match="tpu"):
        resolve_device("tpu")
    # The launcher: a GPU is visible, but without CuPy the engines run on the CPU, one of them.
    assert plan_engines(None, None, {"CUDA_VISIBLE_DEVICES": "0,1"}) == ("cpu", [None])


def test_engine_plan_one_engine_per_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert plan_engines("cuda", None, env) == ("cuda", ["3", "5"])
    assert plan_engines("cuda", 3, env) == ("cuda", ["3", "5", "3"])  # more engines: shared
    assert plan_engines("cuda", 1, env) == ("cuda", ["3"])
    assert plan_engines("cpu", None, env) == ("cpu", [None])
    assert plan_engines("cpu", 2, env) == ("cpu", [None, None])
    assert plan_engines("auto", None, {"CUDA_VISIBLE_DEVICES": ""}) == ("cpu", [None])
    with pytest.raises(ValueError, match="no GPU is visible"):
        plan_engines("cuda", None, {"CUDA_VISIBLE_DEVICES": "-1"})
    with pytest.raises(ValueError, match="at least 1"):
        plan_engines("cpu", 0, env)


def _serve_args(argv):
    from ringserve.server.launch import add_serve_arguments
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_serve_flags_reach_the_engine_config(tiny_model_dir, monkeypatch):
    from ringserve.server.launch import Launcher
    a = _serve_args([])
    assert (a.device, a.dtype, a.engines, a.enforce_eager, a.attention_backend) == (
        "auto", "auto", None, False, "auto")
    with pytest.raises(SystemExit):
        _serve_args(["--attention-backend", "triton"])

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,4")
    a = _serve_args(["--device", "cuda", "--enforce-eager", "--attention-backend", "numba",
                     "--dtype", "float16"])
    launcher = Launcher(a, tiny_model_dir, 64)
    try:
        assert launcher.engine_gpus == ["1", "4"]   # --engines defaults to the GPU count
        c, sched = launcher.engine_config.device_config, launcher.engine_config.scheduler_config
        assert (c.device, c.dtype, c.enforce_eager, c.attention_backend) == ("cuda", "float16", True, "numba")
        assert sched.max_num_batched_tokens == 8192     # the by-device default, resolved for cuda
    finally:
        shutil.rmtree(launcher.runtime)

    launcher = Launcher(_serve_args(["--device", "cpu"]), tiny_model_dir, 64)
    try:
        assert launcher.engine_gpus == [None]
        c, s = launcher.engine_config.device_config, launcher.engine_config.scheduler_config
        assert (c.device, c.dtype, c.enforce_eager, s.max_num_batched_tokens) == ("cpu", "auto", False, 512)
        assert c.cpu_threads is None  # one engine: the runner takes every core (default_num_threads)
    finally:
        shutil.rmtree(launcher.runtime)

    # several CPU engines share the cores; a flag given is kept
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(8)))
    for flags, threads in ((["--engines", "3"], 2), (["--engines", "16"], 1),
                           (["--engines", "3", "--cpu-threads", "5"], 5)):
        launcher = Launcher(_serve_args(["--device", "cpu", *flags]), tiny_model_dir, 64)
        try:
            assert launcher.engine_config.device_config.cpu_threads == threads, flags
        finally:
            shutil.rmtree(launcher.runtime)


def test_engine_config_checks_the_backend_fields():
    c = EngineConfig.create().device_config
    assert (c.device, c.dtype, c.enforce_eager, c.attention_backend) == ("auto", "auto", False, "auto")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig.create(attention_backend="flash")
    with pytest.raises(ValueError, match="device"):
        EngineConfig.create(device="gpu")
