"""Sampling in numpy (gpu/sampling/sampler.py) and SamplingParams validation."""
import numpy as np
import pytest

from ringserve.gpu.sampling.sampler import (
    GREEDY_EPS,
    SamplingMetadata,
    apply_penalties,
    gather_logprobs,
    sample,
)
from ringserve.ipc.limits import generator_seed
from ringserve.ipc.sampling_params import SamplingParams

V = 50


def meta(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, **kw):
    gens = [np.random.default_rng(s) for s in (seeds or range(b))]
    return SamplingMetadata(np.full(b, temperature, np.float32), np.full(b, top_k, np.int32),
                            np.full(b, top_p, np.float32), np.full(b, min_p, np.float32), gens, **kw)


def logits(b=4, seed=0):
    return np.random.default_rng(seed).normal(size=(b, V)).astype(np.float32) * 3


def test_greedy_is_argmax():
    x = logits()
    assert sample(x, meta(4, temperature=0.0)).token_ids.tolist() == x.argmax(-1).tolist()


def test_a_seeded_row_is_the_same_whatever_else_is_in_the_batch():
    x = logits(6)
    alone = [sample(x[2:3], meta(1, seeds=[1234])).token_ids[0] for _ in range(1)]
    batched = sample(x, meta(6, seeds=[9, 8, 1234, 7, 6, 5])).token_ids[2]
    assert alone[0] == batched
    # The generator advances once per token: a stream of draws is reproducible too.
    g1, g2 = meta(1, seeds=[42]), meta(3, seeds=[1, 42, 2])
    a = [int(sample(x[:1], g1).token_ids[0]) for _ in range(20)]
    b = [int(sample(np.stack([x[3], x[0], x[4]]), g2).token_ids[1]) for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_top_k_top_p_min_p_restrict_the_support():
    x = logits(1)
    order = np.argsort(-x[0])

    def draws(**kw) -> set[int]:
        return {int(sample(x, meta(1, seeds=[s], **kw)).token_ids[0]) for s in range(300)}

    assert draws(top_k=3) == set(order[:3].tolist())
    assert draws(top_k=1) == {int(order[0])}
    p = np.exp(x[0] - x[0].max())
    p /= p.sum()
    cum = np.cumsum(p[order])
    nucleus = set(order[:int(np.searchsorted(cum, 0.6)) + 1].tolist())
    assert draws(top_p=0.6) <= nucleus and len(draws(top_p=0.6)) > 1
    allowed = set(np.flatnonzero(p >= 0.2 * p.max()).tolist())
    assert draws(min_p=0.2) <= allowed


def test_temperature_sharpens_the_distribution():
    x = logits(1)
    top = int(x[0].argmax())
    hot = sum(int(sample(x, meta(1, temperature=5.0, seeds=[s])).token_ids[0]) == top for s in range(300))
    cold = sum(int(sample(x, meta(1, temperature=0.2, seeds=[s])).token_ids[0]) == top for s in range(300))
    assert cold > hot


def test_penalties_follow_vllm():
    x = np.array([[2.0, -2.0, 1.0, 0.5, 3.0]], np.float32)
    m = meta(1, presence_penalty=np.array([0.5], np.float32), frequency_penalty=np.array([0.25], np.float32),
             repetition_penalty=np.array([2.0], np.float32), prompt_token_ids=[[0]],
             output_token_ids=[[1, 1, 2]])
    y = apply_penalties(x.copy(), m)[0]
    # token 0: prompt only -> repetition; 1: output x2 -> repetition (negative: *2), 0.5 + 2*0.25;
    # token 2: output x1; 3, 4: unseen
    assert y.tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 0.5, 3.0])


def test_a_tiny_repetition_penalty_keeps_the_logits_finite_and_top_p_samples_a_seen_token():
    """repetition_penalty 1.17549435e-38 (float32's smallest normal: valid, > 0) divides the seen
    positive logits past float32's range: they stop at its largest finite value, not +inf
    (a NaN softmax that left top_p nothing to keep: a hypothesis case of
    tests/test_validation_edges.py, a 500 before)."""
    x = np.array([[30.0, -2.0, 10.0, 0.5, 3.0]], np.float32)
    m = meta(1, temperature=1.0, top_p=0.5, presence_penalty=np.zeros(1, np.float32),
             frequency_penalty=np.zeros(1, np.float32),
             repetition_penalty=np.array([1.17549435e-38], np.float32), prompt_token_ids=[[0, 2]],
             output_token_ids=[[]])
    y = apply_penalties(x.copy(), m)[0]
    assert np.isfinite(y).all() and y[0] == y[2] == np.finfo(np.float32).max
    assert sample(x.copy(), m).token_ids[0] in (0, 2)


def test_banned_tokens_are_never_sampled():
    x = logits(1)
    top = int(x[0].argmax())
    assert sample(x, meta(1, temperature=0.0, banned_token_ids=[[top]])).token_ids[0] != top


def test_logprobs_of_the_sampled_token_and_the_top_n():
    x = logits(3)
    ids = np.array([0, 5, int(x[2].argmax())])
    lp = gather_logprobs(x, ids, 4)
    ref = x - np.log(np.exp(x).sum(-1, keepdims=True))
    assert lp.token_ids[:, 0].tolist() == ids.tolist()
    assert lp.logprobs[:, 0] == pytest.approx(ref[np.arange(3), ids], abs=1e-5)
    assert lp.token_ids[:, 1:].tolist() == np.argsort(-ref, axis=-1)[:, :4].tolist()
    assert lp.sampled_rank[2] == 1
    assert lp.sampled_rank[0] == 1 + int((ref[0] > ref[0, 0]).sum())


@pytest.mark.parametrize("kw", [dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                dict(min_p=1.5), dict(max_tokens=0), dict(min_tokens=5, max_tokens=2),
                                dict(presence_penalty=3), dict(repetition_penalty=0), dict(logprobs=-1)])
def test_invalid_sampling_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(top_p=1e-46), dict(top_p=1e-300), dict(temperature=1e308),
                                dict(temperature=float("nan")), dict(min_p=1e-40),
                                dict(repetition_penalty=1e-300), dict(repetition_penalty=float("inf")),
                                dict(top_k=2**31), dict(seed=2**63), dict(seed=-2**63 - 1),
                                dict(temperature=True), dict(top_k=1.5), dict(stop_token_ids=[-1]),
                                dict(stop_token_ids=[2**31]), dict(max_tokens=2**31),
                                dict(n=2**31 - 1)])
def test_values_the_engine_dtypes_cannot_hold_are_refused(kw):
    """A ring record is not trusted: the engine checks ipc/limits.py's ranges too."""
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_any_int64_seed_seeds_a_generator():
    for seed in (-1, -2**63, 2**63 - 1, 0):
        p = SamplingParams(seed=seed, n=3)
        assert p.seed == seed  # kept as given; the engine makes the generator's seed (engine/core.py)
        for i in range(3):  # the engine seeds sample i with generator_seed(seed) + i
            np.random.default_rng(generator_seed(p.seed) + i).random()
    assert generator_seed(5) == 5 and generator_seed(-1) != generator_seed(1)
    assert SamplingParams(top_k=2**31 - 1).top_k == 0  # larger than any vocabulary: off


def test_sampling_params_defaults_are_vllms():
    p = SamplingParams(top_k=-1)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert SamplingParams(temperature=0).temperature < GREEDY_EPS <= p.temperature  # the sampler's rule
