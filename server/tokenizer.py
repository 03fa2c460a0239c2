"""The tokenizer of an HF-layout model folder: tokenizer.json through the `tokenizers` library,
the chat template of tokenizer_config.json rendered with jinja2 the way transformers renders it,
and an incremental detokenizer for streaming.

    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    stream = tok.decode_stream()
    text = "".join(stream.step(i) for i in generated_ids)
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers.decoders import DecodeStream

GIL_FREE_CHARS = 1 << 14  # texts at least this long are encoded without the GIL


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its raise_exception), or there is no template."""


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time. While a multi-byte UTF-8 character
    is split across tokens, step() returns "" and the character comes whole with its last byte."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, int(token_id)) or ""


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any]):
        self._tokenizer = tokenizer
        self._config = config
        self.chat_template: str | None = _chat_template(config.get("chat_template"))
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        self.eos_token_id: int | None = self._id_of(self.eos_token)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # What one token can stand for, to bound a text's tokens by its bytes (None: unknown).
        self.token_bytes: TokenBytes | None = _token_bytes(tokenizer)

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """chat_template: the template to use in place of the folder's (--chat-template)."""
        model_dir = Path(model_dir)
        tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        if chat_template is not None:
            config["chat_template"] = chat_template
        if config.get("chat_template") is None:
            config["chat_template"] = _template_file(model_dir)
        return cls(tokenizer, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are always
        recognised; ``add_special_tokens`` is about the ones the tokenizer adds itself (a BOS).

        A long text is encoded without the GIL, so that encoding it in a thread does not stop
        the event loop (a 1 MB prompt takes 1-3 s)."""
        if len(text) < GIL_FREE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # NOTE: `encode` holds the GIL throughout; `encode_batch` releases it.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from its bytes alone (0: none known)."""
        return 0 if self.token_bytes is None else self.token_bytes.min_tokens(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tokenizer, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The prompt text for ``messages``, rendered as transformers' apply_chat_template does.
        ``extra`` reaches the template too (``tools``, ...). Raises ChatTemplateError."""
        template = self._template
        if template is None:
            raise ChatTemplateError("this model has no chat template")
        specials = {k: _token_text(v) for k, v in self._config.items()
                    if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **specials, **extra)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None

    @cached_property
    def _template(self) -> jinja2.Template | None:
        """The compiled chat template (None: the model has none)."""
        if self.chat_template is None:
            return None
        # The environment of transformers' _compile_jinja_template: a sandbox, trimmed blocks,
        # loop controls, raise_exception(), strftime_now() and a tojson that keeps non-ASCII text.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None

    def to_json(self) -> str:
        """The tokenizer.json text: what the grammar compiler's processes build llguidance's
        view of the tokenizer from (server/grammar_compiler.py)."""
        return self._tokenizer.to_str()

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)


# Pre-tokenizers that split text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "Sequence"}


@dataclass(frozen=True)
class TokenBytes:
    """How many bytes of text one token stands for at most, and the bytes no token spells
    (dropped from the text: SmolLM2's byte-level vocabulary lacks 21 of the 256)."""
    most: int
    unspelled: bytes

    def min_tokens(self, text: str) -> int:
        data = text.encode()
        kept = len(data.translate(None, self.unspelled)) if self.unspelled else len(data)
        return -(-kept // self.most)


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for the bytes, in byte order (byte-level BPE vocabularies
    are written in them)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _token_bytes(tokenizer: tokenizers.Tokenizer) -> TokenBytes | None:
    """Bounds that hold when each byte of the text either ends up in a token or in none: a BPE
    with no normalizer (which may rewrite text), pre-tokenizers that only split, and every byte
    spelled by the vocabulary (byte-level) or by a byte token (byte fallback, all 256 of them).
    None otherwise (WordPiece's one [UNK] may stand for a whole word)."""
    model = tokenizer.model
    if tokenizer.normalizer is not None or not isinstance(model, tokenizers.models.BPE):
        return None
    parts: list[dict] = []
    if tokenizer.pre_tokenizer is not None:
        pre = json.loads(tokenizer.pre_tokenizer.__getstate__())
        parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in parts):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    added = max((len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values()),
                default=1)
    if any(p.get("type") == "ByteLevel" for p in parts):
        # Each character of a byte-level token is one byte; a byte whose character is not a token
        # of its own cannot start a BPE word: it is dropped (no unknown token in such a model).
        unspelled = bytes(b for b, c in enumerate(byte_level_alphabet()) if c not in vocab)
        return TokenBytes(max(max(map(len, vocab), default=1), added), unspelled)
    if model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return TokenBytes(max(max((len(t.encode()) for t in vocab), default=1), added), b"")
    return None


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token: Any) -> str | None:
    """tokenizer_config.json writes a token either as its text or as an AddedToken object."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _template_file(model_dir: Path) -> Any:
    """The chat template saved beside tokenizer_config.json, as transformers >= 4.43 saves it
    (chat_template.jinja; a processor's chat_template.json, as Gemma 3 4B-27B ship), or None."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    processor = model_dir / "chat_template.json"
    if processor.is_file():
        return json.loads(processor.read_text(encoding="utf-8")).get("chat_template")
    return None


def _chat_template(template: Any) -> str | None:
    """A template string, or the "default" one of a list of named templates."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None
