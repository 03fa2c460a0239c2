"""tools/perplexity.py: llama-perplexity's windows, and a perplexity that is the dense reference
model's over the same windows (tests/reference_llama.py, numpy float64), on the tiny model and a
slice of the default text."""
from __future__ import annotations

import math

import numpy as np
import pytest

from reference_llama import reference_logits  # pytest puts tests/ on sys.path
from ringserve.gpu.loader.weights import load_weights
from ringserve.tools import perplexity as ppl
from ringserve.tools.cli import main as cli

CTX = 32


def test_windows_are_llama_perplexitys():
    """len // ctx windows that do not overlap, BOS first where the tokenizer adds one, the second
    half scored: ctx - ctx/2 - 1 predictions a window; --ppl-stride windows every S tokens."""
    ids = list(range(100, 190))                  # 90 tokens: 2 windows of 40 and 10 left over
    wins = ppl.windows(ids, 40, bos=1)
    assert [w.token_ids for w in wins] == [[1, *ids[1:40]], [1, *ids[41:80]]]
    assert [w.first for w in wins] == [20, 20] and [w.num_scored for w in wins] == [19, 19]
    assert [w.token_ids for w in ppl.windows(ids, 40, bos=None)] == [ids[:40], ids[40:80]]
    assert len(ppl.windows(ids, 40, bos=None, max_windows=1)) == 1
    strided = ppl.windows(ids, 40, bos=1, stride=16)
    assert [w.token_ids[0] for w in strided] == [100, 116, 132, 148]   # no BOS, as llama.cpp decodes
    assert all(w.num_scored == 16 for w in strided)
    with pytest.raises(ValueError, match="needs at least 80"):
        ppl.windows(ids[:79], 40, bos=None)
    with pytest.raises(ValueError, match="--stride"):
        ppl.windows(ids, 40, bos=None, stride=40)


def test_perplexity_is_the_dense_references(tiny_model_dir):
    """The tool's logprobs (prompt_logprobs through LLM) and perplexity against log-softmax of
    the reference logits at the scored positions, exp of their mean NLL computed here."""
    text = ppl.default_text()[:3000]
    result = ppl.evaluate(str(tiny_model_dir), "float32", text, CTX, max_windows=3, device="cpu")
    from ringserve.server.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    wins = ppl.windows(tokenizer.encode(text), CTX, ppl.bos_to_add(tokenizer), max_windows=3)
    weights = load_weights(tiny_model_dir)
    expected = []
    for w in wins:
        logits = reference_logits(tiny_model_dir, weights, w.token_ids)
        logits = logits - logits.max(axis=-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        rows = np.arange(w.first, CTX - 1)
        expected.append(logprobs[rows, np.asarray(w.token_ids)[rows + 1]])
    expected_lp = np.concatenate(expected)
    assert result.num_scored == len(expected_lp) == 3 * (CTX - CTX // 2 - 1)
    np.testing.assert_allclose(result.logprobs, expected_lp, atol=2e-4)
    assert result.perplexity == pytest.approx(math.exp(-expected_lp.mean()), rel=1e-4)
    nll = -expected_lp
    stderr = nll.std() / math.sqrt(len(nll) - 1) * math.exp(nll.mean())
    assert result.stderr == pytest.approx(stderr, rel=1e-3)
    # the ratio against another result over the same tokens, and the paired ± of its differences
    shifted = ppl.Result("m", "auto", result.logprobs - np.linspace(0, 0.02, len(nll)))
    value, err = ppl.ratio(shifted, result)
    assert value == pytest.approx(shifted.perplexity / result.perplexity, rel=1e-12)
    assert err == pytest.approx(value * np.linspace(0, 0.02, len(nll)).std() / math.sqrt(len(nll) - 1))


def test_command_prints_the_table_with_the_ratio(tiny_model_dir, tmp_path, capsys):
    """`ringserve perplexity` over a text file: one row per activation dtype, the ratio against float32's (the
    tiny model's weights are float32, so both rows run the same kernels and the ratio is 1)."""
    text = tmp_path / "text.txt"
    text.write_text(ppl.default_text()[3000:6000], encoding="utf-8")
    dump = tmp_path / "same.txt"
    assert cli(["perplexity", "--model", str(tiny_model_dir), "--text", str(text), "--ctx", str(CTX),
                     "--chunks", "2", "--write-text", str(dump)]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(f"| {tiny_model_dir.name}")]
    assert [r[2].strip() for r in rows] == ["auto", "float32"]
    assert [int(r[3]) for r in rows] == [2 * (CTX - CTX // 2 - 1)] * 2
    assert [r[5].strip() for r in rows] == ["1.0000 ± 0.0000", "1.0000 ± 0.0000"]
    assert dump.read_text(encoding="utf-8") == text.read_text(encoding="utf-8")


def test_a_text_too_short_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("only a few words", encoding="utf-8")
    assert ppl.main(["--model", str(tiny_model_dir), "--text", str(text), "--ctx", str(CTX)]) == 2
    assert f"a context of {CTX} needs at least {2 * CTX}" in capsys.readouterr().err
