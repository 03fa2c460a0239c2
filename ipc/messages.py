"""Wire messages between an engine client (server/) and an engine process, one ring message
each (a record, or consecutive fragments when it is larger than a quarter of the ring: ipc/ring.py).

msgpack through msgspec (one C call each way, reused Encoder/Decoder), array-like structs (a
record is a msgpack array, no field names). A prompt's token ids travel as one raw native int32
``bin`` (both ends are on the same host; docs/design.md §3) and come out as an int32 array over the
decoded bytes: the engine takes it as it is, so a 32k-token prompt costs a few C calls on each
side, not 32k Python ints. A step's new token ids travel as raw int32 too, all of the step's
outputs together in one block (usually one id per output; a block per output measured 3-8x
slower than msgpack ints, one per step costs one pack and one frombuffer+tolist per step).

Worker -> engine records: :class:`AddRequest`, :class:`Abort` (``encode_request``/``decode_request``),
told apart by their tag (the array's first item). An AddRequest carries its SamplingParams
typed (ipc/sampling_params.py), as a msgpack map of the fields not at their default; decoding
builds and validates it. A record that is an AddRequest but for what its params hold (a value
out of range, a field of the wrong type or unknown) decodes as a :class:`RefusedRequest`, which
the engine answers with an "error" output for that request alone; anything else that does not
decode is not a request at all.
Engine -> worker record: one step's list of :class:`EngineOutput` (``encode_outputs``/``decode_outputs``),
the same struct the engine core returns in-process (the offline ``LLM`` reads it directly);
``encode_output_messages`` halves a step whose outputs together exceed the message limit.
"""

from __future__ import annotations

import struct
from enum import StrEnum
from typing import Any, Sequence

import msgspec
import numpy as np

from ringserve.ipc.ring import MessageTooLarge
from ringserve.ipc.sampling_params import SamplingParams

# Structs hold no reference cycles, so the garbage collector need not track them (cheaper).


class AddRequest(msgspec.Struct, tag=1, array_like=True, gc=False):
    request_id: str
    # In: a list of ints (what the tokenizer gives) or an int32 array. Out of decode_request: a
    # read-only int32 array over the record's bytes. On the wire: raw int32 bytes.
    prompt_token_ids: Any
    params: SamplingParams
    trace: bool = False                   # record its journey; it comes back on the last EngineOutput


class _AddRequestEnvelope(msgspec.Struct, tag=1, array_like=True, gc=False):
    """An AddRequest's shape with its params left a map: read only when the typed decode failed,
    to tell a request whose params are refused from a record that is not a request."""
    request_id: str
    prompt_token_ids: bytes
    params: dict[str, Any]
    trace: bool = False


class RefusedRequest(msgspec.Struct, gc=False):
    """Not a wire record: what decode_request returns for an AddRequest whose params fail to
    decode or validate. The engine answers it with an "error" output."""
    request_id: str
    num_prompt_tokens: int
    error: str


class Abort(msgspec.Struct, tag=2, array_like=True, gc=False):
    request_id: str


class FinishReason(StrEnum):
    """Why a sample ended. A StrEnum: equal to its string, and encoded as it (on the wire, in
    OpenAI's JSON). Stop strings end a sample in the frontend (server/output_processor.py), also
    with STOP; the engine knows only stop tokens, EOS and lengths."""
    STOP = "stop"        # EOS, a stop token id, or (frontend) a stop string
    LENGTH = "length"    # max_tokens, or the model's context
    ABORT = "abort"      # the client went away or cancelled it
    ERROR = "error"      # refused or failed; the message is in EngineOutput.error


