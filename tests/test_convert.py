"""GGUF -> HF conversion (gpu/loader/gguf_convert.py) and the model cache (gpu/loader/model_store.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader import model_store
from ringserve.gpu.loader.gguf_convert import convert_gguf, unpermute_qk
from ringserve.gpu.loader.model_store import default_gguf_path, gguf_identity, resolve_model
from ringserve.gpu.loader.weights import load_weights
from ringserve.tools.tiny_gguf import LAYER_TENSORS, make_tiny_gguf, permute_qk

FIVE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, original float32 weights, converted folder)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    original = make_tiny_gguf(root / "tiny.gguf")
    return root / "tiny.gguf", original, convert_gguf(root / "tiny.gguf", root / "converted", progress=False)


# ----------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model_matches_design_facts(default_model_dir):
    assert all((default_model_dir / f).is_file() for f in FIVE_FILES)
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                   "bos_token_id", "eos_token_id")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    assert config["rope_theta"] == 1e5 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["model_max_length"] == 8192
    added = json.loads((default_model_dir / "tokenizer.json").read_text())["added_tokens"]
    assert [t["id"] for t in added if t["special"]] == list(range(17))

    weights = load_weights(default_model_dir)   # each tensor in its GGUF type, blocks kept
    q, k = (weights[f"model.layers.29.self_attn.{n}_proj.weight"] for n in "qk")
    assert (q.ggml_type, q.shape, k.ggml_type, k.shape) == ("Q4_1", (576, 576), "Q4_1", (192, 576))
    embed = weights["model.embed_tokens.weight"]
    assert (embed.ggml_type, embed.shape, embed.nbytes) == ("Q8_0", (49152, 576), 49152 * 18 * 34)
    assert weights["model.norm.weight"].dtype == np.float32
    assert len(weights) == 2 + 30 * 9 and "lm_head.weight" not in weights
    size = (default_model_dir / "model.safetensors").stat().st_size
    assert size < 1.01 * default_gguf_path().stat().st_size     # nothing widened on disk


@pytest.mark.slow
def test_default_model_qk_rows_are_unpermuted(default_model_dir):
    """Permuting our q/k back the way llama.cpp does gives the GGUF tensor bit for bit: the
    blocks themselves, and their values."""
    reader = gguf.GGUFReader(default_gguf_path())
    stored = {t.name: t for t in reader.tensors}
    weights = load_weights(default_model_dir)
    for gguf_name, hf_name, heads in (("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),
                                      ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", 3)):
        t, ours = stored[gguf_name], weights[hf_name]
        assert np.array_equal(permute_qk(ours.raw, heads), t.data)
        raw = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.array_equal(permute_qk(np.asarray(ours), heads), raw)


@pytest.mark.slow
def test_second_resolve_does_no_work(default_model_dir):
    before = {f: (default_model_dir / f).stat().st_mtime_ns for f in FIVE_FILES}
    assert resolve_model(None) == default_model_dir
    assert resolve_model("smollm2-135m-instruct") == default_model_dir
    assert {f: (default_model_dir / f).stat().st_mtime_ns for f in FIVE_FILES} == before


@pytest.mark.slow
def test_truncated_default_gguf_is_a_model_error(default_model_dir, tmp_path):
    source = default_gguf_path()
    for size in (64, 5_000_000, source.stat().st_size - 1000):
        cut = tmp_path / f"cut-{size}.gguf"
        with open(source, "rb") as f:
            cut.write_bytes(f.read(size))
        with pytest.raises(ModelError, match="cut-") as e:
            convert_gguf(cut, tmp_path / f"out-{size}", progress=False)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- a tiny GGUF


def test_every_tensor_type_dequantizes_to_what_was_stored(tiny):
    path, original, converted = tiny
    loaded = load_weights(converted)
    assert set(loaded) == set(original)
    got = {name: np.asarray(t, dtype=np.float32) for name, t in loaded.items()}
    reader = gguf.GGUFReader(path)
    by_type = {}
    for t in reader.tensors:
        hf = next(k for k in original if _gguf_name(k) == t.name)
        heads = 4 if t.name.endswith("attn_q.weight") else 2 if t.name.endswith("attn_k.weight") else None
        stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(original[hf].shape)
        # Exact: the converted tensor is the stored one, un-permuted, nothing else; kept in its type.
        kept = loaded[hf]
        if t.tensor_type.name in ("F32", "F16"):
            assert kept.dtype == np.dtype(t.tensor_type.name.replace("F", "float")), hf
        else:
            assert kept.ggml_type == t.tensor_type.name and kept.shape == original[hf].shape, hf
        assert np.array_equal(got[hf], unpermute_qk(stored, heads) if heads else stored), hf
        by_type.setdefault(t.tensor_type.name, []).append(hf)
    assert set(by_type) == {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"}
    # Close to the originals, within each type's quantization error (relative to a 32-block's range).
    bound = {"F32": 0.0, "F16": 1e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 15}
    for kind, names in by_type.items():
        for hf in names:
            x = original[hf]
            block_range = np.abs(x).reshape(-1, 32 if x.ndim > 1 else x.size).max(axis=1, keepdims=True)
            err = np.abs(got[hf] - x).reshape(block_range.shape[0], -1)
            assert (err <= block_range * bound[kind] * 1.01 + 1e-7).all(), (hf, kind)


def test_unpermute_inverts_llama_cpp_permute(tiny):
    _, original, converted = tiny
    got = load_weights(converted)
    q = original["model.layers.0.self_attn.q_proj.weight"]  # F16: kept, exact up to float16 rounding
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"], q.astype(np.float16))
    x = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(x, heads), heads), x)
        assert not np.array_equal(permute_qk(x, heads), x)


def test_tiny_config_and_tokenizer(tiny):
    _, original, converted = tiny
    config = json.loads((converted / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 263
    from ringserve.server.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(converted)
    ids = tok.encode("<|im_start|> the  42")
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert pieces == ["<|im_start|>", " the", "  ", "4", "2"]


def test_tied_embeddings_when_there_is_no_output_tensor(tmp_path):
    original = make_tiny_gguf(tmp_path / "tied.gguf", tied=True, num_layers=1)
    out = convert_gguf(tmp_path / "tied.gguf", tmp_path / "m", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(out / "model.safetensors") and "lm_head.weight" not in original


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
    (dict(type_overrides={"attn_v.weight": "F64"}), "blk.0.attn_v.weight has type F64"),
    (dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)}), "blk.0.attn_q.bias"),
    (dict(extra_tensors={"rope_freqs.weight": np.ones(5, np.float32)}), "rope_freqs.weight must be 8 finite"),
])
def test_unsupported_gguf_is_a_model_error(tmp_path, kwargs, message):
    make_tiny_gguf(tmp_path / "bad.gguf", num_layers=1, **kwargs)
    with pytest.raises(ModelError, match=message):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_float64_tensor_is_refused_by_name(tmp_path):
    make_tiny_gguf(tmp_path / "f64.gguf", num_layers=1, type_overrides={"ffn_norm.weight": "F64"})
    with pytest.raises(ModelError, match="blk.0.ffn_norm.weight has type F64"):
        convert_gguf(tmp_path / "f64.gguf", tmp_path / "out", progress=False)


def test_truncated_and_corrupt_files(tiny, tmp_path):
    path = tiny[0]
    data = path.read_bytes()
    for name, content in (("short.gguf", data[: len(data) // 2]), ("tail.gguf", data[:-7]),
                          ("header.gguf", data[:20]), ("junk.gguf", b"GGUF" + os.urandom(200)),
                          ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelError, match=name) as e:
            convert_gguf(tmp_path / name, tmp_path / "out", progress=False)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the cache


def test_gguf_is_converted_once_and_cached_by_content(tiny, cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny[0].read_bytes())
    first = resolve_model(str(path))
    root = cache / "models" / f"v{model_store.CONVERTER_VERSION}" / "gguf"
    assert first == root / gguf_identity(path) / "model"  # named by its stem: the served name
    assert all((first / f).is_file() for f in FIVE_FILES)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.parent.iterdir()) == ["model", "source"]  # no work folder left

    os.utime(path, ns=(stamp, stamp + 10**9))  # `touch`: the same content, the same conversion
    assert resolve_model(str(path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    data = bytearray(path.read_bytes())  # changed content: converted again, the old one removed
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    second = resolve_model(str(path))
    assert second != first and second.name == "model" and not first.parent.exists()
    assert [p.name for p in root.iterdir()] == [second.parent.name]


def test_failed_conversion_leaves_nothing_behind(tmp_path, cache):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError):
        resolve_model(str(tmp_path / "junk.gguf"))
    assert list(model_store.models_dir().iterdir()) == []


def test_a_new_converter_version_converts_again_and_frees_the_old(tiny, cache, monkeypatch):
    old = resolve_model(str(tiny[0]))
    monkeypatch.setattr(model_store, "CONVERTER_VERSION", model_store.CONVERTER_VERSION + 1)
    new = resolve_model(str(tiny[0]))
    assert new != old and new.name == old.name and (new / "model.safetensors").is_file()
    assert not old.exists() and resolve_model(str(tiny[0])) == new


def test_abandoned_work_folders_are_removed(tiny, cache):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    folder = model_store.models_dir() / "gguf" / gguf_identity(tiny[0])
    abandoned = folder / f".{tiny[0].stem}.{dead}.x1"
    alive = folder / f".{tiny[0].stem}.{os.getpid()}.x2"
    for work in (abandoned, alive):
        (work / "model").mkdir(parents=True)
    resolve_model(str(tiny[0]))
    assert not abandoned.exists() and alive.exists()


def test_resolve_model_inputs(tiny, cache, tmp_path):
    assert resolve_model(str(tiny[2])) == tiny[2]  # an HF folder is itself
    for missing in (tmp_path / "missing.gguf", tmp_path / "no-such-folder", "./nothing"):
        with pytest.raises(ModelError, match=f"^{re.escape(str(missing))}: not found$"):
            resolve_model(str(missing))
    with pytest.raises(ModelError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_cache_dir_environment(monkeypatch, tmp_path):
    from ringserve.gpu.loader.model_store import cache_dir
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("RINGSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ringserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ringserve"


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return next(f"blk.{layer}.{g}" for g, (hf, _) in LAYER_TENSORS.items() if hf == rest)
