"""Phi-3 (Phi-3.5-mini, Phi-4-mini) against transformers: a tiny random checkpoint
(tools/tiny_models.py: the config.json transformers' Phi3Config wrote, with fused qkv_proj and
gate_up_proj, partial_rotary_factor 0.75, LongRoPE over a 16-token original context of 64; random
weights, the default model's tokenizer) on the CPU backend with float32 activations, from its HF
folder and from the same checkpoint written as a llama.cpp ``phi3`` GGUF (F32, Q8_0).
The reference (tests/data/phi3_tiny/reference.npz) is transformers' Phi3ForCausalLM, made once
offline by tools/make_reference.py: its greedy tokens and its logits at every position
(every 256th vocabulary id, and the argmax over all of them). The first prompt stays within the
original context (short factors: max_model_len 16), the second starts past it (long factors:
max_model_len 64), as gpu/rope.py picks them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import family_reference as fr
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.gguf_convert import convert_gguf
from ringserve.gpu.rope import attention_factor, inv_freq
from ringserve.gpu.settings import StepLimits
from ringserve.tools.tiny_models import make_tiny_model

DATA = Path(__file__).parent / "data" / "phi3_tiny"


ref = fr.reference_fixture("phi3")
phi3_dir = fr.folder_fixture("phi3")


@pytest.fixture(scope="module")
def phi3_gguf(phi3_dir, tmp_path_factory):
    """The checkpoint as a phi3 GGUF of a matrix type, converted (one conversion per type)."""
    made: dict[str, Path] = {}

    def convert(matrix_type: str) -> Path:
        if matrix_type not in made:
            folder = tmp_path_factory.mktemp(f"phi3-{matrix_type}")
            made[matrix_type] = fr.converted_gguf("phi3", phi3_dir, folder, matrix_type)
        return made[matrix_type]
    return convert


def runner(model_dir: Path, max_model_len: int, activations: str = "float32"):
    """LongRoPE's factors follow max_model_len (the CPU backend reads only that of the limits)."""
    return fr.runner(model_dir, activations,
                      StepLimits(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=max_model_len))


def cases(ref):
    """fr.sequences(ref) with the max_model_len that serves each as transformers computed it."""
    return list(zip(fr.sequences(ref), ref["max_model_lens"].tolist(), strict=True))


def test_the_config_is_phi3_with_partial_rotary_and_longrope(phi3_dir):
    c = ModelConfig.from_dir(phi3_dir)
    assert c.architecture == "Phi3ForCausalLM" and c.fused_projections and not c.qk_norm
    assert c.head_dim == 32 and c.rotary_dim == 24
    s = c.rope_scaling
    assert s is not None and s.rope_type == "longrope" and s.original_max_position_embeddings == 16
    assert len(s.short_factor) == len(s.long_factor) == 12
    assert attention_factor(c) == pytest.approx((1 + np.log(4) / np.log(16)) ** 0.5)
    # which factors: by max_model_len, long only past the original context
    np.testing.assert_allclose(inv_freq(c, 16) * np.float32(s.short_factor),
                               inv_freq(c, 64) * np.float32(s.long_factor), rtol=1e-6)
    assert not np.array_equal(inv_freq(c, 16), inv_freq(c, 17))


@pytest.mark.parametrize("source", ["hf", "F32"])
def test_greedy_decode_matches_transformers(source, phi3_dir, phi3_gguf, ref):
    """Prefill in two chunks, then decode one token at a time, greedily from our own logits:
    the tokens transformers generated, and its logits at every position (prefill and decode)."""
    model_dir = phi3_dir if source == "hf" else phi3_gguf(source)
    stride = int(ref["column_stride"])
    for n, (case, max_model_len) in enumerate(cases(ref)):
        model = runner(model_dir, max_model_len)
        # blocks not in order
        fr.assert_greedy_decode_matches(model, case, [5 - n, 7, 2, 0], stride, f"prompt {n}")


def test_the_other_factors_give_other_logits(phi3_dir, ref):
    """The long prompt under short factors (a server of max_model_len 16) is not transformers'
    answer: the test above would see a wrong choice of factors."""
    (seq, _, _, columns), _ = cases(ref)[1]
    logits = runner(phi3_dir, 16).execute(fr.step(seq, 0, [0, 1, 2, 3]), np.arange(len(seq)))
    assert fr.relative_error(logits[:, ::int(ref["column_stride"])], columns) > 100 * fr.RTOL


