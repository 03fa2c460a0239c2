"""Comparing a 16-bit backend (CUDA in fp16 or bf16; its host-run forward) with the float32 CPU
backend. Random tiny models have near-ties among their top logits, which 16-bit rounding may
flip: greedy tokens are compared only where float32's best leads its runner-up clearly, and a
generation is compared only up to its first unclear choice.

The element types as the CUDA backend holds them (gpu/cuda/dtypes.py): fp16 as numpy float16,
bf16 as its bits in uint16; `narrow`, `widen` and `spacing` give each one's rounding and step.
"""
from __future__ import annotations

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cuda.dtypes import SERVING_DTYPES

CLEAR = 0.02  # a lead (over the largest |logit|, or in logprob) beyond fp16 noise
ELEMENT_TYPES = tuple(SERVING_DTYPES)  # "float16", "bfloat16"
SUFFIX = {"float16": "", "bfloat16": "_bf16"}  # the CUDA C kernels' names per element type


def narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    """Float values in the element type's storage, rounded to nearest even."""
    return a.astype(np.float16) if dtype == "float16" else to_bfloat16(np, a)


def widen(a: np.ndarray) -> np.ndarray:
    """Stored values as float32, exactly (uint16: bf16 bits)."""
    return widen_bfloat16(np, a) if a.dtype == np.uint16 else a.astype(np.float32)


def spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """The element type's step at |x| (x rounded to it first): fp16 11 significant bits, bf16 8
    (its step is float32's times 2^16)."""
    x = np.abs(np.asarray(x, np.float32))
    if dtype == "float16":
        return np.spacing(x.astype(np.float16)).astype(np.float32)
    return np.spacing(widen(narrow(x, dtype))) * np.float32(65536)


def assert_rounded_from(actual: np.ndarray, expect: np.ndarray, atol: float = 1e-5) -> None:
    """actual (stored 16-bit) is expect (float32) rounded to its element type: within one step
    of it, plus atol for float32 summation-order noise on tiny values. NaN (an unwritten
    output) fails."""
    dtype = "bfloat16" if actual.dtype == np.uint16 else "float16"
    got = widen(actual)
    tol = spacing(expect, dtype) + np.float32(atol)
    bad = ~(np.abs(got - expect) <= tol)
    assert not bad.any(), (f"{dtype}: {bad.sum()} of {bad.size} off, first at {np.argwhere(bad)[0]}: "
                           f"{got[bad][:5]} vs {expect[bad][:5]}")


# fp16 steps (ulps) a logit of the fp16 forward may be from float32's: the output rounding
# (half a step) on top of the rounding carried through the layers. Measured on an H200 (issue 25):
# 1.34 steps at most over 2,304 logits of magnitude ~20 (step 2^-6); 4 leaves room, 0.05 of the
# magnitude (assert_logits_close) would be 64 steps.
FP16_STEPS = 4


def fp16_tolerance(expect: np.ndarray, steps: int = FP16_STEPS) -> float:
    """An absolute tolerance of `steps` times fp16's spacing at expect's largest magnitude (a
    logprob's error is its logit's: the log-sum-exp is taken in float32)."""
    return steps * float(np.spacing(np.float16(np.abs(expect).max())))


def assert_logits_close(got: np.ndarray, expect: np.ndarray) -> None:
    """Close in value; the same argmax wherever expect's best leads clearly."""
    scale = np.abs(expect).max()
    np.testing.assert_allclose(got, expect, atol=0.05 * scale)
    top2 = np.sort(expect, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR * scale
    assert clear.any(), "no row with a clear best token: the check would check nothing"
    np.testing.assert_array_equal(got.argmax(-1)[clear], expect.argmax(-1)[clear])


def assert_same_generation(got: list[int], expect: list[int], leads: list[float]) -> int:
    """got == expect up to the first position whose float32 lead (best logprob minus the
    runner-up's) is unclear; returns how many positions were compared."""
    n = next((i for i, lead in enumerate(leads) if lead <= CLEAR), len(expect))
    assert got[:n] == expect[:n], f"differ before position {n}: {got} vs {expect}"
    return n


def next_batch(seqs: list[list[int]], new: list[list[int]], tables: np.ndarray,
               block_size: int) -> Batch:
    """The step computing each request's `new` tokens (the last of seqs[r]) through tables."""
    ids, pos, slots, qsl = [], [], [], [0]
    for r, seq in enumerate(seqs):
        p = np.arange(len(seq) - len(new[r]), len(seq))
        ids += new[r]
        pos += list(p)
        slots += list(tables[r, p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + len(new[r]))
    return Batch(np.array(ids, np.int32), np.array(pos, np.int32), np.array(slots, np.int32),
                 np.array(qsl, np.int32), np.array([len(s) for s in seqs], np.int32), tables)


def decode_against_cpu(cpu, host, prompts: list[list[int]], tables: np.ndarray, block_size: int,
                       steps: int, graph: bool) -> None:
    """Prefill the prompts together, then decode greedily (the CPU backend's tokens fed to
    both): every step's logits of `host` (eager; graph-shaped after the prefill when `graph`)
    as the CPU backend's."""
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for step in range(steps):
        batch = next_batch(seqs, new, tables, block_size)
        want = cpu.execute(batch)
        got = host.graph_shaped(batch) if step and graph else host.eager(batch)
        assert_logits_close(got, want)
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]
