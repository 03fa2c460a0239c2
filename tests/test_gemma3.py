"""Gemma 3 (text) against transformers: a tiny random checkpoint (tools/tiny_models.py: the
config.json transformers' Gemma3TextConfig wrote: 7 layers, every 6th full, a sliding window of
24, two RoPE bases, query_pre_attn_scalar 48 where head_dim is 32, a tied lm_head; random
weights, the default model's tokenizer) on the CPU backend with float32 activations, from its
HF folder and from the same checkpoint written as a llama.cpp ``gemma3`` GGUF. The reference
(tests/data/gemma3_tiny/reference.npz) is transformers' Gemma3ForCausalLM (eager attention),
made once offline by tools/make_reference.py: its greedy tokens and its logits at every
position (every 256th vocabulary id, and the argmax over all of them); the second prompt and its
continuation run past the window.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import family_reference as fr
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ringserve.gpu.loader.gguf_convert import convert_gguf
from ringserve.gpu.rope import inv_freqs
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from ringserve.tools.tiny_models import make_tiny_model

DATA = Path(__file__).parent / "data" / "gemma3_tiny"


ref = fr.reference_fixture("gemma3")
gemma3_dir = fr.folder_fixture("gemma3")


@pytest.fixture(scope="module")
def llama_cpp_scale_dir(gemma3_dir, tmp_path_factory) -> Path:
    """The same checkpoint with the attention scale llama.cpp gives a gemma3 GGUF (1 / sqrt(head_dim):
    a GGUF does not store query_pre_attn_scalar): what its GGUF must compute."""
    folder = tmp_path_factory.mktemp("gemma3-hd")
    for f in gemma3_dir.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((gemma3_dir / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config | {"query_pre_attn_scalar": config["head_dim"]}))
    return folder


@pytest.fixture(scope="module")
def packed_dirs(llama_cpp_scale_dir, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint as a GGUF of each packed type, converted once (by the first test that
    asks: packed_dirs[type] is filled lazily)."""
    class Converted(dict):
        def __missing__(self, matrix_type: str) -> Path:
            self[matrix_type] = gguf_dir(llama_cpp_scale_dir, tmp_path_factory, matrix_type)
            return self[matrix_type]
    return Converted()


def gguf_dir(folder: Path, tmp_path_factory, matrix_type: str) -> Path:
    return fr.converted_gguf("gemma3", folder, tmp_path_factory.mktemp(f"gemma3-{matrix_type}"), matrix_type)


def test_the_config_is_gemma3_with_its_layer_types_window_and_rope_bases(gemma3_dir, ref):
    c = ModelConfig.from_dir(gemma3_dir)
    assert c.architecture == "Gemma3ForCausalLM" and c.qk_norm and c.hidden_act == "gelu_tanh"
    assert c.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert c.sliding_window == 24 and c.attention_scale == 48 ** -0.5 and c.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.rope_scaling is not None and c.rope_scaling.factor == 2.0
    freqs = inv_freqs(c)  # full: 1e6 scaled by 1/2; sliding: 1e4 unscaled
    assert freqs[FULL_ATTENTION][0] == np.float32(0.5) and freqs[SLIDING_ATTENTION][0] == 1
    assert freqs[SLIDING_ATTENTION][1] > 2 * freqs[FULL_ATTENTION][1]
    assert max(ref["sequence_lens"]) > c.sliding_window  # the reference runs past the window


def test_greedy_decode_matches_transformers(gemma3_dir, ref):
    """Prefill in two chunks, then decode one token at a time, greedily from our own logits:
    the tokens transformers generated, and its logits at every position (prefill and decode),
    past the window too."""
    model = fr.runner(gemma3_dir)
    stride = int(ref["column_stride"])
    for n, case in enumerate(fr.sequences(ref)):
        # blocks not in order, not shared between the two requests
        fr.assert_greedy_decode_matches(model, case, [5 - n, 7, 2, 0 + n], stride, f"prompt {n}")


