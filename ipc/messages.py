"""Wire messages between an engine client (server/) and an engine process, one ring record each.

Binary and compact (DESIGN.md §3): token ids travel as raw native int32 (both ends are on the
same host), logprobs as raw float32. Only the small sampling-parameter dict is msgpack. A
decoded prompt stays an int32 array (a view of the record, no per-token Python int): the engine
takes it as it is, so a 32k-token prompt costs one C call on each side, not 32k objects.

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

# kind, flags, pad, n_tokens, id_len, params_len
_ADD = struct.Struct("<BB2xIII")
_ADD_TRACE = 1  # AddRequest flag: record this request's journey (engine/trace.py)
# kind, pad, id_len
_ABORT = struct.Struct("<B3xI")
# kind, pad, n_outputs
_OUTPUTS = struct.Struct("<B3xI")
# id_len, index, finish code, flags, n_tokens, num_prompt_tokens, num_cached_tokens,
# logprob entries, stop_reason, err_len
_ITEM = struct.Struct("<HHBB2xIIIIiI")
_HAS_LOGPROBS, _HAS_STOP_REASON, _HAS_TRACE, _HAS_PROMPT_LOGPROBS = 1, 2, 4, 8
_TRACE_LEN = struct.Struct("<I")  # a traced request's journey: length, then the JSON blob
_PROMPT_LOGPROBS = struct.Struct("<II")  # positions, entries; then laid out as logprobs

_msgpack_encode = msgspec.msgpack.Encoder().encode
_msgpack_decode = msgspec.msgpack.Decoder(dict).decode


def _int32_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(ids, np.ndarray):
        return np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    # For a list, ~3x faster than np.asarray(ids, np.int32) or array("i", ids) (docs/ipc.md).
    return struct.pack(f"{len(ids)}i", *ids)


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: Sequence[int] | np.ndarray  # decoded: a read-only int32 array
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields by name
    trace: bool = False                   # record its journey; it comes back on the last Output


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
    # When logprobs were asked, one list per new token of (token_id, logprob, rank): the
    # sampled token first, then the top-N alternatives not already listed.
    logprobs: list[list[tuple[int, float, int]]] | None = None
    error: str | None = None                # the message when finish_reason == "error"
    num_cached_tokens: int = 0              # prompt tokens found in the prefix cache
    trace: bytes | None = None              # traced requests only: the engine's journey, JSON
    # When prompt_logprobs were asked, once (on the first output): per prompt token from the
    # second on (the first has none), (token_id, logprob, rank): the prompt's token, then the top-N.
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None

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
    flags = _ADD_TRACE if msg.trace else 0
    return b"".join((_ADD.pack(KIND_ADD, flags, len(tokens) // 4, len(rid), len(params)),
                     tokens, rid, params))


def decode_request(buf: bytes) -> AddRequest | Abort:
    """``buf``: one record as Ring.read returns it (bytes, which the prompt array then views)."""
    kind = buf[0]
    if kind == KIND_ABORT:
        _, id_len = _ABORT.unpack_from(buf)
        return Abort(bytes(buf[_ABORT.size : _ABORT.size + id_len]).decode())
    if kind != KIND_ADD:
        raise ValueError(f"not a request record (kind {kind})")
    _, flags, n, id_len, params_len = _ADD.unpack_from(buf)
    at = _ADD.size
    tokens = np.frombuffer(buf, np.int32, n, at)  # no copy: the record is already ours
    at += 4 * n
    rid = str(buf[at : at + id_len], "utf-8")
    at += id_len
    params = _msgpack_decode(buf[at : at + params_len])
    return AddRequest(rid, tokens, params, bool(flags & _ADD_TRACE))


# -- engine -> worker ------------------------------------------------------------------


def encode_outputs(outputs: Sequence[Output]) -> bytes:
    parts = [_OUTPUTS.pack(KIND_OUTPUTS, len(outputs))]
    for o in outputs:
        rid = o.request_id.encode()
        err = o.error.encode() if o.error else b""
        n = len(o.new_token_ids)
        flags = _HAS_LOGPROBS if o.logprobs is not None else 0
        entries = sum(map(len, o.logprobs)) if o.logprobs is not None else 0
        if o.stop_reason is not None:
            flags |= _HAS_STOP_REASON
        if o.trace is not None:
            flags |= _HAS_TRACE
        if o.prompt_logprobs is not None:
            flags |= _HAS_PROMPT_LOGPROBS
        parts.append(_ITEM.pack(len(rid), o.index, _FINISH_CODE[o.finish_reason], flags, n,
                                o.num_prompt_tokens, o.num_cached_tokens, entries,
                                o.stop_reason if o.stop_reason is not None else 0, len(err)))
        parts.append(_int32_bytes(o.new_token_ids))
        if o.logprobs is not None:
            _encode_positions(parts, o.logprobs)
        parts.append(rid)
        parts.append(err)
        if o.trace is not None:
            parts.append(_TRACE_LEN.pack(len(o.trace)))
            parts.append(o.trace)
        if o.prompt_logprobs is not None:
            parts.append(_PROMPT_LOGPROBS.pack(len(o.prompt_logprobs), sum(map(len, o.prompt_logprobs))))
            _encode_positions(parts, o.prompt_logprobs)
    return b"".join(parts)


def _encode_positions(parts: list[bytes], positions: list[list[tuple[int, float, int]]]) -> None:
    """Per position its entry count; then all entries' ids, logprobs and ranks."""
    parts.append(array("i", map(len, positions)).tobytes())
    flat = [e for position in positions for e in position]
    parts.append(array("i", [e[0] for e in flat]).tobytes())
    parts.append(array("f", [e[1] for e in flat]).tobytes())
    parts.append(array("i", [e[2] for e in flat]).tobytes())


