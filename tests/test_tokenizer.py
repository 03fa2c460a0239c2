"""The tokenizer (server/tokenizer.py) on the real default model, against transformers' ids stored
in tests/data by tools/make_reference_logits.py, and llama.cpp's 'smollm' pre-tokenizer rules."""
from __future__ import annotations

import json
import unicodedata
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.server.tokenizer import ChatTemplateError, Tokenizer, byte_level_alphabet

REFERENCE = Path(__file__).parent / "data" / "smollm2_reference.npz"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def ref():
    with np.load(REFERENCE) as data:
        return {k: data[k] for k in data.files}


def ragged(ref, ids: str, lens: str) -> list[list[int]]:
    return [a.tolist() for a in np.split(ref[ids], np.cumsum(ref[lens])[:-1])]


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def numeric_after_whitespace(text: str) -> bool:
    return any(a.isspace() and unicodedata.category(b).startswith("N") for a, b in pairwise(text))


def test_ids_equal_llama_cpp_smollm_pretokenization_by_transformers(tok, ref):
    """transformers' BPE over llama.cpp's digit pre-split gives exactly our ids, on every string."""
    expected_ids = ragged(ref, "tokenizer_ids_smollm", "tokenizer_lens_smollm")
    for text, expected in zip(ref["tokenizer_strings"], expected_ids, strict=True):
        assert tok.encode(str(text), add_special_tokens=False) == expected, repr(text)


def test_ids_equal_transformers_gguf_tokenizer_except_digit_split(tok, ref):
    """transformers builds this GGUF's tokenizer without the 'smollm' digit split, so it differs
    from us (and llama.cpp) only where whitespace precedes a numeric character."""
    differ = []
    expected_ids = ragged(ref, "tokenizer_ids", "tokenizer_lens")
    for text, expected in zip(ref["tokenizer_strings"], expected_ids, strict=True):
        text = str(text)
        if tok.encode(text, add_special_tokens=False) != expected:
            assert numeric_after_whitespace(text), repr(text)
            differ.append(text)
    assert "a  1" in differ and "a 1" not in differ
    assert len(differ) < len(ref["tokenizer_strings"]) / 3


