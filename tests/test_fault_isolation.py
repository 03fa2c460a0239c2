"""Fault isolation in the parts, without processes: a corrupt ring, messages larger than a
record or over the message limit, a sampling row that raises, a step that raises
(engine/core.py, gpu/sampling/sampler.py, ipc/ring.py, ipc/messages.py). The same through real engine
processes and a real server: tests/test_fault_isolation_engine.py."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.gpu.sampling.sampler import SamplingMetadata, sample
from ringserve.ipc.messages import EngineOutput, decode_outputs, encode_output_messages, encode_outputs
from ringserve.ipc.ring import END, MORE, TAIL, CorruptRing, MessageTooLarge, Ring
from ringserve.ipc.sampling_params import SamplingParams

# -- the ring -------------------------------------------------------------------------------


def _ring(capacity: int = 1024, max_message: int = 1 << 20) -> tuple[Ring, Ring]:
    buf = memoryview(bytearray(Ring.region_size(capacity)))
    return Ring(buf, 0, capacity, max_message), Ring(buf, 0, capacity, max_message)


@pytest.mark.parametrize("header", [2**40, 2**64 - 1, 1024, 17])
def test_a_record_header_longer_than_what_is_published_is_corrupt(header):
    writer, reader = _ring()
    writer.write(b"x" * 16)
    writer._words[0] = header  # the writer lies about the record it published (24 bytes)
    with pytest.raises(CorruptRing):
        reader.read()


@pytest.mark.parametrize("tail", [2**63, 4096 + 8])
def test_a_tail_beyond_one_ring_is_corrupt(tail):
    writer, reader = _ring()
    writer.write(b"ok")
    assert reader.read() == b"ok"
    writer._counters[TAIL] = tail
    with pytest.raises(CorruptRing):
        reader.read()


def test_a_tail_behind_the_head_is_corrupt():
    writer, reader = _ring()
    writer.write(b"a" * 40)
    assert reader.read() == b"a" * 40
    writer._counters[TAIL] = 8   # behind the head (48)
    with pytest.raises(CorruptRing):
        reader.read()


def test_honest_records_still_read_across_the_wrap():
    writer, reader = _ring(256)
    for i in range(200):
        payload = bytes([i % 251]) * (i % 97)
        writer.write(payload)
        assert reader.read() == payload
    assert reader.read() is None


# -- messages larger than a record -----------------------------------------------------------

def test_a_message_larger_than_the_ring_crosses_in_fragments_with_small_ones_between():
    """Messages of 0 to 3 rings' size, written a fragment at a time as room appears (the writer
    waits for the reader, as it would for another process), come out whole and in order."""
    writer, reader = _ring(1024)
    rng = np.random.default_rng(0)
    sizes = [0, 5, 3000, 200, 255, 250, 2500, 1, 700, 3072]
    messages = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    pending = [piece for m in messages for piece in writer.fragments(m)]
    assert len(pending) > 2 * len(messages)
    got: list[bytes] = []
    while pending or got != messages:
        while pending and writer.try_write(*pending[0]):
            pending.pop(0)
        if (m := reader.read()) is not None:
            got.append(m)
        elif not pending:
            break
    assert got == messages and reader.read() is None


def test_a_message_over_the_limit_is_refused_by_the_writer_and_the_reader():
    writer, reader = _ring(1024, max_message=4096)
    with pytest.raises(MessageTooLarge, match="4096"):
        writer.fragments(bytes(4097))
    # A writer that ignores the limit (it flags fragments for ever): the reader stops at it.
    with pytest.raises(CorruptRing, match="limit"):
        for _ in range(100):
            while writer.try_write(bytes(200), MORE):
                pass
            assert reader.read() is None


@pytest.mark.parametrize("header", [MORE | 1024, END | 1024, MORE | END | 8])
def test_a_fragment_header_that_cannot_be_true_is_corrupt(header):
    writer, reader = _ring()
    writer.write(b"x" * 16, MORE)
    writer._words[0] = header  # longer than what was published, or both flags at once
    with pytest.raises(CorruptRing):
        reader.read()


@pytest.mark.parametrize("read_between", [False, True])
def test_a_whole_record_between_fragments_is_corrupt(read_between):
    """Also when the reader took the first fragment in an earlier read (it waits for the rest)."""
    writer, reader = _ring()
    writer.write(b"a" * 16, MORE)
    if read_between:
        assert reader.read() is None
    writer.write(b"b" * 16)  # the writer broke off its message
    with pytest.raises(CorruptRing):
        reader.read()


def _prompt_logprobs(positions: int, top: int = 20) -> list:
    rng = np.random.default_rng(0)
    return [[(int(t), float(lp), r) for r, (t, lp) in
             enumerate(zip(rng.integers(0, 49152, top + 1), -rng.random(top + 1) * 10, strict=True), 1)]
            for _ in range(positions)]


def test_a_step_over_the_message_limit_is_halved_in_order():
    big = [EngineOutput(f"echo{i}", [17], None, 0, 4001, logprobs=[[(17, -0.5, 1)]],
                        prompt_logprobs=_prompt_logprobs(1000)) for i in range(3)]
    small = [EngineOutput("other", [5]), EngineOutput("third", [9], "length")]
    outs = [small[0], big[0], big[1], small[1], big[2]]
    limit = len(encode_outputs(big[:1])) + 100   # one big output fits, two do not
    messages = encode_output_messages(outs, limit)
    assert len(messages) >= 3 and all(len(m) <= limit for m in messages)
    assert [o for m in messages for o in decode_outputs(m)] == outs  # whole, in order


def test_outputs_that_fit_stay_one_message():
    outs = [EngineOutput(f"r{i}", [i], logprobs=[[(i, -1.0, 1)]]) for i in range(100)]
    (message,) = encode_output_messages(outs, 1 << 18)
    assert message == encode_outputs(outs)


def test_an_output_over_the_message_limit_alone_is_refused():
    with pytest.raises(MessageTooLarge):
        encode_output_messages([EngineOutput("x", [], "error", error="e" * 5000)], 4096)


# -- the sampler -----------------------------------------------------------------------------

def _meta(n: int, vocab: int, **rows) -> SamplingMetadata:
    meta = SamplingMetadata(temperature=np.full(n, 0.8, np.float32), top_k=np.zeros(n, np.int32),
                            top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                            generators=[np.random.default_rng(100 + i) for i in range(n)])
    for name, value in rows.items():
        setattr(meta, name, value)
    return meta


def test_a_sampling_row_that_raises_fails_alone_and_the_others_draw_as_if_alone():
    vocab, n = 300, 4
    logits = np.random.default_rng(1).standard_normal((n, vocab)).astype(np.float32)
    top_p = np.ones(n, np.float32)
    top_p[2] = np.float32(1e-46)   # rounds to 0 in float32: no token kept (IndexError)
    meta = _meta(n, vocab, top_p=top_p,
                 banned_token_ids=[(), [10**9], (), ()])  # row 1: an id past the vocabulary
    out = sample(logits, meta)
    assert set(out.failed) == {1, 2}
    for i in (0, 3):  # each good row: the token it gets when sampled alone, same seed
        alone = sample(logits[i:i + 1], _meta(1, vocab, generators=[np.random.default_rng(100 + i)]))
        assert out.token_ids[i] == alone.token_ids[0] and alone.failed is None


# -- the engine core -------------------------------------------------------------------------

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model_dir, **kw) -> EngineCore:
    return EngineCore(EngineConfig.create(model=str(model_dir), max_model_len=256, **kw))


def _run(engine: EngineCore) -> dict:
    got: dict = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens, reasons, errors = got.setdefault((out.request_id, out.index), ([], [], []))
            tokens += out.new_token_ids
            if out.finished:
                reasons.append(out.finish_reason)
                errors.append(out.error)
    assert not engine.has_unfinished_requests()
    assert all(len(r) == 1 for _, r, _ in got.values()), "one finished output per sample"
    return got


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """The good requests' tokens, each run alone."""
    out = {}
    for rid, prompt in (("good", [5, 6, 7, 8]), ("other", list(range(20, 40)))):
        engine = _engine(tiny_model_dir)
        engine.add_request(rid, prompt, SamplingParams(**GREEDY))
        out[rid] = _run(engine)[(rid, 0)][0]
    return out