def test_every_position_of_one_prefill_matches_transformers(gemma3_dir, ref):
    """A whole sequence in one prefill (keys inside and beyond the window): every position's logits."""
    model = fr.runner(gemma3_dir)
    stride = int(ref["column_stride"])
    for seq, _, argmax, columns in fr.sequences(ref):
        logits = model.execute(fr.step(seq, 0, [0, 1, 2, 3]), np.arange(len(seq)))
        np.testing.assert_array_equal(logits.argmax(axis=1), argmax)
        assert fr.relative_error(logits[:, ::stride], columns) <= fr.RTOL


def test_the_gguf_gives_the_folders_logits_exactly(llama_cpp_scale_dir, tmp_path_factory, ref):
    """An F32 gemma3 GGUF (norms stored as 1 + w, llama.cpp's layer pattern, window and RoPE
    bases from its metadata) converts to the folder: the same logits at every position."""
    converted = gguf_dir(llama_cpp_scale_dir, tmp_path_factory, "F32")
    c = ModelConfig.from_dir(converted)
    assert c == ModelConfig.from_dir(llama_cpp_scale_dir)
    seq = fr.sequences(ref)[1][0]
    batch = fr.step(seq, 0, [0, 1, 2, 3])
    rows = np.arange(len(seq))
    hf, gguf = (fr.runner(d).execute(batch, rows) for d in (llama_cpp_scale_dir, converted))
    np.testing.assert_array_equal(hf, gguf)


@pytest.mark.parametrize("matrix_type, activations, rtol", [
    ("Q8_0", "float32", 1e-5), ("Q8_0", "int8", 0.05), ("Q5_0", "float32", 1e-5), ("Q5_0", "int8", 0.05)])
def test_a_packed_gguf_stays_packed_and_close(packed_dirs, ref, matrix_type, activations, rtol):
    """Its matrices Q8_0 or Q5_0 (what llama.cpp's Q4_K_M gives Gemma 3 1B's 1152-column
    matrices), kept packed on the CPU, its norms F32: every position's logits those of the same
    weights widened to float32 (gguf-py's dequantization): to float32 rounding with float32
    activations, within a few percent with int8 ones (llama.cpp's integer path: 3.2 % here),
    and the prompts' next tokens the same."""
    model = fr.runner(packed_dirs[matrix_type], activations)
    assert set(model.weights.nbytes_by_type()) == {matrix_type, "F32"}
    widened = ModelRunner(packed_dirs[matrix_type],
                          DeviceConfig(device="cpu", cpu_activation_dtype="float32"),
                          CacheConfig(num_gpu_blocks_override=8, block_size=fr.BLOCK), widen_packed=True)
    assert set(widened.weights.nbytes_by_type()) == {"F32"}
    for seq, prompt_len, _, _ in fr.sequences(ref):
        rows = np.arange(len(seq))
        want = widened.execute(fr.step(seq, 0, [0, 1, 2, 3]), rows)
        got = model.execute(fr.step(seq, 0, [0, 1, 2, 3]), rows)
        assert fr.relative_error(got, want) <= rtol, fr.relative_error(got, want)
        assert int(got[prompt_len - 1].argmax()) == int(want[prompt_len - 1].argmax())


