"""The CUDA runner's host-side logic, on the CPU: graph ladder, padding, graph bookkeeping,
KV pool sizing, attention splits."""
from __future__ import annotations

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.cuda import plan
from ringserve.gpu.cuda import reference as ref
from ringserve.gpu.cuda.buffers import AttentionLaunch


def decode_batch(seq_lens, block_size=4, width=3, seed=0):
    rng = np.random.default_rng(seed)
    n = len(seq_lens)
    tables = rng.permutation(64)[:n * width].reshape(n, width).astype(np.int32)
    pos = np.array(seq_lens, np.int32) - 1
    return Batch(input_ids=rng.integers(0, 50, n).astype(np.int32), positions=pos,
                 slot_mapping=(tables[np.arange(n), pos // block_size] * block_size
                               + pos % block_size).astype(np.int32),
                 query_start_loc=np.arange(n + 1, dtype=np.int32),
                 seq_lens=np.array(seq_lens, np.int32), block_tables=tables)


def test_ladder():
    assert plan.graph_batch_sizes(1) == [1]
    assert plan.graph_batch_sizes(3) == [1, 2, 3]
    assert plan.graph_batch_sizes(8) == [1, 2, 4, 8]
    assert plan.graph_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert plan.graph_batch_sizes(256)[-3:] == [240, 248, 256]
    assert plan.graph_batch_sizes(10_000)[-1] == plan.MAX_CAPTURED_BATCH
    with pytest.raises(ValueError):
        plan.graph_batch_sizes(0)


def test_padded_size():
    sizes = plan.graph_batch_sizes(64)
    assert [plan.padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert plan.padded_size(65, sizes) is None


def test_padding_leaves_real_rows_alone_and_writes_nothing():
    """Attention over a padded batch equals attention over the real one, row for row, with
    the graph's device table holding stale blocks everywhere but the real rows' corner."""
    rng = np.random.default_rng(1)
    b = decode_batch([5, 9, 2])
    p = plan.pad_decode(b, 8, max_blocks=4)
    assert p.num_real == 3 and np.all(p.slot_mapping[3:] == -1) and np.all(p.seq_lens[3:] == 0)
    device_table = rng.integers(0, 64, (8, 4)).astype(np.int32)  # what earlier steps left
    device_table[:3, :p.block_tables.shape[1]] = p.block_tables
    assert_padding_changes_nothing(b, p, device_table, rng)


def test_pad_rejects_prefill_and_overflow():
    b = decode_batch([5, 9])
    prefill = Batch(b.input_ids[:2], np.array([0, 1], np.int32), b.slot_mapping[:2],
                    np.array([0, 2], np.int32), np.array([2], np.int32), b.block_tables[:1])
    with pytest.raises(ValueError):
        plan.pad_decode(prefill, 2, 4)
    with pytest.raises(ValueError):
        plan.pad_decode(b, 1, 4)
    with pytest.raises(ValueError):
        plan.pad_decode(b, 2, 2)  # 3 blocks per request, graph has room for 2


def test_graph_table_picks_captured_sizes_for_decode_only():
    t = plan.GraphTable(plan.graph_batch_sizes(16))
    assert t.pick(decode_batch([3])) is None  # nothing captured (eager, --enforce-eager)
    t.add(1, "g1", 0.1)
    t.add(4, "g4", 0.1)
    assert t.pick(decode_batch([3])) == 1
    assert t.pick(decode_batch([3, 4, 5])) == 4
    assert t.pick(decode_batch([3] * 5)) is None  # size 8 not captured
    b = decode_batch([3, 4])
    prefill = Batch(np.zeros(3, np.int32), np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32),
                    np.array([0, 3], np.int32), np.array([3], np.int32), b.block_tables[:1])
    assert t.pick(prefill) is None
    with pytest.raises(ValueError):
        t.add(3, "g3", 0.1)


def verify_batch(seq_lens, drafts, block_size=4, width=3, seed=0):
    """Requests whose last 1 + k tokens (k = drafts[r]) are computed, logits at all of them."""
    rng = np.random.default_rng(seed)
    n = len(seq_lens)
    tables = rng.permutation(64)[:n * width].reshape(n, width).astype(np.int32)
    counts = 1 + np.array(drafts, np.int32)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    req = np.repeat(np.arange(n), counts)
    pos = (np.array(seq_lens)[req] - counts[req] + np.arange(qsl[-1]) - qsl[req]).astype(np.int32)
    return Batch(rng.integers(0, 50, qsl[-1]).astype(np.int32), pos,
                 (tables[req, pos // block_size] * block_size + pos % block_size).astype(np.int32), qsl,
                 np.array(seq_lens, np.int32), tables, sample_indices=np.arange(qsl[-1], dtype=np.int32))


def test_a_verify_step_padded_to_its_graph_computes_its_rows_as_eager():
    """Speculative decoding's verify graphs (K = 3): size n holds n requests of up to 4 tokens
    in n x 4 tokens and rows of logits and n + 1 request slots. Padded, the first padded
    request owns every padding token and has no keys: attention over the padded step equals
    the real one's row for row (the device table stale past the real rows), nothing more is
    written, and the rows of logits are the step's, then row 0 again."""
    t = plan.GraphTable(plan.verify_batch_sizes(256, 8), 4)
    assert t.sizes == [1, 2, 4, 8] and t.shape(4) == (16, 5, 16)
    b = verify_batch([9, 6, 3], [3, 0, 2])  # 8 tokens of 3 requests: size 4 (the decode table takes none)
    assert t.fit(b) == 4 and plan.GraphTable([1, 2, 4, 8]).fit(b) is None
    p = t.pad(b, 4, max_blocks=3)
    assert list(p.query_start_loc) == [0, 4, 5, 8, 16, 16] and list(p.seq_lens) == [9, 6, 3, 0, 0]
    assert np.all(p.slot_mapping[8:] == -1) and list(p.logits_indices) == list(range(8)) + [0] * 8
    rng = np.random.default_rng(2)
    device_table = rng.integers(0, 64, (5, 3)).astype(np.int32)  # what earlier steps left
    device_table[:3] = b.block_tables
    assert_padding_changes_nothing(b, p, device_table, rng)


def test_verify_graphs_fit_and_refuse():
    t = plan.GraphTable([1, 2, 4], 4)
    assert t.fit(verify_batch([5], [3])) == 1            # 4 tokens in 4, a padding slot to spare
    assert t.fit(verify_batch([5, 5], [3, 0])) == 2      # 5 tokens: over size 1's 4
    assert t.fit(verify_batch([5, 5], [3, 3])) == 2      # exactly full
    assert t.fit(verify_batch([9] * 3, [3, 3, 3])) == 4
    assert t.fit(verify_batch([9] * 5, [1] * 5)) is None  # 5 requests: over the ladder
    assert t.pick(verify_batch([5], [3])) is None         # nothing captured: eager
    t.add(2, "g2", 0.1)
    assert t.pick(verify_batch([5], [3])) is None         # size 1 not captured
    assert t.pick(verify_batch([5, 5], [3, 0])) == 2
    with pytest.raises(ValueError):
        t.pad(verify_batch([9] * 3, [3, 3, 3]), 2, max_blocks=3)  # 12 tokens into 8
    with pytest.raises(ValueError):
        t.pad(verify_batch([5, 5], [3, 0]), 2, max_blocks=2)      # 3 blocks a request, room for 2
    with pytest.raises(ValueError):
        plan.pad_step(decode_batch([3, 4]), (4, 2, 4), max_blocks=3)  # padding without a request to own it
    with pytest.raises(ValueError):
        plan.GraphTable([1], 0)
    assert plan.shared_shape([plan.GraphTable([1, 2, 4, 8]), t]) == (16, 8, 16)  # verify 4: 16 tokens
    assert plan.verify_batch_sizes(4, 8) == [1, 2, 4] and plan.verify_batch_sizes(64, 10) == [1, 2, 4, 8, 16]


def test_kv_pool_sizing():
    per_block = plan.kv_bytes_per_block(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64,
                                        itemsize=2)
    assert per_block == 2 * 16 * 16 * 8 * 64 * 2 == 524288
    gib = 2**30
    n = plan.num_kv_blocks(total_bytes=141 * gib, used_bytes_after_profile=5 * gib,
                           bytes_per_block=per_block, gpu_memory_utilization=0.9)
    assert n == (int(141 * gib * 0.9) - 5 * gib) // per_block
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        plan.num_kv_blocks(total_bytes=8 * gib, used_bytes_after_profile=8 * gib,
                           bytes_per_block=per_block, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError):
        plan.num_kv_blocks(total_bytes=8 * gib, used_bytes_after_profile=0,
                           bytes_per_block=per_block, gpu_memory_utilization=1.5)


def test_attention_splits():
    # Prefill or big decode batches fill the GPU: no split.
    assert plan.attention_splits(num_tokens=512, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1
    # Short contexts: no split.
    assert plan.attention_splits(num_tokens=1, num_kv_heads=8, max_seq_len=500, num_sms=132) == 1
    # Batch 1, 8 KV heads, 32k context: enough splits for two waves, capped.
    assert plan.attention_splits(num_tokens=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 16
    assert plan.attention_splits(num_tokens=4, num_kv_heads=8, max_seq_len=2048, num_sms=132) == 4


def test_a_sliding_window_is_split_for_its_own_keys():
    """A windowed layer reads at most `window` keys: split from the window, not max_model_len
    (32k context, batch 1: 16 splits for full attention, 2 for a 1k window, none for 512)."""
    shape = dict(num_tokens=1, num_kv_heads=8, max_seq_len=32768, num_sms=132)
    assert plan.attention_splits(**shape) == 16
    assert plan.window_splits((0, 1024, 0, 512, 1024), **shape) == {512: 1, 1024: 2}
    assert plan.window_splits((0, 0), **shape) == {}
    # a window past the context: the context's count
    assert plan.window_splits((65536,), **shape) == {65536: 16}
    launch = AttentionLaunch(16, (None, None, None), window_splits={1024: 2})
    assert (launch.splits_for(0), launch.splits_for(1024), launch.splits_for(4096)) == (16, 2, 16)


def assert_padding_changes_nothing(b: Batch, p: Batch, device_table: np.ndarray, rng) -> None:
    """The padded step p of batch b, over the graph's device table (stale past b's rows), stores
    the same K/V (padding slots -1 write nothing) and gives b's attention on its real tokens;
    padding tokens attend to nothing."""
    n, total = len(b.slot_mapping), len(p.slot_mapping)
    H, KVH, D = 2, 1, 4
    qkv = rng.standard_normal((total, (H + 2 * KVH) * D)).astype(np.float32)
    k = rng.standard_normal((64, 4, KVH, D)).astype(np.float32)
    v = rng.standard_normal((64, 4, KVH, D)).astype(np.float32)
    k2, v2 = k.copy(), v.copy()
    ref.store_kv(qkv[:n], b.slot_mapping, k, v, H)
    ref.store_kv(qkv, p.slot_mapping, k2, v2, H)
    np.testing.assert_array_equal(k, k2)
    real = ref.paged_attention(qkv[:n], k, v, b.positions, b.query_start_loc, b.seq_lens,
                               b.block_tables, H, 0.5)
    padded = ref.paged_attention(qkv, k2, v2, p.positions, p.query_start_loc, p.seq_lens,
                                 device_table, H, 0.5)
    np.testing.assert_array_equal(padded[:n], real)
    assert np.all(padded[n:] == 0)