def _add_good(engine: EngineCore) -> None:
    engine.add_request("good", [5, 6, 7, 8], SamplingParams(**GREEDY))
    engine.add_request("other", list(range(20, 40)), SamplingParams(**GREEDY))


def _check_good(engine: EngineCore, got: dict, alone: dict) -> None:
    for rid in ("good", "other"):
        assert got[(rid, 0)] == (alone[rid], ["length"], [None])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_ids_outside_the_vocabulary_are_refused_at_the_door(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    vocab = engine.vocab_size
    negative = SamplingParams(max_tokens=5)
    negative.stop_token_ids = [-1]  # SamplingParams refuses it; the core checks on its own too
    bad = {"stop": SamplingParams(max_tokens=5, min_tokens=1, stop_token_ids=[10**9]),
           "negative": negative,
           "logprobs": SamplingParams(max_tokens=5, logprobs=vocab + 1),
           "prompt_logprobs": SamplingParams(max_tokens=5, prompt_logprobs=vocab + 1)}
    for rid, params in bad.items():
        engine.add_request(rid, [1, 2, 3], params)
    engine.add_request("edge", [1, 2, 3], SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1, 0]))
    got = _run(engine)
    for rid in bad:
        _, reasons, errors = got[(rid, 0)]
        assert reasons == ["error"] and "vocabulary" in errors[0], (rid, errors)
    assert got[("edge", 0)][1] != ["error"]


