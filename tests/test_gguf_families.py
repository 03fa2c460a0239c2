"""GGUFs of the Llama 3.x and Qwen2 / Qwen2.5 families (gpu/loader/gguf_convert.py): llama3 rope
scaling from the rope_freqs tensor, qwen2's q/k/v biases and unpermuted q/k, their
pre-tokenizers, and what the converter still refuses. The files are tools/random_gguf.py's
(random weights, a trained byte-level BPE vocabulary); tests/data/gguf_peer_tokens.json holds
llama-server's token ids for them (tools/check_gguf_peer.py --record)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.gguf_convert import convert_gguf, llama3_rope_scaling
from ringserve.gpu.loader.weights import load_weights
from ringserve.gpu.rope import inv_freq
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.llm import LLM
from ringserve.server.tokenizer import Tokenizer
from ringserve.tools.check_gguf_peer import SHAPES
from ringserve.tools.random_gguf import Shape, llama3_rope_freqs, write_random_gguf

PEER = json.loads((Path(__file__).parent / "data" / "gguf_peer_tokens.json").read_text(encoding="utf-8"))


def _shape(arch: str, **kw) -> Shape:
    """The peer check's shape of the family (head_dim 64, whole Q4_K rows, the recorded vocabulary)."""
    return Shape(**{**SHAPES[arch].__dict__, **kw})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> (gguf path, converted folder), each written once with the recorded vocabulary."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            write_random_gguf(root / f"{arch}.gguf", _shape(arch), "q4_k_m", seed=3, progress=False,
                              arch=arch, merges=PEER["merges"])
            made[arch] = (root / f"{arch}.gguf",
                          convert_gguf(root / f"{arch}.gguf", root / "m", progress=False))
        return made[arch]
    return get


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_tokenizer_gives_llama_servers_ids(family, arch):
    """Pre-tokenizer regex and BPE (llama3: whole pieces first, ignore_merges) as llama.cpp's:
    the ids llama-server's /tokenize gave for the same vocabulary, on digits, CJK, emoji,
    whitespace runs, contractions, code and special tokens."""
    tok = Tokenizer.from_dir(family(arch)[1])
    expected = PEER["llama_server_ids"][arch]
    assert len(expected) == len(PEER["texts"]) >= 100
    got = [tok.encode(text, add_special_tokens=False) for text in PEER["texts"]]
    wrong = [(text, g, e) for text, g, e in zip(PEER["texts"], got, expected, strict=True) if g != e]
    assert wrong == []


def test_the_recorded_strings_tell_the_two_families_apart():
    """What the ids above pin down, as llama-server gave them: llama3 keeps up to three digits
    together, qwen2 one; llama3 takes a piece that is a token whole (ignore_merges: " serverless"
    is in the vocabulary, no merge builds it), qwen2 merges it by rank."""
    ids = PEER["llama_server_ids"]
    at = PEER["texts"].index("12345678901")
    assert len(ids["qwen2"][at]) == 11 and len(ids["llama3"][at]) < 11
    at = PEER["texts"].index(" serverless")
    assert len(ids["llama3"][at]) == 1 and len(ids["qwen2"][at]) > 1


@pytest.mark.parametrize("arch, bos, eos, add_bos", [
    ("llama3", "<|begin_of_text|>", "<|eot_id|>", True),
    ("qwen2", "<|endoftext|>", "<|im_end|>", False),
])
def test_special_tokens_and_chat_template_come_from_the_metadata(family, arch, bos, eos, add_bos):
    folder = family(arch)[1]
    tok = Tokenizer.from_dir(folder)
    assert (tok.bos_token, tok.eos_token) == (bos, eos)
    ids = tok.encode("Hi")
    assert (ids[0] == tok.bos_token_id) is add_bos
    config = ModelConfig.from_dir(folder)
    assert config.eos_token_ids == (tok.eos_token_id,) and config.bos_token_id == tok.bos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    turn = "<|start_header_id|>user<|end_header_id|>" if arch == "llama3" else "<|im_start|>user\nHi"
    assert turn in prompt


def test_llama3_adds_bos_when_the_metadata_does_not_say(tmp_path):
    """llama.cpp's default for the llama-bpe pre-tokenizer (tokenizer.ggml.add_bos_token absent)."""
    path = tmp_path / "nobos.gguf"
    write_random_gguf(path, _shape("llama3", layers=1, vocab=300), "q8_0", progress=False, arch="llama3",
                      merges=PEER["merges"][:30], metadata={"tokenizer.ggml.add_bos_token": None})
    tok = Tokenizer.from_dir(convert_gguf(path, tmp_path / "m", progress=False))
    assert tok.encode("Hi")[0] == tok.bos_token_id


# ----------------------------------------------------------------------------- llama3 rope


