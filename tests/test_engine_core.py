"""EngineCore on the tiny random Llama: schedule -> execute -> update, end to end."""
import random
from typing import NamedTuple

import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.ipc.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class Candidate(NamedTuple):
    logprob: float
    rank: int


def by_token(position) -> dict[int, Candidate]:
    """One position of an EngineOutput's logprobs, [(token id, logprob, rank), ...], by token;
    no token may be listed twice."""
    entry = {t: Candidate(lp, rank) for t, lp, rank in position}
    assert len(entry) == len(position), position
    return entry


def make_engine(model_dir, **kw) -> EngineCore:
    if "num_gpu_blocks_override" not in kw:  # a small pool clamps max_model_len to what it holds
        kw.setdefault("max_model_len", 256)
    return EngineCore(EngineConfig.create(model=str(model_dir), **kw))


def run(engine: EngineCore, requests: dict, max_steps: int = 5000):
    """Add {id: (prompt ids, params)}, step until done; {(id, index): (tokens, finish_reason)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens, reasons, stats = {}, {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                assert key not in reasons, "one finished output per sample"
                reasons[key] = out.finish_reason
        stats.append(engine.stats)
    assert not engine.has_unfinished_requests()
    return {k: (tokens.get(k, []), reasons[k]) for k in reasons}, stats


def workload(vocab: int, n: int = 10, seed: int = 0) -> dict:
    """Prompts of 1..45 tokens, half of them sharing a 20-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    reqs = {}
    for i in range(n):
        length = rng.randrange(1, 46)
        prompt = (shared + [rng.randrange(3, vocab) for _ in range(length)]) if i % 2 else \
            [rng.randrange(3, vocab) for _ in range(length)]
        reqs[f"r{i}"] = (prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20),
                                                ignore_eos=True))
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Every request alone, in one big prefill, in a big pool, no prefix caching."""
    reqs = workload(384)
    out = {}
    for rid, req in reqs.items():
        got, _ = run(make_engine(tiny_model_dir, enable_prefix_caching=False), {rid: req})
        out.update(got)
    return reqs, out


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=8192),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=37, max_num_seqs=3),
    dict(max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(max_num_batched_tokens=8192, num_gpu_blocks_override=9),
    dict(max_num_batched_tokens=24, num_gpu_blocks_override=10, block_size=8, enable_prefix_caching=False),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_greedy_output_is_the_same_whatever_the_batch(tiny_model_dir, reference, kw):
    reqs, expected = reference
    got, stats = run(make_engine(tiny_model_dir, **kw), reqs)
    assert got == expected
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in stats) <= kw["max_num_batched_tokens"]
    if kw.get("num_gpu_blocks_override"):
        assert sum(s.num_preemptions for s in stats) > 0, "the small pool should force preemption"
    if kw.get("enable_prefix_caching", True):
        assert sum(s.prefix_cache_hits for s in stats) > 0


def test_blocks_are_freed_in_the_step_where_a_request_ends(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=20)
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("b", list(range(50, 60)),
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free_blocks == 20 - 3 - 1
    outs = engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a"]
    assert engine.kv.num_free_blocks == 20 - 1
    engine.abort_request("b")
    assert engine.kv.num_free_blocks == 20
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("b", "abort")]
    assert not engine.has_unfinished_requests()


def test_requests_that_can_never_fit_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="the KV pool holds 48 tokens, less than one request of "
                                         "--max-model-len 64"):
        make_engine(tiny_model_dir, max_model_len=64, num_gpu_blocks_override=3)
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=3)  # 3 blocks of 16: clamped to 48
    assert engine.max_model_len == 48
    engine.add_request("long", list(range(3, 60)), SamplingParams(max_tokens=10))
    engine.add_request("pool", list(range(3, 40)), SamplingParams(max_tokens=20))
    engine.add_request("empty", [], SamplingParams())
    engine.add_request("vocab", [5, 100000], SamplingParams())
    engine.add_request("ok", list(range(3, 20)), SamplingParams(max_tokens=5))
    outs = engine.step()
    errors = {o.request_id: o.error for o in outs if o.finish_reason == "error"}
    assert set(errors) == {"long", "pool", "empty", "vocab"}
    assert "maximum context length is 48" in errors["long"] and "57 input tokens" in errors["long"]
    assert "maximum context length is 48" in errors["pool"] and "57 tokens" in errors["pool"]
    assert "empty" in errors["empty"] and "100000" in errors["vocab"]
    assert engine.num_waiting + engine.num_running == 1
    first = [t for o in outs if o.request_id == "ok" for t in o.new_token_ids]
    got, _ = run(engine, {})
    assert got[("ok", 0)][1] == "length" and len(first + got[("ok", 0)][0]) == 5


def test_stop_token_ids_min_tokens_and_eos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(10, 30))
    base, _ = run(engine, {"a": (prompt, GREEDY)})
    tokens = base[("a", 0)][0]
    stop = tokens[3]
    first = tokens.index(stop)
    got, _ = run(engine, {"b": (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[stop]))})
    assert got[("b", 0)] == (tokens[:first + 1], "stop")
    got, _ = run(engine, {"c": (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[stop], min_tokens=first + 2))})
    assert stop not in got[("c", 0)][0][:first + 2]
    # The same token as eos: it stops a request unless ignore_eos.
    engine.eos_token_ids = (stop,)
    got, _ = run(engine, {"d": (prompt, SamplingParams(temperature=0, max_tokens=12))})
    assert got[("d", 0)] == (tokens[:first + 1], "stop")


def test_seeded_sampling_reproduces_whatever_the_batch_and_n_shares_blocks(tiny_model_dir):
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone, _ = run(make_engine(tiny_model_dir), {"s": (prompt, params)})
    crowd = workload(384, n=6, seed=3)
    crowd["s"] = (prompt, params)
    crowd["x"] = (prompt, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))  # unseeded
    together, _ = run(make_engine(tiny_model_dir, max_num_batched_tokens=20), crowd)
    assert together[("s", 0)] == alone[("s", 0)]
    # n = 3: sample i uses seed + i, and the three share the prompt's full blocks, caching on or off.
    for caching in (True, False):
        engine = make_engine(tiny_model_dir, enable_prefix_caching=caching)
        got, stats = run(engine, {"n": (prompt, SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7,
                                                               max_tokens=10, ignore_eos=True))})
        assert got[("n", 0)] == alone[("s", 0)]
        assert len({tuple(got[("n", i)][0]) for i in range(3)}) > 1
        assert sum(s.prefix_cache_hits for s in stats) == 2 * 48
        assert engine.stats.prefix_cache_hits == 0       # per step: the hits were counted once
    single, _ = run(make_engine(tiny_model_dir), {"one": (prompt, SamplingParams(
        temperature=1.0, top_p=0.9, seed=9, max_tokens=10, ignore_eos=True))})
    assert got[("n", 2)] == single[("one", 0)]


def test_logprobs_and_stats(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    outs = engine.step()
    assert engine.stats.num_prefill_tokens == 20 and engine.stats.num_running == 1
    assert engine.stats.kv_cache_usage > 0
    lp = by_token(outs[0].logprobs[0])
    token = outs[0].new_token_ids[0]
    assert outs[0].logprobs[0][0][0] == token     # the sampled token first
    assert lp[token].rank == 1 and lp[token].logprob <= 0 and len(lp) == 2
    engine.step()
    assert engine.stats.num_decode_tokens == 1 and engine.stats.num_prefill_tokens == 0


@pytest.fixture(scope="module")
def prompt_reference(tiny_model_dir):
    """Two prompts and their dense-reference log-softmax at every position."""
    import numpy as np

    from reference_llama import reference_logits
    from ringserve.gpu.loader.weights import load_weights
    from ringserve.gpu.sampling.sampler import log_softmax
    rng = random.Random(5)
    prompts = {"p": [rng.randrange(3, 384) for _ in range(45)],
               "q": [rng.randrange(3, 384) for _ in range(21)]}
    weights = load_weights(tiny_model_dir)
    return {k: (p, log_softmax(reference_logits(tiny_model_dir, weights, p).astype(np.float32)))
            for k, p in prompts.items()}


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=8192),
    dict(max_num_batched_tokens=7),
    dict(max_num_batched_tokens=16, enable_prefix_caching=True),
    dict(max_num_batched_tokens=16, num_gpu_blocks_override=8, block_size=8),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_prompt_logprobs_are_the_reference_whatever_the_chunking(tiny_model_dir, prompt_reference, kw):
    """prompt_logprobs: for each prompt token from the second on (the first has none), its
    logprob and rank plus the top N, once, on the first output; only sample 0 of n carries them. With
    prefix caching the prompt is cached first: a request with prompt_logprobs recomputes it.
    The small pool preempts (and recomputes) mid-prefill."""
    import numpy as np
    engine = make_engine(tiny_model_dir, **kw)
    p, ref_p = prompt_reference["p"]
    q, ref_q = prompt_reference["q"]
    if kw.get("enable_prefix_caching"):
        run(engine, {"warm": (p, GREEDY)})
    for rid, prompt, params in [
            ("plain", q, GREEDY),
            ("p", p, SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)),
            ("q", q, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)),
            ("one", [7], SamplingParams(max_tokens=2, prompt_logprobs=1))]:
        engine.add_request(rid, prompt, params)
    got, firsts, hits, preempted = {}, {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            if out.prompt_logprobs is not None:
                assert key not in got and key not in firsts, "prompt logprobs come once, first"
                got[key] = [None] + [by_token(position) for position in out.prompt_logprobs]
            firsts.setdefault(key, out)
        hits += engine.stats.prefix_cache_hits
        preempted += engine.stats.num_preemptions
    assert set(got) == {("p", 0), ("q", 0), ("one", 0)}
    assert got["one", 0] == [None]
    for key, prompt, ref, top in ((("p", 0), p, ref_p, 3), (("q", 0), q, ref_q, 0)):
        lps = got[key]
        assert len(lps) == len(prompt) and lps[0] is None
        for pos in range(1, len(prompt)):
            want = ref[pos - 1]
            entry = lps[pos]
            token = prompt[pos]
            assert abs(entry[token].logprob - want[token]) < 1e-4, (key, pos)
            assert entry[token].rank == int((want > want[token]).sum()) + 1
            best = np.argsort(-want)[:top].tolist()
            assert set(entry) == {token, *best}
            assert all(entry[t].rank == r for r, t in enumerate(best, 1))
    if kw.get("enable_prefix_caching"):
        assert hits > 0          # "plain" and sample 1 of "p" read the cache; sample 0 did not
    if "num_gpu_blocks_override" in kw:
        assert preempted > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_check_stop_is_the_one_stop_rule():
    """engine/stop.py on a real Request: eos and stop ids count only once min_tokens are out
    (the sampler bans them before, so only this test sees the gate); max_tokens and
    max_model_len end with "length"; a stop id is kept as stop_reason, eos is not."""
    from ringserve.engine.request import Request
    from ringserve.engine.stop import check_stop

    def run(tokens, max_model_len=100, **kw):
        params = SamplingParams(stop_token_ids=[7], max_tokens=4, **kw)
        req = Request("r", [1, 2, 3], params, eos_token_ids=(9,))
        reasons = []
        for t in tokens:
            req.append_output_token(t)
            reasons.append(check_stop(req, t, max_model_len))
        return reasons, req.stop_reason

    assert run([5, 7]) == ([None, "stop"], 7)
    assert run([9]) == (["stop"], None)
    assert run([7, 9, 7], min_tokens=3) == ([None, None, "stop"], 7)
    assert run([5, 5, 5, 5]) == ([None, None, None, "length"], None)
    assert run([5, 5], max_model_len=5) == ([None, "length"], None)