def test_the_gguf_converts_to_the_folders_config_and_logits(phi3_dir, phi3_gguf, ref):
    """The F32 GGUF's config is the folder's (rotary dims, LongRoPE factors, original context;
    its attention factor is the float32 llama.cpp wrote) and a whole sequence's logits the same."""
    converted = phi3_gguf("F32")
    ours, theirs = ModelConfig.from_dir(converted), ModelConfig.from_dir(phi3_dir)
    assert ours.architecture == "Phi3ForCausalLM" and ours.rotary_dim == 24 and ours.fused_projections
    assert ours.rope_scaling is not None and theirs.rope_scaling is not None
    assert ours.rope_scaling.long_factor == pytest.approx(theirs.rope_scaling.long_factor, rel=1e-7)
    assert ours.rope_scaling.short_factor == pytest.approx(theirs.rope_scaling.short_factor, rel=1e-7)
    assert ours.rope_scaling.attention_factor == pytest.approx(theirs.rope_scaling.attention_factor, rel=1e-7)
    assert ours.rope_scaling.original_max_position_embeddings == 16 and ours.max_position_embeddings == 64
    seq = cases(ref)[1][0][0]
    batch = fr.step(seq, 0, [0, 1, 2, 3])
    rows = np.arange(len(seq))
    hf, gguf = (runner(d, 64).execute(batch, rows) for d in (phi3_dir, converted))
    np.testing.assert_allclose(gguf, hf, rtol=0, atol=1e-5 * np.abs(hf).max())


@pytest.mark.parametrize("matrix_type, activations, rtol", [
    ("Q8_0", "float32", 0.02), ("Q8_0", "int8", 0.05)])
def test_packed_ggufs_stay_packed_and_close(phi3_gguf, ref, matrix_type, activations, rtol):
    """Its matrices Q8_0 (kept packed on the CPU; int8 activations take llama.cpp's
    integer path), norms F32: logits within the type's error of transformers' and the prompt's
    next token the same. (gguf-py quantizes no K-quant, and 4-bit random weights are too far
    from the float model to compare: Q4_K is test_gguf_families' random phi3 file.)"""
    for (seq, prompt_len, argmax, columns), max_model_len in cases(ref):
        model = runner(phi3_gguf(matrix_type), max_model_len, activations)
        assert set(model.weights.nbytes_by_type()) == {matrix_type, "F32"}
        logits = model.execute(fr.step(seq[:prompt_len], 0, [0, 1]))[0]
        assert fr.relative_error(logits[::int(ref["column_stride"])], columns[prompt_len - 1]) <= rtol
        assert int(logits.argmax()) == argmax[prompt_len - 1]


@pytest.mark.parametrize("edit, message", [
    ({"sliding_window": 0}, "sliding_window 0 must be a positive integer"),
    ({"partial_rotary_factor": 0.71875}, "partial_rotary_factor 0.71875 gives 23 rotary dims"),
    ({"rope_parameters.short_factor": [1.0] * 11}, "short_factor must be 12 positive numbers"),
    ({"rope_parameters.original_max_position_embeddings": None},
     "missing field 'original_max_position_embeddings'"),
])
def test_bad_phi3_configs_are_refused_by_field(edit, message):
    raw = json.loads((DATA / "config.json").read_text())
    for key, value in edit.items():
        if key.startswith("rope_parameters."):
            raw["rope_parameters"][key.split(".", 1)[1]] = value
            if value is None:
                del raw["original_max_position_embeddings"]
        else:
            raw[key] = value
            if key == "partial_rotary_factor":
                del raw["rope_parameters"]["partial_rotary_factor"]
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(raw)


def test_a_real_phi3_window_slides_every_layer():
    """Phi-3-mini-4k's sliding_window (2047, below max_position_embeddings) windows every layer,
    as transformers' Phi3Attention does (the kernels and the KV manager: tests/test_mistral.py)."""
    raw = json.loads((DATA / "config.json").read_text()) | {"sliding_window": 32}
    config = ModelConfig.from_dict(raw)
    assert config.layer_windows == (32,) * config.num_hidden_layers and config.uniform_window == 32


