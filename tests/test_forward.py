"""The CPU forward over the paged KV cache, on the tiny model: packing several requests into
one super-sequence, chunked prefill and decode, block tables and slots, must give each request
exactly what it gets alone and what the dense reference gives."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from reference_llama import reference_logits  # pytest puts tests/ on sys.path
from ringserve.gpu.batch import Batch
from ringserve.gpu.cpu import ops as cpu_ops
from ringserve.gpu.devices import cupy_installed
from ringserve.gpu.loader.weights import load_weights
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig

BLOCK = 4  # small blocks so that short sequences span several, with boundaries inside chunks


@dataclass
class Chunk:
    """One request's share of a step: its tokens at positions start.. and its block table."""
    tokens: list[int]
    start: int
    blocks: list[int]


def pack(chunks: list[Chunk], block_size: int = BLOCK) -> Batch:
    positions = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
    owner = np.repeat(np.arange(len(chunks)), [len(c.tokens) for c in chunks])
    width = max(len(c.blocks) for c in chunks)
    tables = np.full((len(chunks), width), -1, dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, : len(c.blocks)] = c.blocks
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    return Batch(
        input_ids=np.concatenate([c.tokens for c in chunks]).astype(np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=slots.astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum([len(c.tokens) for c in chunks])]).astype(np.int32),
        seq_lens=np.array([c.start + len(c.tokens) for c in chunks], dtype=np.int32),
        block_tables=tables,
    )


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    return load_weights(tiny_model_dir)


