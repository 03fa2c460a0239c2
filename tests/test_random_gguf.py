"""tools/random_gguf.py: random-weight GGUFs of real shapes in llama.cpp's layouts, which the
converter reads and the engine serves (the 1B and 8B runs are in docs/bench_quant.md)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from ringserve.gpu.loader.model_store import resolve_model
from ringserve.gpu.loader.weights import load_weights
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.llm import LLM
from ringserve.tools.random_gguf import (
    SHAPES,
    Shape,
    _more_bits,
    random_blocks,
    tensor_type,
    write_random_gguf,
)

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_random_blocks_are_finite_weights_of_a_trained_size(kind):
    blocks = random_blocks(kind, 8, 512, np.random.default_rng(1))
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    assert w.shape == (8, 512) and np.isfinite(w).all()
    assert 0.002 < float(np.abs(w).mean()) < 0.1, kind


def test_more_bits_layers_are_llama_cpps():
    # llama.cpp's use_more_bits for 16 layers: 0, 1 (first eighth), 14, 15 (last), 4, 7, 10, 13
    assert [i for i in range(16) if _more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_rows_that_are_not_whole_256_blocks_fall_back_as_llama_cpp_does():
    """SmolLM2's 576 columns: the Q4_K_M file on the hub has Q5_0 and Q8_0 where K-quants cannot go."""
    s = SHAPES["smollm2-135m"]
    assert tensor_type("q4_k_m", "ffn_gate.weight", 3, s.layers, s.tied, 576) == "Q5_0"
    assert tensor_type("q4_k_m", "token_embd.weight", None, s.layers, s.tied, 576) == "Q8_0"
    assert tensor_type("q4_k_m", "ffn_down.weight", 3, s.layers, s.tied, 1536) == "Q4_K"


@pytest.mark.slow
def test_a_random_q4_k_m_gguf_converts_keeps_its_blocks_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "small-q4km.gguf"
    shape = Shape(hidden=256, layers=8, heads=4, kv_heads=2, ffn=768, vocab=4096, context=256)
    types = write_random_gguf(path, shape, "q4_k_m", progress=False)
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_v.weight"] == "Q6_K"
    assert types["blk.2.attn_v.weight"] == "Q4_K" and types["blk.3.ffn_down.weight"] == "Q6_K"  # 0 3 6 7
    llm = LLM(model=str(path), max_model_len=64)
    weights = load_weights(resolve_model(str(path)))   # the folder the LLM was built from
    kept = {name: t.ggml_type for name, t in weights.items() if hasattr(t, "ggml_type")}
    assert kept["model.layers.0.self_attn.v_proj.weight"] == "Q6_K"
    assert kept["model.layers.5.mlp.gate_proj.weight"] == "Q4_K" and len(kept) == 1 + 8 * 7
    out = llm.generate([[1, 5, 9, 200]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                         logprobs=1))[0].outputs[0]
    assert len(out.token_ids) == 4 and all(np.isfinite(lp[t].logprob)
                                           for lp, t in zip(out.logprobs, out.token_ids, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["q2_k", "q3_k", "q5_k", "q5_0", "q5_1", "q4_0", "q8_0"])
def test_every_block_type_converts_and_generates(tmp_path, monkeypatch, layout):
    """One file per type (every matrix in it): converted with its blocks kept, served packed,
    logits finite."""
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"small-{layout}.gguf"
    shape = Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=1024, context=128)
    write_random_gguf(path, shape, layout, progress=False)
    llm = LLM(model=str(path), max_model_len=32)
    kinds = {t.ggml_type for t in load_weights(resolve_model(str(path))).values() if hasattr(t, "ggml_type")}
    assert kinds == {layout.upper()}
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   logprobs=0))[0].outputs[0]
    assert len(out.token_ids) == 3 and all(np.isfinite(lp[t].logprob)
                                           for lp, t in zip(out.logprobs, out.token_ids, strict=True))