def test_a_gemma3_folder_without_its_feedforward_norm_is_refused(gemma3_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = make_tiny_model("gemma3", tmp_path, config=DATA / "config.json", tokenizer_dir=gemma3_dir)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.3.pre_feedforward_layernorm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelError,
                       match="tensor 'model.layers.3.pre_feedforward_layernorm.weight' is missing"):
        fr.runner(folder)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ({"attention_bias": True}, "attention_bias true is not supported for Gemma 3"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention true is not supported"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention rope_type 'linear' is not supported"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "needs a text_config object"),
])
def test_what_gemma3_serves_not_is_refused_in_one_line(change, message):
    raw = json.loads((DATA / "config.json").read_text()) | change
    with pytest.raises(ModelError, match=message) as e:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_folder_serves_its_text_model(gemma3_dir, tmp_path, ref, prefix):
    """A Gemma3ForConditionalGeneration folder (4B-27B), as transformers 4.x and 5.x save it: its
    text_config (only what differs from Gemma3TextConfig's defaults) and the text model's
    tensors under their prefix, beside a vision tower: served text-only, the same logits as
    the text model's own folder; the vision tower's tensors are left out."""
    from safetensors.numpy import load_file, save_file

    raw = json.loads((gemma3_dir / "config.json").read_text())
    text = {k: v for k, v in raw.items() if k not in ("architectures", "eos_token_id", "bos_token_id",
                                                      "pad_token_id", "tie_word_embeddings")}
    text = {k: v for k, v in text.items() if k != "rms_norm_eps"}  # Gemma3TextConfig's default
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text, "vision_config": {"hidden_size": 16, "model_type": "siglip_vision_model"},
              "eos_token_id": [2, 7], "bos_token_id": 1, "image_token_index": 9}
    for f in gemma3_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {prefix + k[len("model."):]: v
               for k, v in load_file(str(gemma3_dir / "model.safetensors")).items()}
    weights["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((16, 3), np.float32)
    weights["multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(16, np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    c = ModelConfig.from_dir(tmp_path)
    assert c.architecture == "Gemma3ForCausalLM" and c.eos_token_ids == (2, 7)
    assert c == dataclasses.replace(ModelConfig.from_dir(gemma3_dir), eos_token_ids=(2, 7))
    seq = fr.sequences(ref)[1][0]
    rows = np.arange(len(seq))
    want, got = (fr.runner(d).execute(fr.step(seq, 0, [0, 1, 2, 3]), rows) for d in (gemma3_dir, tmp_path))
    np.testing.assert_array_equal(got, want)


def test_older_gemma3_configs_read_the_same(ref):
    """transformers < 5 wrote rope_theta + rope_scaling (full layers), rope_local_base_freq and
    sliding_window_pattern, no layer_types: the same model."""
    raw = json.loads((DATA / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(raw)


def test_a_served_gemma3_decodes_as_transformers_and_hits_the_prefix_cache(serve, gemma3_dir, ref,
                                                                           no_segment_left_behind):
    """`ringserve serve` on the folder (CPU, float32: the checkpoint's dtype): the engine's
    scheduler, paged cache and sampler give transformers' greedy tokens past the window; asked
    again, the prompt's whole blocks come from the prefix cache and the answer is the same."""
    # 41 prompt tokens: two whole blocks of 16
    fr.assert_served_decodes_as_reference(serve, gemma3_dir, fr.sequences(ref)[1], prefix_hits=2 * fr.BLOCK)


def test_a_random_gemma3_gguf_converts_with_gemmas_turns(tmp_path):
    """tools/random_gguf.py --arch gemma3 (a small shape): converted, every norm shifted back,
    <end_of_turn> stops generation beside <eos> (as llama.cpp stops on it), the chat template
    renders Gemma's turns with <start_of_turn> one token, and a Q8_0 step runs packed."""
    from ringserve.server.tokenizer import Tokenizer
    from ringserve.tools.random_gguf import Shape, write_random_gguf

    shape = Shape(hidden=128, layers=7, heads=2, kv_heads=1, ffn=256, vocab=1024, rope_theta=1e6,
                  context=256, head_dim=64, sliding_window=16)
    write_random_gguf(tmp_path / "g.gguf", shape, "q8_0", arch="gemma3", progress=False)
    folder = convert_gguf(tmp_path / "g.gguf", tmp_path / "converted", progress=False)
    c = ModelConfig.from_dir(folder)
    assert c.architecture == "Gemma3ForCausalLM" and c.sliding_window == 16 and c.head_dim == 64
    assert c.layer_windows == (16,) * 5 + (0, 16) and c.attention_scale == 64 ** -0.5
    tok = Tokenizer.from_dir(folder)
    turn_end = tok.encode("<end_of_turn>", add_special_tokens=False)
    assert len(turn_end) == 1 and c.eos_token_ids == (tok.eos_token_id, turn_end[0])
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == tok.encode("<bos><start_of_turn>", add_special_tokens=False) and len(ids) < len(text)
    model = fr.runner(folder)
    assert set(model.weights.nbytes_by_type()) == {"Q8_0", "F32"}
    assert np.isfinite(model.execute(fr.step(ids, 0, [0, 1]))).all()


@pytest.mark.parametrize("saved_as", ["chat_template.jinja", "chat_template.json"])
def test_a_chat_template_saved_beside_the_tokenizer_renders_gemmas_turns(gemma3_dir, tmp_path, saved_as):
    """transformers >= 4.43 saves the template as chat_template.jinja, Gemma 3 4B-27B's processor
    as chat_template.json: either serves when tokenizer_config.json has none."""
    from ringserve.server.tokenizer import Tokenizer
    from ringserve.tools.random_gguf import GEMMA3_TEMPLATE

    for f in gemma3_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / saved_as).write_text(GEMMA3_TEMPLATE if saved_as.endswith(".jinja")
                                     else json.dumps({"chat_template": GEMMA3_TEMPLATE}))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                    {"role": "user", "content": "Bye"}])
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
                         "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


# config.json of google/gemma-3-1b-it and the top of google/gemma-3-4b-it's, as published
# (transformers 4.50: rope_theta / rope_local_base_freq / sliding_window_pattern, no layer_types)
GEMMA3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
    "vocab_size": 262144}
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_the_published_gemma3_configs_read_as_transformers_reads_them():
    one = ModelConfig.from_dict(GEMMA3_1B_IT)
    assert (one.hidden_size, one.num_hidden_layers, one.num_attention_heads, one.num_key_value_heads,
            one.head_dim, one.vocab_size) == (1152, 26, 4, 1, 256, 262144)
    assert one.layer_windows == ((512,) * 5 + (0,)) * 4 + (512, 512)  # layers 5, 11, 17, 23 full
    assert one.eos_token_ids == (1, 106) and one.tie_word_embeddings and one.rope_scaling is None
    assert one.attention_scale == 256 ** -0.5 and one.local_rope_theta == 1e4 and one.rope_theta == 1e6
    four = ModelConfig.from_dict(GEMMA3_4B_IT)  # the rest from Gemma3TextConfig's defaults
    assert four.architecture == "Gemma3ForCausalLM"
    assert (four.hidden_size, four.num_hidden_layers, four.num_attention_heads, four.num_key_value_heads,
            four.head_dim, four.vocab_size) == (2560, 34, 8, 4, 256, 262208)
    assert four.rope_scaling is not None and four.rope_scaling.rope_type == "linear"
    assert four.rope_scaling.factor == 8.0 and four.sliding_window == 1024 and four.eos_token_ids == (1, 106)
    freqs = inv_freqs(four)  # linear scaling on the full layers only
    assert freqs[FULL_ATTENTION][0] == np.float32(1 / 8) and freqs[SLIDING_ATTENTION][0] == 1


