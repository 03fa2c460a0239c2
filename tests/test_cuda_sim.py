"""Numba CUDA kernels in Numba's CUDA simulator vs their numpy references (docs/design.md §8.2).

The simulator must be switched on before numba is first imported, so these tests run in a
pytest process of their own: in the main run, the one test below launches this file again
with NUMBA_ENABLE_CUDASIM=1 (with tests/test_cuda_sampler.py's, in one process: conftest.py
simulator_tests). The simulator runs a Python thread per CUDA thread, each barrier a round
of thread switches: 32-thread blocks and tiny sizes.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.sim
IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
THREADS = 32

if not IN_SIMULATOR:
    def test_simulator_tests_pass_in_their_own_process(simulator_tests):
        simulator_tests(__file__)

else:
    from numba import config as numba_config
    from numba import cuda

    from paged_cases import free_before_windows, paged_layout
    from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
    from ringserve.gpu.cuda import numba_kernels as nk
    from ringserve.gpu.cuda import reference as ref

    assert numba_config.ENABLE_CUDASIM  # the kernels below run in the simulator, not on a device

    def paged_case(rng, *, num_heads=4, kvh=2, d=16, block_size=4, num_blocks=24, bf16=False):
        """Two prefill chunks (one with a cached prefix) and two decodes, shuffled blocks.
        bf16: the arrays hold bf16 bits (uint16), as the runner's in bfloat16."""
        layout = paged_layout(rng, [(0, 5), (6, 3), (9, 1), (2, 1)],  # (cached, new tokens)
                              block_size=block_size, num_blocks=num_blocks)
        positions = layout["positions"]
        T = len(positions)
        store = (lambda a: to_bfloat16(np, a)) if bf16 else (lambda a: a.astype(np.float16))
        qkv = store(rng.standard_normal((T, (num_heads + 2 * kvh) * d)))
        k_cache = store(rng.standard_normal((num_blocks, block_size, kvh, d)))
        v_cache = store(rng.standard_normal((num_blocks, block_size, kvh, d)))
        return dict(qkv=qkv, k_cache=k_cache, v_cache=v_cache, positions=positions,
                    query_start_loc=layout["query_start_loc"], seq_lens=layout["seq_lens"],
                    block_tables=layout["block_tables"], slots=layout["slots"], num_heads=num_heads)

    def test_embedding():
        rng = np.random.default_rng(0)
        table = rng.standard_normal((50, 40)).astype(np.float16)
        ids = np.array([3, 0, 49, 3], np.int32)
        out = np.zeros((4, 40), np.float16)
        nk.embedding(ids, table, out, threads=THREADS)
        np.testing.assert_array_equal(out, ref.embedding(ids, table))

    def test_embedding_of_a_bf16_table_widens_it_exactly():
        rng = np.random.default_rng(0)
        table = to_bfloat16(np, rng.standard_normal((50, 40)))
        ids = np.array([3, 0, 49, 3], np.int32)
        out = np.zeros((4, 40), np.float32)  # the residual stream
        nk.embedding(ids, table, out, threads=THREADS)
        np.testing.assert_array_equal(out, widen_bfloat16(np, table[ids]))

    def test_gather_rows_and_argmax():
        rng = np.random.default_rng(2)
        x = rng.standard_normal((7, 70)).astype(np.float32)
        x[2, 5] = x[2, 60] = 100.0  # a tie: the first index wins
        idx = np.array([6, 2, 0], np.int32)
        rows = np.zeros((3, 70), np.float32)
        nk.gather_rows(x, idx, rows, threads=THREADS)
        np.testing.assert_array_equal(rows, ref.gather_rows(x, idx))
        out = np.zeros(3, np.int32)
        nk.argmax(rows, out, threads=THREADS)
        np.testing.assert_array_equal(out, ref.argmax_rows(rows))
        assert out[1] == 5

    def test_gather_rows_moves_bf16_bits():
        x = np.arange(7 * 70, dtype=np.uint16).reshape(7, 70) * np.uint16(131)
        idx = np.array([6, 2, 0], np.int32)
        rows = np.zeros((3, 70), np.uint16)
        nk.gather_rows(x, idx, rows, threads=THREADS)
        np.testing.assert_array_equal(rows, x[idx])

    @cuda.jit
    def convert_kernel(bits, widened, floats, narrowed):  # pragma: no cover - device code
        for i in range(cuda.threadIdx.x, bits.shape[0], cuda.blockDim.x):
            widened[i] = nk.bf16_to_float32(bits[i])
        for i in range(cuda.threadIdx.x, floats.shape[0], cuda.blockDim.x):
            narrowed[i] = nk.float32_to_bf16(floats[i])

    def test_bf16_conversions_are_exact_and_round_to_nearest_even():
        """Every bf16 bit pattern widens to its float32 (NaN to a NaN); float32 values (random
        magnitudes 1e-40..1e38, every bf16 value, and each one's halfway point to the next:
        the ties) narrow as torch rounds."""
        bits = np.arange(1 << 16, dtype=np.uint16)
        exact = widen_bfloat16(np, bits)
        finite = exact[np.isfinite(exact)]
        halfway = (finite.view(np.uint32) + np.uint32(0x8000)).view(np.float32)
        rng = np.random.default_rng(9)
        scaled = rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 38, 2000)
        floats = np.concatenate([finite, halfway[np.isfinite(halfway)], scaled.astype(np.float32)])
        widened = np.zeros(len(bits), np.float32)
        narrowed = np.zeros(len(floats), np.uint16)
        # NOTE: one simulated thread: the conversions are per element, and 32 threads calling
        # another module's device functions contend for the simulator's module-swap lock (a CI
        # run stalled there for minutes)
        convert_kernel[1, 1](bits, widened, floats, narrowed)
        nan = np.isnan(exact)
        np.testing.assert_array_equal(widened[~nan], exact[~nan])
        assert np.isnan(widened[nan]).all()
        np.testing.assert_array_equal(narrowed, to_bfloat16(np, floats))

    @pytest.mark.parametrize("threads", [8, THREADS])
    def test_paged_attention_matches_reference(threads):
        c = paged_case(np.random.default_rng(3))
        ref.store_kv(c["qkv"], c["slots"], c["k_cache"], c["v_cache"], c["num_heads"])
        out = np.zeros((len(c["positions"]), c["num_heads"] * 16), np.float32)
        args = (c["qkv"], c["k_cache"], c["v_cache"], c["positions"], c["query_start_loc"],
                c["seq_lens"], c["block_tables"])
        nk.paged_attention(*args, 0.25, out, threads=threads)
        expect = ref.paged_attention(*args, c["num_heads"], 0.25)
        np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("window", [1, 6])
    def test_paged_attention_sliding_window(window):
        """Keys p - window < k <= p only, and no block wholly before a request's window read:
        those table entries name a spare block of NaN (a read, even at weight 0, shows)."""
        c = paged_case(np.random.default_rng(5))
        ref.store_kv(c["qkv"], c["slots"], c["k_cache"], c["v_cache"], c["num_heads"])
        args = (c["qkv"], c["k_cache"], c["v_cache"], c["positions"], c["query_start_loc"],
                c["seq_lens"], c["block_tables"])
        expect = ref.paged_attention(*args, c["num_heads"], 0.25, window)
        assert not np.allclose(expect, ref.paged_attention(*args, c["num_heads"], 0.25))
        spare = np.setdiff1d(np.arange(len(c["k_cache"])), c["block_tables"])[0]
        c["k_cache"][spare] = c["v_cache"][spare] = np.nan
        tables = free_before_windows(c["block_tables"], [(0, 5), (6, 3), (9, 1), (2, 1)], block_size=4,
                                     window=window, null=spare)
        assert (tables == spare).any()
        out = np.zeros((len(c["positions"]), c["num_heads"] * 16), np.float32)
        nk.paged_attention(*args[:6], tables, 0.25, out, window=window, threads=THREADS)
        np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-4)

    def test_paged_attention_in_bf16():
        """bf16 q and cache (uint16 bits) into a bf16 out: the float32 result rounded once."""
        c = paged_case(np.random.default_rng(3), bf16=True)
        ref.store_kv(c["qkv"], c["slots"], c["k_cache"], c["v_cache"], c["num_heads"])
        out = np.full((len(c["positions"]), c["num_heads"] * 16), 0xFFFF, np.uint16)
        args = (c["qkv"], c["k_cache"], c["v_cache"], c["positions"], c["query_start_loc"],
                c["seq_lens"], c["block_tables"])
        nk.paged_attention(*args, 0.25, out, threads=THREADS)
        wide = tuple(widen_bfloat16(np, a) for a in args[:3])
        expect = ref.paged_attention(*wide, *args[3:], c["num_heads"], 0.25)
        step = np.spacing(np.abs(expect)) * np.float32(65536)  # bf16's step (float32's x 2^16)
        assert np.all(np.abs(widen_bfloat16(np, out) - expect) <= step + 1e-5)

    def test_paged_attention_padding_request_gets_zeros():
        c = paged_case(np.random.default_rng(4))
        seq_lens = c["seq_lens"].copy()
        seq_lens[3] = 0  # a padded decode row (CUDA graph padding): no keys
        out = np.full((len(c["positions"]), c["num_heads"] * 16), 7.0, np.float32)
        nk.paged_attention(c["qkv"], c["k_cache"], c["v_cache"], c["positions"],
                           c["query_start_loc"], seq_lens, c["block_tables"], 0.25, out,
                           threads=THREADS)
        assert np.all(out[-1] == 0) and np.all(np.isfinite(out))