def _decode_positions(view: memoryview, at: int, n: int, entries: int,
                      ) -> tuple[list[list[tuple[int, float, int]]], int]:
    """What _encode_positions wrote for n positions of `entries` entries in all; the end offset."""
    counts = view[at : at + 4 * n].cast("i").tolist()
    at += 4 * n
    ids = view[at : at + 4 * entries].cast("i").tolist()
    lps = view[at + 4 * entries : at + 8 * entries].cast("f").tolist()
    ranks = view[at + 8 * entries : at + 12 * entries].cast("i").tolist()
    at += 12 * entries
    entry = list(zip(ids, lps, ranks))
    positions, start = [], 0
    for c in counts:
        positions.append(entry[start : start + c])
        start += c
    return positions, at


def decode_outputs(buf: bytes) -> list[Output]:
    kind, count = _OUTPUTS.unpack_from(buf)
    if kind != KIND_OUTPUTS:
        raise ValueError(f"not an outputs record (kind {kind})")
    view = memoryview(buf)
    at = _OUTPUTS.size
    out = []
    for _ in range(count):
        (id_len, index, finish, flags, n, num_prompt, num_cached, entries, stop_reason,
         err_len) = _ITEM.unpack_from(buf, at)
        at += _ITEM.size
        tokens = view[at : at + 4 * n].cast("i").tolist()
        at += 4 * n
        logprobs = None
        if flags & _HAS_LOGPROBS:
            logprobs, at = _decode_positions(view, at, n, entries)
        rid = bytes(view[at : at + id_len]).decode()
        at += id_len
        err = bytes(view[at : at + err_len]).decode() if err_len else None
        at += err_len
        trace = None
        if flags & _HAS_TRACE:
            (trace_len,) = _TRACE_LEN.unpack_from(buf, at)
            at += _TRACE_LEN.size
            trace = bytes(view[at : at + trace_len])
            at += trace_len
        prompt_logprobs = None
        if flags & _HAS_PROMPT_LOGPROBS:
            positions, prompt_entries = _PROMPT_LOGPROBS.unpack_from(buf, at)
            prompt_logprobs, at = _decode_positions(view, at + _PROMPT_LOGPROBS.size, positions,
                                                    prompt_entries)
        out.append(Output(rid, tokens, FINISH_REASONS[finish], index, num_prompt,
                          stop_reason if flags & _HAS_STOP_REASON else None,
                          logprobs, err, num_cached, trace, prompt_logprobs))
    return out