def test_a_request_whose_sampling_raises_ends_alone(tiny_model_dir, alone):
    """Both samples of a request whose top_p became 0 in float32 (it slipped past validation)
    end with "error"; the requests beside it get exactly the tokens they get alone."""
    engine = _engine(tiny_model_dir)
    _add_good(engine)
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8, n=2, seed=3)
    params.top_p = 1e-46  # what a record from the ring may carry when no check stops it
    engine.add_request("bad", [9, 10, 11], params)
    got = _run(engine)
    for i in (0, 1):
        tokens, reasons, errors = got[("bad", i)]
        assert reasons == ["error"] and "sampling failed" in errors[0] and tokens == []
    _check_good(engine, got, alone)


def test_a_step_that_raises_ends_only_the_request_at_fault(tiny_model_dir, alone):
    """A sampling row that cannot even be built (the batch's metadata raises): the step is
    examined request by request, the one at fault ends, the others run the step again."""
    engine = _engine(tiny_model_dir)
    _add_good(engine)
    engine.add_request("bad", [9, 10, 11], SamplingParams(**GREEDY))
    engine.groups["bad"][0].params.temperature = "hot"  # corrupt state: not a float
    got = _run(engine)
    tokens, reasons, errors = got[("bad", 0)]
    assert reasons == ["error"] and "could not sample" in errors[0]
    _check_good(engine, got, alone)


def test_a_failed_forward_ends_its_step_and_the_engine_goes_on(tiny_model_dir, alone):
    """No request's sampling is at fault (the batched forward itself raised): that step's
    requests end with "error", the blocks come back, later requests run as if nothing happened."""
    engine = _engine(tiny_model_dir)
    engine.add_request("a", list(range(5, 45)), SamplingParams(**GREEDY))   # full blocks: cached
    engine.add_request("b", list(range(50, 90)), SamplingParams(**GREEDY))
    engine.groups["b"][0].all_token_ids[1] = 10**6   # the forward's embedding lookup raises
    got = _run(engine)
    for rid in ("a", "b"):
        assert got[(rid, 0)][1] == ["error"] and "step failed" in got[(rid, 0)][2][0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.kv.pool.cached, "blocks of a failed forward must not be found again"
    _add_good(engine)
    _check_good(engine, _run(engine), alone)


def test_whole_steps_failing_in_a_row_stop_the_engine(tiny_model_dir):
    """A device that fails every step (no request at fault) is broken: after MAX_FAILED_STEPS
    the step raises, so that the process exits and is restarted."""
    from ringserve.engine.core import MAX_FAILED_STEPS
    engine = _engine(tiny_model_dir)
    for i in range(MAX_FAILED_STEPS - 1):
        engine.add_request(f"r{i}", [8, 9, 10], SamplingParams(**GREEDY))
        engine.groups[f"r{i}"][0].all_token_ids[0] = 10**6
        engine.step()
    engine.add_request("last", [8, 9, 10], SamplingParams(**GREEDY))
    engine.groups["last"][0].all_token_ids[0] = 10**6
    with pytest.raises(RuntimeError, match="failed in a row"):
        engine.step()


def test_wrong_shaped_prompt_ids_are_not_a_request():
    from ringserve.ipc.messages import decode_request
    for record in ([1, "id", "text", {}, False], [1, "id", b"\x01\x02\x03", {}, False], [1, "id", 5]):
        with pytest.raises(msgspec.ValidationError):
            decode_request(msgspec.msgpack.encode(record))


def test_a_request_that_raises_while_its_token_is_taken_ends_alone(tiny_model_dir, alone):
    """The step's update (append, logprobs, stops) raises for one request (its params changed
    under it): that request ends with "error", the others in the same loop go on."""
    engine = _engine(tiny_model_dir)
    engine.add_request("first", [9, 10, 11], SamplingParams(**GREEDY))
    _add_good(engine)
    engine.groups["first"][0].params = SamplingParams(**GREEDY, logprobs=10**9)
    got = _run(engine)
    assert got[("first", 0)][1] == ["error"] and "failed this request" in got[("first", 0)][2][0]
    _check_good(engine, got, alone)
