"""On a CUDA device (skipped without one): nothing a captured graph points at can be freed
(issue 25 item 3). The graphs are captured, CuPy's pools are emptied (what CuPy itself does
before it retries an allocation that ran out of memory), fresh allocations of many sizes are
filled with garbage on the runner's own stream (so that they take whatever the pools or the
driver got back), and the graphs replay: the logits must be the eager runner's, and the
garbage untouched. A buffer a graph points at but nobody holds would show up as a replay
reading garbage, writing into the garbage, or touching unmapped memory (an illegal address).
The same rule checked without a GPU, launch by launch: tests/test_cuda_graph_memory.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits
from test_gpu_cuda import _has_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_device(), reason="no CUDA device")]
CACHE = CacheConfig(num_gpu_blocks_override=64)
LIMITS = StepLimits(max_num_seqs=8, max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS, max_model_len=2048)
GARBAGE = 0xFF  # every byte: NaN as fp16 and as float32


def garbage_allocations(cp) -> list:
    """Arrays of many sizes (512 B steps up to 64 KiB, then powers of two up to 64 MiB, four
    of each: about 0.5 GiB), every byte GARBAGE, allocated on the current stream."""
    sizes = [512 * k for k in range(1, 129)] + [1 << e for e in range(17, 27)]
    return [cp.full(n, GARBAGE, cp.uint8) for n in sizes for _ in range(4)]


def test_graphs_replay_the_eager_result_after_the_pools_are_emptied_and_refilled(tiny_cuda_models):
    import cupy as cp

    from fp16_checks import next_batch
    from ringserve.gpu.cuda import plan
    from ringserve.gpu.cuda.runner import CudaModelRunner

    model = tiny_cuda_models("tied-g3")
    graphs = CudaModelRunner.from_dir(model, DeviceConfig(device="cuda"), CACHE, LIMITS)
    assert sorted(graphs.graphs.graphs) == graphs.graphs.sizes, graphs.capture_failures
    c = graphs.config
    # three requests replay the size-4 graph, whose attention splits its keys: its workspace
    # is one of the buffers under test
    assert plan.attention_splits(num_tokens=4, num_kv_heads=c.num_key_value_heads,
                                 max_seq_len=LIMITS.max_model_len, num_sms=graphs.num_sms) > 1
    eager = CudaModelRunner.from_dir(model, DeviceConfig(device="cuda", enforce_eager=True), CACHE, LIMITS)
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1, 17, 17, 17, 17, 17, 40, 41, 42]]
    blocks = CACHE.num_gpu_blocks_override
    tables = np.random.default_rng(0).permutation(blocks)[:3 * 8].reshape(3, 8).astype(np.int32)
    decodes = np.random.default_rng(1).integers(1, c.vocab_size, (6, 3)).tolist()  # fixed tokens

    def steps():
        """The prefill, then one batch per decode step (each request's next fixed token)."""
        seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
        yield next_batch(seqs, new, tables, 16)
        for tokens in decodes:
            for seq, token in zip(seqs, tokens, strict=True):
                seq.append(token)
            new = [[t] for t in tokens]
            yield next_batch(seqs, new, tables, 16)

    prefill, *decode_batches = steps()
    want = [eager.execute(b) for b in (prefill, *decode_batches)][1:]
    graphs.execute(prefill)  # eager in both (not decode-only); a replay allocates nothing
    assert all(graphs.graphs.pick(b) == 4 for b in decode_batches)
    cp.cuda.Device().synchronize()
    garbage = []
    try:
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        with graphs.stream:  # NOTE: CuPy's pool keeps free blocks per stream: the runner's too
            garbage = garbage_allocations(cp)
        cp.cuda.Device().synchronize()
        for batch, expect in zip(decode_batches, want, strict=True):
            got = graphs.execute(batch)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, expect, atol=1e-2 * np.abs(expect).max())
        touched = [a.nbytes for a in garbage if int(cp.count_nonzero(a != GARBAGE))]
        assert not touched, f"a replay wrote into {len(touched)} garbage arrays of sizes {touched[:10]}"
    finally:
        del garbage
        cp.get_default_memory_pool().free_all_blocks()