# One position's logprobs: (token id, logprob, rank) per candidate, the sampled (or prompt)
# token first, then the top-N not already listed. rank 1 = the most likely token.
PositionLogprobs = list[tuple[int, float, int]]


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request (one of its ``n`` samples: ``index``): the one
    engine-output type, returned by EngineCore.step() and sent as it is over the rings."""

    request_id: str
    # On the wire this is empty: the ids of the whole step travel together as one raw int32
    # block beside the outputs (with each output's count in another), and decode_outputs
    # slices them back in.
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None   # None while running
    index: int = 0
    num_prompt_tokens: int = 0
    stop_reason: int | None = None          # the stop token id that ended it, if any
    # When logprobs were asked: one PositionLogprobs per new token.
    logprobs: list[PositionLogprobs] | None = None
    error: str | None = None                # the message when finish_reason is ERROR
    num_cached_tokens: int = 0              # prompt tokens found in the prefix cache
    trace: bytes | None = None              # traced requests only: the engine's journey, JSON
    # When prompt_logprobs were asked, once (on sample 0's first output): one PositionLogprobs
    # per prompt token from the second on (the first has none; nothing precedes it).
    prompt_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


MAX_REQUEST_ID = 1024  # characters: ours are "cmpl-<32 hex>-<choice>"

_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(AddRequest | Abort).decode
_decode_envelope = msgspec.msgpack.Decoder(_AddRequestEnvelope).decode
_decode_step = msgspec.msgpack.Decoder(tuple[bytes, bytes, list[EngineOutput]]).decode
_NO_IDS: list[int] = []  # an output's ids on the wire (they travel in the step's block)

_INT32 = np.dtype(np.int32)  # a dtype object: np.frombuffer converts np.int32 on every call
_PACKERS: dict[int, struct.Struct] = {}  # prompt length -> its int32 packer


def _int32_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    if type(ids) is not list:  # an array (or another sequence): numpy converts it in C
        return np.ascontiguousarray(ids, dtype=_INT32).tobytes()
    # For a list, a Struct per length is the fastest of the ways measured (docs/ipc.md):
    # 4096 ids ~25 us, against ~31 us for struct.pack with a format, ~55-70 us for
    # np.fromiter, np.array or array("i", ...).
    n = len(ids)
    packer = _PACKERS.get(n)
    if packer is None:
        if len(_PACKERS) >= 4096:  # bound the cache; prompt lengths are many
            _PACKERS.clear()
        packer = _PACKERS[n] = struct.Struct(f"{n}i")
    return packer.pack(*ids)


# -- worker -> engine ------------------------------------------------------------------


def encode_request(msg: AddRequest | Abort) -> bytes:
    if isinstance(msg, Abort):
        return _encode(msg)
    # AddRequest's array-like layout, [tag, fields...], with the ids as raw int32 bytes
    return _encode((1, msg.request_id, _int32_bytes(msg.prompt_token_ids), msg.params, msg.trace))


def decode_request(buf: bytes | memoryview) -> AddRequest | Abort | RefusedRequest:
    """Raises msgspec.DecodeError (a ValidationError for a wrong shape) on a record that is not
    one of ours: the engine reads records from other processes and trusts none of them. An
    AddRequest whose params are refused (SamplingParams.validate, or their types) comes back
    as a RefusedRequest."""
    try:
        msg = _decode_request(buf)
    except msgspec.ValidationError as e:
        refused = _refused(buf, e)
        if refused is None:
            raise
        return refused
    if len(msg.request_id) > MAX_REQUEST_ID:  # it comes back on every output of the request
        raise msgspec.ValidationError(f"request ids are at most {MAX_REQUEST_ID} characters")
    if type(msg) is AddRequest:
        ids = msg.prompt_token_ids
        if type(ids) is not bytes or len(ids) % 4:
            raise msgspec.ValidationError("AddRequest.prompt_token_ids must be raw int32 bytes")
        msg.prompt_token_ids = np.frombuffer(ids, _INT32)  # a view: no copy
    return msg


def _refused(buf: bytes | memoryview, error: msgspec.ValidationError) -> RefusedRequest | None:
    """The request whose params made `error`, or None when the record is no AddRequest either."""
    try:
        env = _decode_envelope(buf)
    except msgspec.DecodeError:
        return None
    if len(env.request_id) > MAX_REQUEST_ID or len(env.prompt_token_ids) % 4:
        return None
    # SamplingParams.validate's own message, else msgspec's (it names the field)
    why = error.__cause__ if isinstance(error.__cause__, ValueError) else error
    return RefusedRequest(env.request_id, len(env.prompt_token_ids) // 4,
                          f"invalid sampling parameters: {why}")


# -- engine -> worker ------------------------------------------------------------------


def encode_outputs(outputs: Sequence[EngineOutput]) -> bytes:
    ids: list[int] = []
    counts: list[int] = []
    wire = []
    for out in outputs:  # the ids move to the step's block, their counts to another
        ids += out.new_token_ids
        counts.append(len(out.new_token_ids))
        wire.append(msgspec.structs.replace(out, new_token_ids=_NO_IDS))
    return _encode((_int32_bytes(ids), _int32_bytes(counts), wire))


def decode_outputs(buf: bytes | memoryview) -> list[EngineOutput]:
    block, counts, outputs = _decode_step(buf)
    ids = np.frombuffer(block, _INT32).tolist()
    start = 0
    for out, count in zip(outputs, np.frombuffer(counts, _INT32).tolist(), strict=True):
        out.new_token_ids = ids[start:start + count]
        start += count
    return outputs


def encode_output_messages(outputs: Sequence[EngineOutput], max_bytes: int) -> list[bytes]:
    """``outputs`` as messages of at most ``max_bytes`` each, in order: one message but for a
    step whose outputs are too large together (then halves). The ring cuts a message larger
    than a record into fragments (ipc/ring.py). Raises MessageTooLarge for one output larger
    than ``max_bytes`` alone."""
    message = encode_outputs(outputs)
    if len(message) <= max_bytes:
        return [message]  # the common case: one encode, one length check
    if len(outputs) > 1:
        half = len(outputs) // 2
        return encode_output_messages(outputs[:half], max_bytes) + \
            encode_output_messages(outputs[half:], max_bytes)
    raise MessageTooLarge(f"an output of {len(message)} bytes is over the limit of {max_bytes} "
                          "bytes for one message")