def transformers_llama3(head_dim: int, theta: float, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """transformers' _compute_llama3_parameters, written out element by element in float64."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, original", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),     # Llama 3.1 8B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),     # Llama 3.2 1B
    (128, 500000.0, 32.0, 1.0, 4.0, 8192),    # Llama 3.2 3B
    (32, 500000.0, 32.0, 1.0, 4.0, 8192),     # one pair between the bounds: Llama 3's own tried
    (64, 10000.0, 16.0, 1.0, 2.0, 4096),      # other bounds, fitted
    (64, 10000.0, 4.0, 2.0, 8.0, 8192),       # low_freq_factor 2: an equivalent (low 1) config
])
def test_llama3_rope_from_rope_freqs_equals_transformers(head_dim, theta, factor, low, high, original):
    """llama.cpp divides each frequency by rope_freqs (written as its converter writes it);
    the config.json we derive from that tensor makes gpu/rope.py compute transformers' llama3
    frequencies, and llama.cpp's, to float32 rounding."""
    rope_freqs = llama3_rope_freqs(head_dim, theta, factor, low, high, original)
    scaling = llama3_rope_scaling(rope_freqs, theta, head_dim, Path("x.gguf"))
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    if low == 1.0:
        assert (scaling["high_freq_factor"], scaling["original_max_position_embeddings"]) == (high, original)
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": head_dim,
        "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "rope_theta": theta, "rope_scaling": scaling})
    ours = inv_freq(config)
    expected = transformers_llama3(head_dim, theta, factor, low, high, original)
    np.testing.assert_allclose(ours, expected, rtol=2e-6)
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(ours, plain / rope_freqs, rtol=2e-6)
    assert not np.allclose(ours, plain, rtol=1e-3)   # the scaling is not a no-op


def test_llama3_gguf_converts_to_llama3_rope_scaling(family):
    path, folder = family("llama3")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["attention_bias"] is False
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    weights = load_weights(folder)
    assert not any("rope" in name for name in weights)   # the tensor became the config


# ----------------------------------------------------------------------------- qwen2


def test_qwen2_gguf_keeps_biases_and_qk_rows_as_stored(family):
    path, folder = family("qwen2")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["attention_bias"] is True
    assert config["rope_theta"] == 1e6 and config["rope_scaling"] is None
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    weights = load_weights(folder)
    for part in "qkv":
        bias = weights[f"model.layers.1.self_attn.{part}_proj.bias"]
        np.testing.assert_array_equal(bias, stored[f"blk.1.attn_{part}.bias"].data)
    # NEOX rope in llama.cpp is HF's rotate_half: q/k rows are not permuted, their blocks kept
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.ggml_type == stored["blk.0.attn_q.weight"].tensor_type.name
    assert np.array_equal(q.raw, stored["blk.0.attn_q.weight"].data)


# ----------------------------------------------------------------------------- qwen3


def test_a_random_qwen3_gguf_converts_and_generates(tmp_path, monkeypatch):
    """tools/random_gguf.py --arch qwen3 (as speed runs write it: Q4_K_M, head_dim 128 where
    hidden / heads is 64): the converter keeps q/k rows and the F32 q/k norms as stored, and
    the whole engine generates from the file."""
    path = tmp_path / "qwen3.gguf"
    shape = _shape("qwen2", head_dim=128)
    types = write_random_gguf(path, shape, "q4_k_m", seed=3, progress=False, arch="qwen3",
                              merges=PEER["merges"])
    assert types["blk.0.attn_q_norm.weight"] == "F32" and types["blk.0.attn_q.weight"] == "Q4_K"
    folder = convert_gguf(path, tmp_path / "m", progress=False)
    config = ModelConfig.from_dir(folder)
    assert (config.architecture, config.head_dim, config.qk_norm) == ("Qwen3ForCausalLM", 128, True)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    weights = load_weights(folder)
    for part in "qk":
        np.testing.assert_array_equal(weights[f"model.layers.1.self_attn.{part}_norm.weight"],
                                      stored[f"blk.1.attn_{part}_norm.weight"].data)
    assert np.array_equal(weights["model.layers.0.self_attn.k_proj.weight"].raw,
                          stored["blk.0.attn_k.weight"].data)
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    out = LLM(model=str(path), max_model_len=64).generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


# ----------------------------------------------------------------------------- generating


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_family_generates_through_llm(family, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(model=str(family(arch)[0]), max_model_len=128)
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                               logprobs=2))[0]
    tok = Tokenizer.from_dir(family(arch)[1])
    assert list(out.prompt_token_ids) == tok.encode("The quick brown fox")
    got = out.outputs[0]
    assert len(got.token_ids) == 4 and all(np.isfinite(lp[t].logprob)
                                           for lp, t in zip(got.logprobs, got.token_ids, strict=True))


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_family_is_served(family, arch, serve, tmp_path, monkeypatch):
    """`ringserve serve --model x.gguf`: chat through the GGUF's own template and specials."""
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    path, folder = family(arch)
    server = serve(path, "--workers", "1", "--max-model-len", "128", "--device", "cpu",
                   "--drain-timeout", "2", timeout=300)
    # converted by `ringserve download`'s process: the launcher, alive as long as the server,
    # imported neither gguf nor numpy (server/launch.py _model_folder)
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        assert "_multiarray_umath" not in maps.read()
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3,
        "temperature": 0})
    assert r.status_code == 200, r.text
    tok = Tokenizer.from_dir(folder)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi there"}]),
                        add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    assert prompt.count(tok.bos_token_id) == (1 if arch == "llama3" else 0)   # the template's BOS, once
    r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "12345 日本語"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("12345 日本語")


