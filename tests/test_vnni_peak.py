"""tools/vnni_peak.py: the int8 GEMM's ceiling probe compiles, gives the same sums for the same
work, runs on every core at once and prints its table; without VNNI it says so."""
from __future__ import annotations

import pytest

from ringserve.gpu.cpu.int8_kernels import has_vnni
from ringserve.tools import vnni_peak


def test_without_vnni_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr("ringserve.gpu.cpu.int8_kernels.has_vnni", lambda: False)
    assert vnni_peak.main(["--seconds", "0.01"]) == 1
    assert "no AVX-512 VNNI" in capsys.readouterr().err


@pytest.mark.skipif(not has_vnni(), reason="this CPU has no AVX-512 VNNI")
def test_the_probe_runs_on_one_thread_and_on_every_core(capsys):
    run = vnni_peak.compile_probe(12)
    assert run(10) == run(10)  # the same work, the same sums
    one, = vnni_peak.rates(run, 12, 1, 0.05)
    # the slowest CPU with VNNI (a 1 GHz core retiring one vpdpbusd every two cycles) still
    # does 32 G multiply-adds/s; the Q4_K tile reaches 130-147 on this machine's cores
    assert one > 30, one
    assert vnni_peak.main(["--seconds", "0.05"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| threads |") and len(table) == 4


@pytest.mark.skipif(not has_vnni(), reason="this CPU has no AVX-512 VNNI")
def test_each_instruction_beside_compiles_and_prints_its_row(capsys):
    """--beside: every BESIDE kind compiles into the loop (the same sums for the same work) and
    gets a row of slots; an unknown kind is refused by argparse, not compiled."""
    for kind in vnni_peak.BESIDE:
        run = vnni_peak.compile_probe(12, kind, 4)
        assert run(10) == run(10), kind
    assert vnni_peak.main(["--seconds", "0.03", "--beside", "fma", "word-shift"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("| fma |", "| word-shift |"))]
    assert len(rows) == 2 and all(len(r.split("|")) == 6 for r in rows), out
    with pytest.raises(SystemExit):
        vnni_peak.main(["--beside", "divide"])


@pytest.mark.skipif(not has_vnni(), reason="this CPU has no AVX-512 VNNI")
# (not the byte shift: its instruction is GFNI's where the CPU has it, shifts and masks elsewhere)
@pytest.mark.parametrize("kind,mnemonic", [("mulld", "vpmulld"), ("fma", "vfmadd"), ("convert", "vcvtdq2ps"),
                                           ("word-shift", "vpsrlw")])
def test_each_instruction_beside_is_the_instruction_it_names(kind, mnemonic):
    """The probe times the instruction its row names: a multiply by 3 had become two vpaddd
    (LLVM's strength reduction), and the "vpmulld" row said 0 slots where vpmulld takes one."""
    assert mnemonic in vnni_peak.compile_probe(12, kind, 4).assembly