def test_the_pre_5_config_layout_reads_the_same(phi3_dir):
    """Phi-3.5 / Phi-4-mini as published: rope_scaling with "type", rope_theta,
    partial_rotary_factor and original_max_position_embeddings at the top, Phi-3.5's
    sliding_window past max_position_embeddings (no window)."""
    raw = json.loads((DATA / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
            "sliding_window": 262144,
            "rope_scaling": {"type": "longrope", "short_factor": rope["short_factor"],
                             "long_factor": rope["long_factor"]}}
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dir(phi3_dir)


def test_a_phi3_folder_with_unfused_projections_is_refused(phi3_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = make_tiny_model("phi3", tmp_path, config=DATA / "config.json", tokenizer_dir=phi3_dir)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match="tensor 'model.layers.1.mlp.gate_up_proj.weight' is missing"):
        runner(folder, 64)


def _random_phi3_gguf(path: Path, layout: str, **metadata) -> dict[str, str]:
    from ringserve.tools.check_gguf_peer import SHAPES
    from ringserve.tools.random_gguf import Shape, write_random_gguf

    shape = Shape(**{**SHAPES["qwen2"].__dict__, "rotary_dim": 48, "original_context": 512})
    merges = json.loads((Path(__file__).parent / "data" / "gguf_peer_tokens.json").read_text())["merges"]
    return write_random_gguf(path, shape, layout, seed=5, progress=False, arch="phi3",
                             merges=merges[:1700], metadata=metadata)  # room for Phi's 7 specials


def test_a_phi3_gguf_ends_turns_at_end_as_well(tmp_path):
    """Phi-4-mini's GGUF names <|endoftext|> its eos; <|end|> ends each turn (llama.cpp stops at
    both): config.json lists both."""
    _random_phi3_gguf(tmp_path / "phi3.gguf", "q8_0")
    folder = convert_gguf(tmp_path / "phi3.gguf", tmp_path / "m", progress=False)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    assert ModelConfig.from_dir(folder).eos_token_ids == (added["<|endoftext|>"], added["<|end|>"])


def test_a_random_phi4_mini_shaped_gguf_converts_chats_and_stops_at_end(tmp_path, monkeypatch):
    """tools/random_gguf.py --arch phi3 (as speed runs write it: Q4_K_M, attn_qkv Q5_K as
    llama.cpp, 48 of 64 dims rotated, LongRoPE tensors; Phi's turn tokens in a small BPE), here
    without an eos key: the converter keeps the fused rows as stored, reads the rope factors into
    config.json and finds Phi's <|end|> by its text; LLM.chat renders the GGUF's Phi template
    (each turn marker one token) and an answer held to nothing (regex "") ends at <|end|>."""
    import gguf

    from ringserve.gpu.loader.weights import load_weights
    from ringserve.ipc.sampling_params import SamplingParams
    from ringserve.ipc.structured import StructuredOutputsParams
    from ringserve.server.llm import LLM

    path = tmp_path / "phi3.gguf"
    types = _random_phi3_gguf(path, "q4_k_m", **{"tokenizer.ggml.eos_token_id": None})
    assert types["blk.0.attn_qkv.weight"] == "Q5_K" and types["blk.0.ffn_up.weight"] == "Q4_K"
    folder = convert_gguf(path, tmp_path / "m", progress=False)
    c = ModelConfig.from_dir(folder)
    assert (c.architecture, c.head_dim, c.rotary_dim) == ("Phi3ForCausalLM", 64, 48) and c.fused_projections
    assert c.rope_scaling is not None and c.rope_scaling.original_max_position_embeddings == 512
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    np.testing.assert_array_equal(np.float32(c.rope_scaling.long_factor),
                                  stored["rope_factors_long.weight"].data)
    weights = load_weights(folder)
    assert np.array_equal(weights["model.layers.1.self_attn.qkv_proj.weight"].raw,
                          stored["blk.1.attn_qkv.weight"].data)
    assert np.array_equal(weights["model.layers.0.mlp.gate_up_proj.weight"].raw,
                          stored["blk.0.ffn_up.weight"].data)
    vocab = reader.fields["tokenizer.ggml.tokens"].contents()
    end = vocab.index("<|end|>")
    assert c.eos_token_ids == (end,)

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(model=str(path), max_model_len=256)
    nothing = StructuredOutputsParams(regex="")
    out = llm.chat([{"role": "user", "content": "Hi there"}],
                   SamplingParams(temperature=0, max_tokens=8, structured_outputs=nothing))[0]
    prompt = list(out.prompt_token_ids)
    assert prompt[0] == vocab.index("<|user|>") and prompt[-1] == vocab.index("<|assistant|>")
    assert prompt.count(end) == 1
    assert list(out.outputs[0].token_ids) == [end] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("case", [0, 1])
def test_a_served_phi3_decodes_as_transformers_and_hits_the_prefix_cache(serve, phi3_dir, ref, case,
                                                                         no_segment_left_behind):
    """`ringserve serve` on the folder (CPU, float32) with --max-model-len as the reference says
    (16: short factors, 64: long): the engine's scheduler, paged cache and sampler give
    transformers' greedy tokens; asked again, the long prompt's whole block comes from the
    prefix cache (K rotated under the one set of factors the server uses) and the answer is the same."""
    sequence, max_model_len = cases(ref)[case]
    prompt_len = sequence[1]
    fr.assert_served_decodes_as_reference(serve, phi3_dir, sequence, max_model_len,
                                          prefix_hits=fr.BLOCK if prompt_len >= fr.BLOCK else 0)


def test_the_gpt4o_split_is_the_tokenizer_json_regex():
    """Phi-4-mini's GGUF pre-tokenizer "gpt-4o": our regex spells the contractions case by case
    (as llama.cpp does); on varied text (words, CamelCase, capitals, contractions, digits, CJK,
    emoji, code, whitespace runs) it splits exactly as the o200k regex of Phi-4-mini's
    tokenizer.json, (?i:...) and all."""
    from tokenizers import Regex, pre_tokenizers

    from ringserve.gpu.loader.gguf_convert import PRE_TOKENIZERS
    from ringserve.tools.random_gguf import sample_texts

    o200k = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
             r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    regex = PRE_TOKENIZERS["gpt-4o"].regex
    assert regex is not None
    ours, theirs = (pre_tokenizers.Split(Regex(r), behavior="isolated") for r in (regex, o200k))
    texts = sample_texts(300, seed=7) + ["HelloWorld IT'S don'T x/\n/y CAFÉ café ÉcoleNormale 1234567"]
    for text in texts:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), text
    assert [p for p, _ in ours.pre_tokenize_str("HelloWorld IT'S 1234567")] == [
        "Hello", "World", " IT'S", " ", "123", "456", "7"]