# ----------------------------------------------------------------------------- refused, by name


@pytest.mark.parametrize("arch, metadata, message", [
    ("qwen2", {"general.architecture": "phimoe"}, "GGUF architecture 'phimoe' is not supported"),
    ("llama3", {"tokenizer.ggml.pre": "tekken"}, "tokenizer.ggml.pre 'tekken' is not supported"),
    ("qwen2", {"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
    ("qwen2", {"tokenizer.ggml.model": "llama"}, "missing GGUF metadata tokenizer.ggml.scores"),
    ("qwen2", {"qwen2.block_count": None}, "missing GGUF metadata qwen2.block_count"),
    ("qwen2", {"qwen2.block_count": "two"}, "qwen2.block_count 'two' must be a positive integer"),
    ("qwen2", {"qwen2.embedding_length": 0}, "qwen2.embedding_length 0 must be a positive integer"),
    ("qwen2", {"qwen2.attention.layer_norm_rms_epsilon": "tiny"}, "layer_norm_rms_epsilon 'tiny' must be"),
    ("qwen2", {"qwen2.rope.freq_base": -1.0}, "qwen2.rope.freq_base -1.0 must be a positive number"),
    ("qwen2", {"qwen2.rope.scaling.type": "yarn"}, "qwen2.rope.scaling.type 'yarn' is not supported"),
    ("llama3", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
     "rope_freqs.weight together with linear rope scaling"),
    ("qwen2", {"qwen2.expert_count": 8}, "qwen2.expert_count"),
    ("qwen2", {"tokenizer.ggml.tokens": None}, "missing GGUF metadata tokenizer.ggml.tokens"),
    ("qwen2", {"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens must be a list of strings"),
    ("qwen2", {"tokenizer.ggml.merges": "ab"}, "tokenizer.ggml.merges has 'ab', not 'left right'"),
    ("qwen2", {"tokenizer.ggml.token_type": 1}, "tokenizer.ggml.token_type must be one integer per token"),
    ("qwen2", {"tokenizer.ggml.eos_token_id": 5000}, "eos_token_id 5000 is outside the vocabulary of 300"),
    ("llama3", {"tokenizer.ggml.bos_token_id": "x"}, "bos_token_id 'x' must be a token id"),
])
def test_odd_or_missing_metadata_is_one_line(tmp_path, arch, metadata, message):
    path = tmp_path / "odd.gguf"
    write_random_gguf(path, _shape(arch, layers=1, vocab=300), "q8_0", progress=False, arch=arch,
                      merges=PEER["merges"][:30], metadata=metadata)
    with pytest.raises(ModelError, match=message) as e:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rope_freqs, message", [
    (np.ones(5, np.float32), "must be 32 finite factors"),
    (np.full(32, np.nan, np.float32), "must be 32 finite factors"),
    (np.linspace(0.5, 2, 32).astype(np.float32), "must be 32 finite factors >= 1"),
    (np.random.default_rng(0).uniform(1, 8, 32).astype(np.float32), "is not llama3 rope scaling"),
])
def test_rope_freqs_that_are_not_llama3_are_refused(rope_freqs, message):
    with pytest.raises(ModelError, match=message):
        llama3_rope_scaling(rope_freqs, 500000.0, 64, Path("x.gguf"))


def test_a_qwen2_file_without_its_biases_is_refused(tmp_path):
    """A qwen2 file must have them (tools/tiny_gguf writes none)."""
    from ringserve.tools.tiny_gguf import make_tiny_gguf
    make_tiny_gguf(tmp_path / "nobias.gguf", arch="qwen2", num_layers=1)
    with pytest.raises(ModelError, match=r"missing tensor for model\.layers\.0\.self_attn\.[qkv]_proj\.bias"):
        convert_gguf(tmp_path / "nobias.gguf", tmp_path / "out", progress=False)


def test_rope_freqs_must_be_float32(tmp_path):
    from ringserve.tools.tiny_gguf import make_tiny_gguf
    make_tiny_gguf(tmp_path / "f16.gguf", num_layers=1,
                   extra_tensors={"rope_freqs.weight": np.ones(8, np.float16)})
    with pytest.raises(ModelError, match="rope_freqs.weight must be whole F32 .is F16."):
        convert_gguf(tmp_path / "f16.gguf", tmp_path / "out", progress=False)