@pytest.fixture
def make_runner(tiny_model_dir):
    def make(num_blocks: int = 64, block_size: int = BLOCK) -> ModelRunner:
        return ModelRunner(tiny_model_dir, DeviceConfig(device="cpu"),
                           CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks))
    return make


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def blocks_for(n_tokens: int, pool: list[int]) -> list[int]:
    """Take the blocks a request of n_tokens needs from the front of pool."""
    need = -(-n_tokens // BLOCK)
    taken, pool[:] = pool[:need], pool[need:]
    return taken


def alone(make_runner, seq: list[int]) -> np.ndarray:
    """Logits at the last token of seq, prefilled alone in one step of a fresh runner."""
    runner = make_runner()
    return runner.execute(pack([Chunk(seq, 0, list(range(-(-len(seq) // BLOCK))))]))[0]


def two_steps(runner: ModelRunner, seqs: dict[str, list[int]], block_ids: list[int]):
    """Step 1: A prefills its first 10 tokens, D its 12-token prompt, E its 16-token prompt
    (ending on a block boundary). Step 2, one packed batch: B prefills from position 0,
    A prefills its later chunk over its cached first part, D and E decode one token each
    (E into a new block). Returns the logits of both steps by request."""
    pool = list(block_ids)
    table = {name: blocks_for(len(seq), pool) for name, seq in seqs.items()}
    A, B, D, E = seqs["A"], seqs["B"], seqs["D"], seqs["E"]
    step1 = runner.execute(pack([Chunk(A[:10], 0, table["A"]), Chunk(D[:12], 0, table["D"]),
                                 Chunk(E[:16], 0, table["E"])]))
    step2 = runner.execute(pack([Chunk(B, 0, table["B"]), Chunk(A[10:], 10, table["A"]),
                                 Chunk(D[12:], 12, table["D"]), Chunk(E[16:], 16, table["E"])]))
    return dict(zip("ADE", step1, strict=True)), dict(zip("BADE", step2, strict=True))


@pytest.fixture
def seqs(tiny_model_dir, make_runner):
    vocab = make_runner(num_blocks=1).config.vocab_size
    return {"A": tokens(1, 23, vocab), "B": tokens(2, 9, vocab),
            "D": tokens(3, 13, vocab), "E": tokens(4, 17, vocab)}


def test_packed_batch_matches_alone_and_dense_reference(tiny_model_dir, weights, make_runner, seqs):
    shuffled = np.random.default_rng(7).permutation(64).tolist()
    step1, step2 = two_steps(make_runner(), seqs, shuffled)

    for name, logits in step2.items():
        seq = seqs[name]
        np.testing.assert_allclose(logits, alone(make_runner, seq), rtol=0, atol=2e-5, err_msg=name)
        ref = reference_logits(tiny_model_dir, weights, seq)[-1]
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4, err_msg=name)
    for name, n in (("A", 10), ("D", 12), ("E", 16)):
        ref = reference_logits(tiny_model_dir, weights, seqs[name][:n])[-1]
        np.testing.assert_allclose(step1[name], ref, rtol=0, atol=1e-4, err_msg=name)
    # The logits are spread, so that agreement above means something.
    assert all(np.ptp(logits) > 3.0 for logits in step2.values())


def test_block_ids_do_not_matter(make_runner, seqs):
    _, in_order = two_steps(make_runner(), seqs, list(range(64)))
    scattered = np.random.default_rng(11).permutation(np.arange(1, 64, 2)).tolist()  # odd ids, shuffled
    _, shuffled = two_steps(make_runner(), seqs, scattered)
    for name in in_order:
        np.testing.assert_allclose(shuffled[name], in_order[name], rtol=0, atol=1e-6, err_msg=name)


def test_the_mlp_in_row_blocks_gives_the_step_in_one(make_runner, seqs, monkeypatch):
    """The CPU runs a step's MLP in blocks of MLP_ROWS token rows (CpuStepBuffers.mlp_rows,
    models/ops.gated_mlp); blocks that end inside a request's rows give what one block gives."""
    _, whole = two_steps(make_runner(), seqs, list(range(64)))  # (BLAS rounds by row count: 1e-5)
    monkeypatch.setattr(cpu_ops, "MLP_ROWS", 5)  # step 2's 24 rows: 5 blocks, the last of 4
    _, blocks = two_steps(make_runner(), seqs, list(range(64)))
    for name in whole:
        np.testing.assert_allclose(blocks[name], whole[name], rtol=0, atol=1e-5, err_msg=name)


def test_the_last_layer_runs_for_the_logit_rows_only(make_runner, seqs):
    """Past the last layer's attention only the rows whose logits are asked for go on
    (CpuStepBuffers.keep_output_rows): asked in any order, or twice, they are what every row's
    final hidden state gives there."""
    runner = make_runner()
    pool = list(range(64))
    A, B = seqs["A"], seqs["B"]
    batch = pack([Chunk(A, 0, blocks_for(len(A), pool)), Chunk(B, 0, blocks_for(len(B), pool))])
    rows = np.array([30, 3, 22, 3, 0])
    down_rows, linear = [], runner.ops.linear

    def counted(x, w, out):
        if w is runner.weights.layers[-1].down:
            down_rows.append(len(x))
        linear(x, w, out)
    runner.ops.linear = counted
    got = runner.execute(batch, rows)
    every = runner._hidden_states(batch)  # every row through every layer
    np.testing.assert_allclose(got, runner._logits(every, rows), rtol=0, atol=1e-5)
    assert down_rows == [4, len(A) + len(B)]
    assert np.ptp(got) > 3.0


def test_default_block_size(tiny_model_dir, weights, make_runner, seqs):
    runner = make_runner(num_blocks=8, block_size=16)
    seq = seqs["A"]
    step1 = runner.execute(pack([Chunk(seq[:17], 0, [5, 2])], block_size=16))
    step2 = runner.execute(pack([Chunk(seq[17:], 17, [5, 2])], block_size=16))
    ref = reference_logits(tiny_model_dir, weights, seq)
    np.testing.assert_allclose(step1[0], ref[16], rtol=0, atol=1e-4)
    np.testing.assert_allclose(step2[0], ref[-1], rtol=0, atol=1e-4)


def test_slot_minus_one_is_skipped(make_runner, seqs):
    runner = make_runner(num_blocks=8)
    sentinel = 7.0
    for cache in runner.kv_caches:
        cache.k.fill(sentinel)
        cache.v.fill(sentinel)
    A = seqs["A"][:6]
    # Request A (6 tokens, blocks 3 and 5) and a padding entry whose token has slot -1,
    # as CUDA-graph padding will send; its block table names block 6, which must stay intact.
    batch = pack([Chunk(A, 0, [3, 5]), Chunk([9], 0, [6])])
    batch.slot_mapping[-1] = -1
    logits = runner.execute(batch)

    written = np.zeros(8 * BLOCK, dtype=bool)
    written[batch.slot_mapping[batch.slot_mapping >= 0]] = True
    assert written.sum() == 6
    for cache in runner.kv_caches:
        for arr in (cache.k, cache.v):
            rows = arr.reshape(8 * BLOCK, -1)
            assert np.all(rows[~written] == sentinel)
            assert not np.any(rows[written] == sentinel)
    np.testing.assert_allclose(logits[0], alone(make_runner, A), rtol=0, atol=2e-5)


def test_requests_never_see_each_other(make_runner, seqs):
    vocab = make_runner(num_blocks=1).config.vocab_size
    first = two_steps(make_runner(), seqs, list(range(64)))
    changed = dict(seqs, B=tokens(20, 9, vocab), D=tokens(21, 13, vocab))
    second = two_steps(make_runner(), changed, list(range(64)))
    for step_a, step_b in zip(first, second, strict=True):
        for name in step_a:
            if name in ("B", "D"):
                assert np.abs(step_a[name] - step_b[name]).max() > 1e-2, name
            else:
                np.testing.assert_allclose(step_b[name], step_a[name], rtol=0, atol=2e-5, err_msg=name)


def test_cache_sized_from_memory_budget(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, DeviceConfig(device="cpu"),
                         CacheConfig(kv_cache_memory_bytes=1 << 20))
    c = runner.config
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 4
    assert runner.block_size == 16
    assert runner.num_blocks == (1 << 20) // per_block
    assert runner.kv_caches[0].k.shape == (runner.num_blocks, 16, c.num_key_value_heads, c.head_dim)


@pytest.mark.skipif(cupy_installed(), reason="CuPy is installed here")
def test_device_choice_without_cupy(tiny_model_dir):
    with pytest.raises(ValueError, match="needs CuPy"):
        ModelRunner(tiny_model_dir, DeviceConfig(device="cuda"))
    with pytest.raises(ValueError, match="tpu"):
        ModelRunner(tiny_model_dir, DeviceConfig(device="tpu"))
    runner = ModelRunner(tiny_model_dir, DeviceConfig(device="auto"), CacheConfig(num_gpu_blocks_override=4))
    assert runner.device == "cpu" and runner.num_blocks == 4 and not runner.asynchronous


def test_untied_lm_head(tmp_path):
    from ringserve.tools.tiny_llama import make_tiny_llama
    model_dir = make_tiny_llama(tmp_path / "untied", seed=3, tie_embeddings=False)
    runner = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                         CacheConfig(block_size=BLOCK, num_gpu_blocks_override=8))
    seq = tokens(5, 11, runner.config.vocab_size)
    logits = runner.execute(pack([Chunk(seq, 0, [4, 1, 6])]))[0]
    ref = reference_logits(model_dir, load_weights(model_dir), seq)[-1]
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4)


def test_logits_at_every_row_and_prompt_logprobs_spec(tiny_model_dir, weights, make_runner, seqs):
    """execute(batch, logits_indices) gives logits at any rows of the super-sequence, and
    submit(..., PromptLogprobsSpec) scores given tokens at given rows: both as the dense reference."""
    from ringserve.gpu.sampling.prompt_logprobs import PromptLogprobsSpec
    from ringserve.gpu.sampling.sampler import SamplingMetadata, log_softmax
    A, B = seqs["A"], seqs["B"]
    pool = list(range(64))
    ta, tb = blocks_for(len(A), pool), blocks_for(len(B), pool)
    ref_a = reference_logits(tiny_model_dir, weights, A)
    ref_b = reference_logits(tiny_model_dir, weights, B)
    # Step 1: A's first 10 tokens and all of B; every row's logits.
    runner = make_runner()
    batch = pack([Chunk(A[:10], 0, ta), Chunk(B, 0, tb)])
    every = runner.execute(batch, np.arange(batch.num_tokens))
    np.testing.assert_allclose(every, np.concatenate([ref_a[:10], ref_b]), rtol=0, atol=1e-4)
    # Step 2: A's rest; sample its last token and score A's tokens 11.. at rows 0..len-12.
    batch = pack([Chunk(A[10:], 10, ta)])
    rows = np.arange(len(A) - 11)
    spec = PromptLogprobsSpec(rows, np.asarray(A[11:], np.int32), num_top=3)
    meta = SamplingMetadata(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                            np.zeros(1, np.float32), [None])
    out = runner.submit(batch, np.array([0]), meta, spec).result()
    assert out.token_ids.tolist() == [int(ref_a[-1].argmax())]
    want = log_softmax(ref_a[10:-1].astype(np.float32))
    lps = out.prompt_logprobs
    np.testing.assert_allclose(lps.logprobs[:, 0], want[rows, A[11:]], rtol=0, atol=1e-4)
    assert lps.token_ids[:, 0].tolist() == A[11:]
    assert lps.sampled_rank.tolist() == [int((w > w[t]).sum()) + 1 for w, t in zip(want, A[11:], strict=True)]
    assert (lps.token_ids[:, 1:] == np.argsort(-want, axis=1)[:, :3]).all()


def test_prompt_logprobs_in_slices_equal_one_piece(monkeypatch):
    """host_prompt_logprobs over more rows than SLICE_ROWS: the same as one gather."""
    from ringserve.gpu.sampling import prompt_logprobs as pl
    from ringserve.gpu.sampling.sampler import gather_logprobs
    logits = np.random.default_rng(0).normal(size=(23, 50)).astype(np.float32)
    spec = pl.PromptLogprobsSpec(np.arange(23)[::-1].copy(), np.arange(23, dtype=np.int32), 4)
    monkeypatch.setattr(pl, "SLICE_ROWS", 5)
    got = pl.host_prompt_logprobs(lambda r: logits[r], spec)
    whole = gather_logprobs(logits[spec.rows], spec.token_ids, 4)
    for name in ("token_ids", "logprobs", "sampled_rank"):
        np.testing.assert_array_equal(getattr(got, name), getattr(whole, name))
