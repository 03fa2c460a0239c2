"""Qwen3 (dense) against transformers: a tiny random checkpoint (tools/tiny_models.py: the
config.json transformers' Qwen3Config wrote, head_dim 32 where hidden / heads is 16, random
weights, the default model's tokenizer) on the CPU backend with float32 activations, from its
HF folder and from the same checkpoint written as a llama.cpp ``qwen3`` GGUF. The reference
(tests/data/qwen3_tiny/reference.npz) is transformers' Qwen3ForCausalLM, made once offline by
tools/make_reference.py: its greedy tokens and its logits at every position (every
256th vocabulary id, and the argmax over all of them).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import family_reference as fr
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from ringserve.tools.tiny_models import make_tiny_model

DATA = Path(__file__).parent / "data" / "qwen3_tiny"


ref = fr.reference_fixture("qwen3")
qwen3_dir = fr.folder_fixture("qwen3")


@pytest.fixture(scope="module")
def qwen3_gguf_dir(qwen3_dir, tmp_path_factory) -> Path:
    return fr.converted_gguf("qwen3", qwen3_dir, tmp_path_factory.mktemp("qwen3-gguf"))


@pytest.fixture(scope="module")
def qwen3_q8_0_dir(qwen3_dir, tmp_path_factory) -> Path:
    return fr.converted_gguf("qwen3", qwen3_dir, tmp_path_factory.mktemp("qwen3-q8"), "Q8_0")


def test_the_config_is_qwen3_with_its_own_head_dim(qwen3_dir):
    c = ModelConfig.from_dir(qwen3_dir)
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and not c.attention_bias
    assert c.head_dim == 32 != c.hidden_size // c.num_attention_heads
    assert c.rope_theta == 1e6 and not c.tie_word_embeddings


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_decode_matches_transformers(source, qwen3_dir, qwen3_gguf_dir, ref):
    """Prefill in two chunks, then decode one token at a time, greedily from our own logits:
    the tokens transformers generated, and its logits at every position (prefill and decode)."""
    model = fr.runner(qwen3_dir if source == "hf" else qwen3_gguf_dir)
    stride = int(ref["column_stride"])
    for n, case in enumerate(fr.sequences(ref)):
        # blocks not in order, not shared between the two requests
        fr.assert_greedy_decode_matches(model, case, [5 - n, 7, 2], stride, f"prompt {n}")


def test_the_gguf_gives_the_folders_logits_exactly(qwen3_dir, qwen3_gguf_dir, ref):
    """A whole sequence in one prefill, every position's logits: the F32 GGUF is the folder."""
    seq = fr.sequences(ref)[1][0]
    batch = fr.step(seq, 0, [0, 1, 2])
    rows = np.arange(len(seq))
    hf, gguf = (fr.runner(d).execute(batch, rows) for d in (qwen3_dir, qwen3_gguf_dir))
    np.testing.assert_array_equal(hf, gguf)
    config = ModelConfig.from_dir(qwen3_gguf_dir)
    assert config.architecture == "Qwen3ForCausalLM" and config.head_dim == 32


@pytest.mark.parametrize("activations, rtol", [("float32", 0.02), ("int8", 0.05)])
def test_a_q8_0_gguf_stays_packed_and_close(qwen3_q8_0_dir, ref, activations, rtol):
    """Its matrices Q8_0 (kept packed on the CPU; int8 activations take llama.cpp's integer
    path), its q/k norms F32: the logits stay within Q8_0's error of transformers' and the
    prompt's next token is the same."""
    model = ModelRunner(qwen3_q8_0_dir, DeviceConfig(device="cpu", cpu_activation_dtype=activations),
                        CacheConfig(num_gpu_blocks_override=8, block_size=fr.BLOCK))
    assert set(model.weights.nbytes_by_type()) == {"Q8_0", "F32"}
    stride = int(ref["column_stride"])
    for seq, prompt_len, argmax, columns in fr.sequences(ref):
        logits = model.execute(fr.step(seq[:prompt_len], 0, [0, 1]))[0]
        assert fr.relative_error(logits[::stride], columns[prompt_len - 1]) <= rtol
        assert int(logits.argmax()) == argmax[prompt_len - 1]


def test_a_qwen3_folder_without_its_qk_norms_is_refused(qwen3_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = make_tiny_model("qwen3", tmp_path, config=DATA / "config.json", tokenizer_dir=qwen3_dir)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match="tensor 'model.layers.1.self_attn.k_norm.weight' is missing"):
        fr.runner(folder)


def test_a_served_qwen3_decodes_as_transformers_and_hits_the_prefix_cache(serve, qwen3_dir, ref,
                                                                          no_segment_left_behind):
    """`ringserve serve` on the folder (CPU, float32: the checkpoint's dtype): the engine's
    scheduler, paged cache and sampler give transformers' greedy tokens; asked again, the
    prompt's whole blocks come from the prefix cache and the answer is the same."""
    # 22 prompt tokens: one whole block of 16
    fr.assert_served_decodes_as_reference(serve, qwen3_dir, fr.sequences(ref)[1])
