"""Make tests/data/spm_tokens.json: a small SentencePiece BPE vocabulary of Gemma's kind and the
ids SentencePiece itself gives a set of varied strings, for gpu/loader/gguf_convert.py's
tokenizer of a GGUF ``tokenizer.ggml.model`` "llama" vocabulary (Gemma 3's, Llama 2's) to match.

Run once, offline, with a Python that has sentencepiece (ringserve never imports it):

    python -m venv /tmp/spm && /tmp/spm/bin/pip install sentencepiece
    PYTHONPATH=<a folder linking ringserve to this checkout> /tmp/spm/bin/python tools/make_spm_reference.py

The model is trained here (sentencepiece's trainer, BPE) on tools/random_gguf.py sample_texts
with Gemma's settings: byte fallback, digits split, no dummy prefix, no normalization, whitespace
kept as it is; plus Gemma's turn markers as user-defined symbols. Stored: each piece with its
score and llama.cpp's token type (as convert_hf_to_gguf.py's _set_vocab_sentencepiece derives
them), and for each of 200 other sample strings the ids SentencePiece encodes it to.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "spm_tokens.json"
VOCAB_SIZE = 1200
# llama.cpp's token types (gguf-py's TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def main() -> None:
    import sentencepiece as spm

    from ringserve.tools.random_gguf import sample_texts

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts(3000, seed=1)), model_writer=model, vocab_size=VOCAB_SIZE,
        model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=0.9995,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = []
    for i in range(sp.get_piece_size()):
        kind = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                else BYTE if sp.is_byte(i) else NORMAL)
        if kind == NORMAL and sp.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>"):
            kind = USER_DEFINED
        pieces.append([sp.id_to_piece(i), sp.get_score(i), kind])
    texts = sample_texts(200, seed=7) + ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
                                         "  two leading spaces", "tabs\t\tand\nnewlines\n\n", "ümlaut ß 日本"]
    OUT.write_text(json.dumps({
        "sentencepiece": spm.__version__, "pieces": pieces,
        "bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "unk_token_id": sp.unk_id(),
        "padding_token_id": sp.pad_id(),
        "cases": [[t, sp.encode(t)] for t in texts]}, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB, {len(pieces)} pieces)", file=sys.stderr)


if __name__ == "__main__":
    main()
