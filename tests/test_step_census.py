"""The launch census (gpu/cuda/census.py, tools/step_census.py) against the launches the CUDA
forward really makes: tests/test_cuda_forward_host.py's HostOps runs a graph-shaped decode of a
tiny Llama through the host-compiled kernels, every launch recorded, and the census of the same
shape must list the same launches in the same order (CUDA C kernels by name, grid and block;
the GEMMs and the Numba row gathers, whose stand-ins run on the host, by op)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.cuda.census import census_for, decode_census
from ringserve.gpu.loader.weights import expected_shapes
from ringserve.tools import step_census
from test_cuda_forward_host import BLOCK_SIZE, MAX_MODEL_LEN, SPEC_TOKENS, HostRunner

STAND_INS = ("linear", "embedding", "gather_rows")  # cuBLAS and Numba on a GPU, numpy here


def recorded_decode(host: HostRunner, batch: Batch) -> list[tuple]:
    """host's graph-shaped decode of batch, each launch as (kernel, grid, block) for the CUDA C
    kernels (padded to 3 dims, as the host launcher takes them), (op,) for a stand-in."""
    seen: list[tuple] = []
    for kernels in (host.ops.fused, host.ops.paged):
        def call(kernel, geometry, *args, _call=kernels.call):
            seen.append((kernel, *geometry))
            return _call(kernel, geometry, *args)
        kernels.call = call
    for op in STAND_INS:
        setattr(host.ops, op, _recorded(seen, op, getattr(host.ops, op)))
    host.graph_shaped(batch)
    return seen


def _recorded(seen: list[tuple], op: str, run):
    def recorded(*args):
        seen.append((op,))
        return run(*args)
    return recorded


@pytest.mark.sim
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_the_census_lists_the_launches_the_host_forward_makes(tiny_cuda_models, cuda_host, dtype):
    """3 requests of 40 keys padded to the graph size 4 with split-K (the host runner's 16
    "SMs"): every launch, in order, with its geometry; fp16 and bf16 (the _bf16 kernels)."""
    host = HostRunner(tiny_cuda_models("untied-g2"), cuda_host, dtype=dtype)
    tables = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    pos = np.full(3, 39, np.int32)
    batch = Batch(np.array([5, 6, 7], np.int32), pos, tables[:, 2] * BLOCK_SIZE + 39 % BLOCK_SIZE,
                  np.arange(4, dtype=np.int32), pos + 1, tables)
    got = recorded_decode(host, batch)
    splits = host.splits(4, MAX_MODEL_LEN)
    assert splits > 1
    census = decode_census(host.config, batch=4, context=40, splits=splits, dtype=host.dtype)
    want = [(r.op,) if r.op in STAND_INS else (r.launch.kernel, *r.launch.geometry) for r in census.rows]
    assert got == want
    suffix = "_bf16" if dtype == "bfloat16" else ""
    # a decode: RoPE, the K/V write and split-K attention in one launch (no rope_store_kv)
    assert any(k[0] == "paged_attention_rope" + suffix and k[1][2] == splits for k in got)
    assert not any(k[0].startswith("rope_store_kv") for k in got)
    layers = host.config.num_hidden_layers
    assert census.per_layer * layers + 5 == len(census.rows)  # embedding, norm | gather, lm_head, widen


@pytest.mark.sim
def test_the_census_lists_the_launches_of_a_verify_step(tiny_cuda_models, cuda_host):
    """Speculative decoding's verify step (K = 3): 3 requests of 40 keys computing 4, 2 and 1
    tokens (3, 1 and 0 drafts), logits at all 7, padded to the verify graph of 4 requests (16
    tokens and rows, 5 request slots): the census with speculative_tokens lists the launches the
    host forward makes, in order, its lm_head and widening over the 16 rows."""
    host = HostRunner(tiny_cuda_models("untied-g2"), cuda_host)
    tables = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    counts = np.array([4, 2, 1])
    req = np.repeat(np.arange(3), counts)
    pos = (40 - counts[req] + np.arange(7) - np.array([0, 4, 6])[req]).astype(np.int32)
    batch = Batch(np.arange(5, 12, dtype=np.int32), pos,
                  (tables[req, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).astype(np.int32),
                  np.array([0, 4, 6, 7], np.int32), np.full(3, 40, np.int32), tables,
                  sample_indices=np.arange(7, dtype=np.int32))
    assert host.verify.fit(batch) == 4 and host.verify.query_len == 1 + SPEC_TOKENS
    got = recorded_decode(host, batch)
    splits = host.splits(16, MAX_MODEL_LEN)
    census = decode_census(host.config, batch=4, context=40, splits=splits, dtype=host.dtype,
                           speculative_tokens=SPEC_TOKENS)
    want = [(r.op,) if r.op in STAND_INS else (r.launch.kernel, *r.launch.geometry) for r in census.rows]
    assert got == want and census.num_tokens == 16
    gathers = [r.launch.grid for r in census.rows if r.op in ("embedding", "gather_rows")]
    assert gathers == [(16,), (16,)]  # one block a token, then one a row of logits


def test_the_8b_census_reads_every_weight_once_and_names_its_floor(capsys):
    """Llama-3-8B at batch 1: every weight read once but the embedding (one row), the KV of 511
    cached keys a layer read (the step's own k/v come from the QKV output and are written once),
    8 launches a layer (4 GEMMs, two add + norms, SiLU·mul, split-K attention with RoPE and the
    K/V write, combined in its own launch), and the floor line at 4268 GB/s."""
    assert step_census.main(["--shape", "8B", "--batch", "1", "--context", "512"]) == 0
    out = capsys.readouterr().out
    c = step_census.config_for("8B")
    census = census_for(c, batch=1, context=512, dtype="float16", max_model_len=2048, num_sms=132)
    total = census.total()
    params = sum(int(np.prod(s)) for s in expected_shapes(c).values())
    assert total.weights == 2 * (params - (c.vocab_size - 1) * c.hidden_size)
    row = c.num_key_value_heads * c.head_dim * 2  # one token's k (or v) of one layer
    assert total.kv_read == c.num_hidden_layers * 2 * 511 * row
    assert total.kv_written == c.num_hidden_layers * 2 * row
    assert census.per_layer == 8 and census.splits > 1
    gb = total.total / 1e9
    assert out.rstrip().endswith(f"launches per layer: 8; bytes per step: {gb:.3f} GB; "
                                 f"floor at 4268 GB/s: {total.total / 4268e9 * 1e3:.3f} ms")
    # batch 64 fills the SMs: no split, no partials
    wide = census_for(c, batch=64, context=512, dtype="bfloat16", max_model_len=2048, num_sms=132)
    assert wide.per_layer == 8 and wide.splits == 1 and wide.partial_bytes == 0 < census.partial_bytes


def test_the_cli_shows_a_verify_step(capsys):
    """--speculative-tokens 3: the 8B verify step at batch 1 (4 tokens): the same weights read
    once (and 3 more embedding rows), each of the 4 tokens reading its request's keys, the
    lm_head over 4 rows."""
    assert step_census.main(["--shape", "8B", "--batch", "1", "--speculative-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "batch 1 verifying 3 drafts each (4 tokens), context 512" in out.splitlines()[0]
    c = step_census.config_for("8B")
    decode = census_for(c, batch=1, context=512, dtype="float16", max_model_len=2048, num_sms=132)
    verify = census_for(c, batch=1, context=512, dtype="float16", max_model_len=2048, num_sms=132,
                        speculative_tokens=3)
    assert verify.total().weights == decode.total().weights + 3 * c.hidden_size * 2
    # the fused decode reads its own K/V from qkv, not the cache; each verify token reads them all
    kv_row = 2 * c.num_key_value_heads * c.head_dim * 2
    assert verify.total().kv_read == 4 * (decode.total().kv_read + c.num_hidden_layers * kv_row)
    assert [r.launch.grid for r in verify.rows if r.op == "gather_rows"] == [(4,)]


def test_the_q4_k_m_census_lists_quant_launches_and_their_packed_bytes(capsys):
    """--format q4_k_m: the 8B's linears as quant.cu's launches of the crossover table (batch 1:
    the mat-vec, Q4_K u4 and Q6_K u6 parts of a split QKV each their own; batch 16: the tiled
    GEMM), each listing the bytes its planes hold: QuantStore's upload of real GGUF blocks of
    each type (0.594 and 0.828 bytes a weight), not fp16's 2."""
    from ringserve.gpu.cuda.quant_linear import QuantStore
    from ringserve.gpu.loader.quant import random_raw
    from ringserve.gpu.loader.weights import GGMLTensor
    from ringserve.tools.gpu_check import quant_type
    assert step_census.main(["--shape", "8B", "--batch", "1", "--format", "q4_k_m"]) == 0
    assert "matvec_u6_r1" in capsys.readouterr().out
    c = step_census.config_for("8B")
    rng = np.random.default_rng(0)
    per_weight = {t: QuantStore(np).packed([GGMLTensor(t, (16, 512), random_raw(t, (16, 512), rng))]).nbytes
                  / (16 * 512) for t in ("Q4_K", "Q6_K")}
    assert per_weight == {"Q4_K": 0.59375, "Q6_K": 0.828125}
    packed = step_census.packed_format("Q4_K_M", c)
    census = census_for(c, batch=1, context=512, dtype="float16", max_model_len=2048, num_sms=132,
                        packed=packed)
    want = 0
    for name, shape in expected_shapes(c).items():
        parts = name.split(".")
        if len(parts) > 4 and parts[3] in ("self_attn", "mlp"):
            qtype = quant_type("Q4_K_M", ".".join(parts[3:5]), int(parts[2]), c.num_hidden_layers)
            want += per_weight[qtype] * shape[0] * shape[1]
    linears = [r for r in census.rows if r.op == "linear" and r.layer is not None]
    assert sum(r.traffic.weights for r in linears) == want
    assert {r.launch.kernel for r in linears} == {"matvec_u4_r1", "matvec_u6_r1"}
    assert census.per_layer == 9  # layer 0's QKV: Q4_K q/k and Q6_K v, two launches
    wide = census_for(c, batch=16, context=512, dtype="float16", max_model_len=2048, num_sms=132,
                      packed=packed)
    assert {r.launch.kernel for r in wide.rows if r.op == "linear"} == {"gemm_u4", "gemm_u6"}
    assert [r.launch.kernel for r in census.rows if r.op == "embedding"] == ["dequant_u4_f32"]  # Q4_K table


def test_the_cli_takes_a_gemma3_config(capsys):
    """--model-dir on a Gemma 3 config: its norms are offset at load (1 + w), which the census's
    shape-only weights must take, and its extra norms (q/k norms, post-attention and post-MLP)
    are launches of their own."""
    gemma = Path(__file__).parent / "data" / "gemma3_tiny"
    assert step_census.main(["--model-dir", str(gemma), "--batch", "1"]) == 0
    out = capsys.readouterr().out
    per_layer = int(out.split("launches per layer: ")[1].split(";")[0])
    assert per_layer > 8  # Llama's 8 plus Gemma's norms
