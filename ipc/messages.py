"""Wire messages between an engine client (server/) and an engine process, one ring record each.

Binary and compact (DESIGN.md §3): token ids travel as raw native int32 (both ends are on the
same host), logprobs as raw float32. Only the small sampling-parameter dict is msgpack.

Worker -> engine records: :class:`AddRequest`, :class:`Abort` (``encode_request``/``decode_request``).
Engine -> worker record: one list of :class:`Output` per step (``encode_outputs``/``decode_outputs``).
Every record starts with a one-byte kind.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec
import numpy as np

KIND_ADD, KIND_ABORT, KIND_OUTPUTS = 1, 2, 3

FINISH_REASONS: tuple[str | None, ...] = (None, "stop", "length", "abort", "error")
_FINISH_CODE = {r: i for i, r in enumerate(FINISH_REASONS)}

# kind, pad, n_tokens, id_len, params_len
_ADD = struct.Struct("<B3xIII")
# kind, pad, id_len
_ABORT = struct.Struct("<B3xI")
# kind, pad, n_outputs
_OUTPUTS = struct.Struct("<B3xI")
# id_len, index, finish code, flags, n_tokens, num_prompt_tokens, top_n, stop_reason, err_len
_ITEM = struct.Struct("<HHBB2xIIIiI")
_HAS_LOGPROBS, _HAS_STOP_REASON = 1, 2

_msgpack_encode = msgspec.msgpack.Encoder().encode
_msgpack_decode = msgspec.msgpack.Decoder(dict).decode


def _int32_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(ids, np.ndarray):
        return np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    return array("i", ids).tobytes()


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields by name


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Output:
    """What one step produced for one request (one of its ``n`` samples: ``index``)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None        # None while running; "stop" | "length" | "abort" | "error"
    index: int = 0
    num_prompt_tokens: int = 0
    stop_reason: int | None = None          # the stop token id that ended it, if any
    # When logprobs were asked: one float per new token (the sampled token's logprob), and the
    # top-N alternatives as [len(new_token_ids), N] arrays.
    logprobs: list[float] | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- worker -> engine ------------------------------------------------------------------


def encode_request(msg: AddRequest | Abort) -> bytes:
    rid = msg.request_id.encode()
    if isinstance(msg, Abort):
        return _ABORT.pack(KIND_ABORT, len(rid)) + rid
    tokens = _int32_bytes(msg.prompt_token_ids)
    params = _msgpack_encode(msg.params)
    return b"".join((_ADD.pack(KIND_ADD, len(tokens) // 4, len(rid), len(params)), tokens, rid, params))


def decode_request(buf: bytes) -> AddRequest | Abort:
    kind = buf[0]
    if kind == KIND_ABORT:
        _, id_len = _ABORT.unpack_from(buf)
        return Abort(bytes(buf[_ABORT.size : _ABORT.size + id_len]).decode())
    if kind != KIND_ADD:
        raise ValueError(f"not a request record (kind {kind})")
    _, n, id_len, params_len = _ADD.unpack_from(buf)
    view = memoryview(buf)
    at = _ADD.size
    tokens = view[at : at + 4 * n].cast("i").tolist()
    at += 4 * n
    rid = bytes(view[at : at + id_len]).decode()
    at += id_len
    params = _msgpack_decode(view[at : at + params_len])
    return AddRequest(rid, tokens, params)


# -- engine -> worker ------------------------------------------------------------------


def encode_outputs(outputs: Sequence[Output]) -> bytes:
    parts = [_OUTPUTS.pack(KIND_OUTPUTS, len(outputs))]
    for o in outputs:
        rid = o.request_id.encode()
        err = o.error.encode() if o.error else b""
        n = len(o.new_token_ids)
        flags = 0
        top_n = 0
        if o.logprobs is not None:
            flags |= _HAS_LOGPROBS
            if o.top_token_ids is not None:
                top_n = int(np.shape(o.top_token_ids)[1]) if n else 0
        if o.stop_reason is not None:
            flags |= _HAS_STOP_REASON
        parts.append(_ITEM.pack(len(rid), o.index, _FINISH_CODE[o.finish_reason], flags, n,
                                o.num_prompt_tokens, top_n,
                                o.stop_reason if o.stop_reason is not None else 0, len(err)))
        parts.append(_int32_bytes(o.new_token_ids))
        if flags & _HAS_LOGPROBS:
            parts.append(np.asarray(o.logprobs, dtype=np.float32).tobytes())
            if top_n:
                parts.append(np.ascontiguousarray(o.top_token_ids, dtype=np.int32).tobytes())
                parts.append(np.ascontiguousarray(o.top_logprobs, dtype=np.float32).tobytes())
        parts.append(rid)
        parts.append(err)
    return b"".join(parts)


def decode_outputs(buf: bytes) -> list[Output]:
    kind, count = _OUTPUTS.unpack_from(buf)
    if kind != KIND_OUTPUTS:
        raise ValueError(f"not an outputs record (kind {kind})")
    view = memoryview(buf)
    at = _OUTPUTS.size
    out = []
    for _ in range(count):
        id_len, index, finish, flags, n, num_prompt, top_n, stop_reason, err_len = _ITEM.unpack_from(buf, at)
        at += _ITEM.size
        tokens = view[at : at + 4 * n].cast("i").tolist()
        at += 4 * n
        logprobs = top_ids = top_lps = None
        if flags & _HAS_LOGPROBS:
            logprobs = view[at : at + 4 * n].cast("f").tolist()
            at += 4 * n
            if top_n:
                k = n * top_n
                top_ids = np.frombuffer(buf, np.int32, k, at).reshape(n, top_n)
                at += 4 * k
                top_lps = np.frombuffer(buf, np.float32, k, at).reshape(n, top_n)
                at += 4 * k
        rid = bytes(view[at : at + id_len]).decode()
        at += id_len
        err = bytes(view[at : at + err_len]).decode() if err_len else None
        at += err_len
        out.append(Output(rid, tokens, FINISH_REASONS[finish], index, num_prompt,
                          stop_reason if flags & _HAS_STOP_REASON else None,
                          logprobs, top_ids, top_lps, err))
    return out