def test_a_sentencepiece_gguf_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """A GGUF `tokenizer.ggml.model` "llama" vocabulary (Gemma's, Llama 2's: SentencePiece BPE
    pieces, scores and token types, as llama.cpp's converter writes them; here a small model
    of Gemma's settings trained by tools/make_spm_reference.py): SentencePiece's own ids for
    204 varied strings (whitespace runs, digits, CJK, emoji, byte fallback, Gemma's turn
    markers), and back to the same text."""
    import gguf

    from ringserve.gpu.loader.gguf_convert import _Metadata, build_tokenizer

    data = json.loads((Path(__file__).parent / "data" / "spm_tokens.json").read_text(encoding="utf-8"))
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([p[0] for p in data["pieces"]])
    w.add_token_scores([p[1] for p in data["pieces"]])
    w.add_token_types([p[2] for p in data["pieces"]])
    w.add_bos_token_id(data["bos_token_id"])
    w.add_eos_token_id(data["eos_token_id"])
    w.add_unk_token_id(data["unk_token_id"])
    w.add_add_space_prefix(False)  # Gemma's
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "vocab.gguf"
    tok, config = build_tokenizer(_Metadata(gguf.GGUFReader(path), path))
    for text, ids in data["cases"]:
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert config["add_bos_token"] and tok.encode("Hi").ids[0] == data["bos_token_id"]
