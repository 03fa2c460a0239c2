"""tools/gpu_check.py on a machine without a CUDA device: a clear message and exit code 1."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ringserve.tools.gpu_check import config_for, cuda_device_name, SHAPES


@pytest.mark.skipif(cuda_device_name() is not None, reason="this machine has a CUDA device")
def test_without_a_device_it_says_so_and_exits_1(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ringserve.tools.gpu_check", "--json",
                           str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_benchmark_shapes_are_the_1b_and_8b_llamas():
    def params(c):
        layer = c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size) + 3 * c.hidden_size * c.intermediate_size
        return c.num_hidden_layers * layer + 2 * c.vocab_size * c.hidden_size
    assert 1.0e9 < params(config_for(SHAPES["1B"])) < 1.6e9
    assert 7.5e9 < params(config_for(SHAPES["8B"])) < 8.5e9


def test_budget_times_phases_and_skips_what_does_not_fit():
    from ringserve.tools.gpu_check import Budget
    now = [0.0]

    def clock():
        return now[0]

    def phase(seconds, value):
        def fn():
            now[0] += seconds
            return value
        return fn

    b = Budget(100, clock=clock)
    assert b.run("a", 30, phase(40, "A")) == "A"
    assert b.run("b", 70, phase(1, "B")) is None          # 60 s left, needs ~70
    assert b.run("c", 50, phase(65, "C")) == "C"          # fits its estimate, overruns it
    assert b.run("d", 1, phase(1, "D")) is None           # past the deadline
    assert b.phases == {"a": 40, "c": 65}
    assert [m.split(":")[0] for m in b.skipped] == ["b", "d"]
    assert "needs ~70 s" in b.skipped[0]