def test_prompt_ids_and_chat_template_match_transformers(tok, ref):
    texts = [str(t) for t in ref["prompt_texts"]]
    for text, expected in zip(texts, ragged(ref, "prompt_ids", "prompt_lens"), strict=True):
        assert tok.encode(text) == expected
    messages = [{"role": "user", "content": str(ref["chat_messages_user"][0])}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == texts[-1]


def test_digits_are_split_one_by_one(tok):
    assert pieces(tok, tok.encode("12345678901234567890")) == list("12345678901234567890")
    assert pieces(tok, tok.encode("in 2024, 3.14")) == [
        "in", " ", "2", "0", "2", "4", ",", " ", "3", ".", "1", "4"]
    assert pieces(tok, tok.encode("x½²")) == ["x", "½", "²"]


@pytest.mark.parametrize("n", range(2, 9))
def test_runs_of_spaces_as_llama_cpp_smollm(tok, n):
    # GPT-2 regex: a run before a word leaves its last space to the word (\s+(?!\S));
    # before a digit the digit was split off first, so the whole run stays one piece.
    assert pieces(tok, tok.encode("a" + " " * n + "b")) == ["a", " " * (n - 1), " b"]
    assert pieces(tok, tok.encode("a" + " " * n + "7")) == ["a", " " * n, "7"]
    assert pieces(tok, tok.encode("a" + " " * n)) == ["a", " " * n]


def test_whitespace_and_specials(tok):
    # The GPT-2 regex leaves a run's last whitespace to the next \s+ unless a digit was split off.
    assert pieces(tok, tok.encode("\tx\n\ny")) == ["\t", "x", "\n", "\n", "y"]
    assert pieces(tok, tok.encode("x\n\n7")) == ["x", "\n\n", "7"]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == tok.bos_token_id == 1 and ids[-1] == tok.eos_token_id == 2
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.vocab_size == 49152
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_chat_template_options(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_chat_template_raise_exception_and_specials():
    base = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
                "{{ eos_token }}")
    tok = Tokenizer(base, {"chat_template": template, "bos_token": "<s>",
                           "eos_token": {"content": "</s>", "special": True}})
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"</s>'
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(base, {}).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def spellable(default_model_dir):
    """Whether the vocabulary can spell a character: SmolLM2's byte-level vocabulary lacks 21 of
    the 256 bytes (0x04, 0xC0, 0xF1, ...), as in the original tokenizer.json; text using them
    loses those bytes, in transformers as here."""
    vocab = json.loads((default_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    missing = {b for b, c in enumerate(byte_level_alphabet()) if c not in vocab}
    assert len(missing) == 21
    return lambda ch: not missing.intersection(ch.encode("utf-8"))


def any_text(spellable, max_size: int, exclude: str = ""):
    chars = st.characters(blacklist_categories=("Cs",), blacklist_characters=exclude).filter(spellable)
    return st.text(alphabet=chars, max_size=max_size)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_round_trip_of_any_text(tok, spellable, data):
    text = data.draw(any_text(spellable, 80))
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_bytes_outside_the_vocabulary_are_dropped(tok, spellable):
    assert not spellable("\x04") and not spellable("\U00040000") and spellable("😀")
    assert tok.decode(tok.encode("a\x04b")) == "ab"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_incremental_detokenizer_equals_full_decode(tok, spellable, data):
    text = data.draw(any_text(spellable, 60, exclude="\ufffd"))
    ids = tok.encode(text)
    stream = tok.decode_stream()
    steps = [stream.step(i) for i in ids]
    assert "".join(steps) == tok.decode(ids) == text
    assert not any("\ufffd" in s for s in steps)  # never a broken character


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(3, 49151), max_size=16))
def test_incremental_detokenizer_on_any_ids(tok, ids):
    """Model output need not be valid UTF-8: the stream then agrees with the full decode."""
    stream = tok.decode_stream()
    streamed = "".join(stream.step(i) for i in ids)
    full = tok.decode(ids)
    assert full.startswith(streamed)
    assert streamed == full or full.endswith("\ufffd")  # only a still-incomplete tail is held back


def test_multibyte_character_split_across_tokens(tok):
    ids = tok.encode("a😀b")
    assert len(ids) == 5  # the emoji takes three tokens
    stream = tok.decode_stream()
    assert [stream.step(i) for i in ids] == ["a", "", "", "😀", "b"]
    stream = tok.decode_stream(skip_special_tokens=True)
    chat = tok.encode("<|im_start|>assistant\nhé<|im_end|>")
    assert "".join(stream.step(i) for i in chat) == tok.decode(chat) == "assistant\nhé"


def test_min_tokens_bounds_the_token_count_from_below(tok, spellable):
    """A prompt is refused by its bytes alone when even its fewest possible tokens exceed the
    context (server/context.py encode_prompt): the bound must never exceed the true count, also
    for the longest tokens repeated and for bytes the vocabulary cannot spell (dropped)."""
    tb = tok.token_bytes
    assert tb is not None and tb.most == 81 and len(tb.unspelled) == 21
    longest = max(tok._tokenizer.get_vocab(), key=len)
    alphabet = {c: b for b, c in enumerate(byte_level_alphabet())}
    longest_text = bytes(alphabet[c] for c in longest).decode()
    texts = [longest_text * 1000, " " * 100_000, "\n" + " " * 80, "1" * 5000, "\x04" * 5000 + "hi",
             "<|im_start|>" * 300, "😀" * 1000, "hello world " * 2000, "é\x04" * 100]
    for text in texts:
        n = len(tok.encode(text))
        assert tok.min_tokens(text) <= n, (text[:20], tok.min_tokens(text), n)
    assert tok.min_tokens(longest_text * 1000) == len(tok.encode(longest_text * 1000)) == 1000


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_min_tokens_of_any_text(tok, data):
    text = data.draw(st.text(max_size=300))
    assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))


def test_no_byte_bound_where_a_token_may_stand_for_any_text():
    """WordPiece's [UNK] is a whole word; a normalizer may drop text: no bound, no refusal."""
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert Tokenizer(wordpiece, {}).min_tokens("x" * 10_000) == 0
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0}, []))
    bpe.normalizer = tokenizers.normalizers.Strip()
    assert Tokenizer(bpe, {}).min_tokens(" " * 10_000) == 0
