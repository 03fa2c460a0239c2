"""Sampling on the GPU without a GPU (docs/design.md §8): the host side (uniform draws, penalty
packing) and the reference distribution against gpu/sampling/sampler.py on the CPU; the kernels and the
CudaSampler in Numba's CUDA simulator (its own process, like tests/test_cuda_sim.py) against
gpu/sampling/sampler.py and the references. The compile checks are in tests/test_cuda_compile.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ringserve.gpu.cuda import reference as ref
from ringserve.gpu.sampling import sampler as cpu_sampler
from ringserve.gpu.sampling.sampler import SamplingMetadata

IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
THREADS = 4  # the simulator runs a thread per CUDA thread: few threads, few barriers


def _meta(rows, seed=0, **extra):
    """rows: (temperature, top_k, top_p, min_p) per row; seeded generators for sampled rows."""
    a = np.array(rows, np.float32).reshape(-1, 4)
    c = [np.ascontiguousarray(a[:, i]) for i in range(4)]
    return SamplingMetadata(temperature=c[0], top_k=c[1].astype(np.int32), top_p=c[2],
                            min_p=c[3], generators=[np.random.default_rng(seed + i)
                                                       for i in range(len(a))], **extra)


def _penalty_meta(rng, B, V):
    meta = _meta([(1.0, 0, 1.0, 0.0)] * B)
    meta.presence_penalty = np.array([0.0, 0.5, 0.0, 1.5][:B], np.float32)
    meta.frequency_penalty = np.array([0.0, 0.0, 0.3, -0.4][:B], np.float32)
    meta.repetition_penalty = np.array([1.3, 1.0, 1.0, 0.8][:B], np.float32)
    meta.prompt_token_ids = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    meta.output_token_ids = [rng.integers(0, V, n).tolist() for n in (5, 0, 9, 4)[:B]]
    meta.banned_token_ids = [[], [3, 7, 3], [], [0]][:B]
    return meta


if not IN_SIMULATOR:
    @pytest.mark.sim
    def test_simulator_tests_pass_in_their_own_process(simulator_tests):
        simulator_tests(__file__)

    def test_uniforms_are_the_numpy_samplers_draws():
        from ringserve.gpu.cuda.sampler import draw_uniforms
        rows = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 0.9, 0.0)]
        shared = np.random.default_rng(9)  # one generator for unseeded rows: order matters
        meta = _meta(rows)
        meta.generators = [None, shared, shared]
        u = draw_uniforms(meta)
        expect = np.random.default_rng(9).random(2)
        assert u[0, 0] == 0 and np.allclose(u[0, 1:], expect.astype(np.float32)) and not u[1].any()
        # a row verifying a draft model's token draws two (accept_or_resample), in row order
        meta = _meta(rows)
        meta.generators = [None, shared := np.random.default_rng(9), shared]
        meta.draft_probs, meta.draft_token_ids = [None, np.ones(3) / 3, None], [-1, 1, -1]
        u = draw_uniforms(meta)
        a, b, c = np.random.default_rng(9).random(3).astype(np.float32)
        assert u[:, 1].tolist() == [a, b] and u[:, 2].tolist() == [c, 0]

    @pytest.mark.parametrize("seed", range(4))
    def test_rejection_reference_is_the_numpy_samplers_rule(seed):
        """ref.accept_or_resample (what the kernel is checked against) gives the token
        gpu/sampling/sampler.accept_or_resample gives with the same two uniform numbers."""
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(40) * 2
        p = cpu_sampler.dense_distribution(x, 0.9, 0, 1.0, 0.0)
        np.testing.assert_allclose(ref.sampling_probs(x, 0.9, 0, 1.0, 0.0), p)
        q = cpu_sampler.dense_distribution(rng.standard_normal(40) * 2, 1.0, 0, 1.0, 0.0)
        outcomes = set()
        for trial in range(50):
            draft = int(rng.choice(40, p=q))
            u = np.random.default_rng(trial).random(2)
            got = cpu_sampler.accept_or_resample(p, draft, q, np.random.default_rng(trial))
            assert got == ref.accept_or_resample(p, draft, q, *u)
            outcomes.add(got == draft)
        assert outcomes == {True, False}  # both the keep and the residual draw were taken

    def test_packed_penalties_hold_each_id_once():
        from ringserve.gpu.cuda.sampler import pack_penalties
        meta = _penalty_meta(np.random.default_rng(1), 4, 20)
        p = pack_penalties(meta, 4)
        for r in range(4):
            seen = p.seen_ids[p.seen_offsets[r]:p.seen_offsets[r + 1]]
            if meta.repetition_penalty[r] != 1.0:
                assert sorted(seen) == sorted(set(meta.prompt_token_ids[r]) | set(meta.output_token_ids[r]))
            else:
                assert len(seen) == 0
            ids = p.count_ids[p.count_offsets[r]:p.count_offsets[r + 1]]
            counts = p.counts[p.count_offsets[r]:p.count_offsets[r + 1]]
            if meta.frequency_penalty[r] or meta.presence_penalty[r]:
                assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {
                    t: meta.output_token_ids[r].count(t) for t in set(meta.output_token_ids[r])}
            banned = p.banned_ids[p.banned_offsets[r]:p.banned_offsets[r + 1]]
            assert sorted(banned) == sorted(set(meta.banned_token_ids[r]))
        assert pack_penalties(_meta([(1.0, 0, 1.0, 0.0)]), 1) is None

    @pytest.mark.parametrize("params", [(0.8, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (1.2, 0, 0.7, 0.0),
                                        (0.9, 0, 1.0, 0.2), (1.0, 6, 0.8, 0.05)])
    def test_reference_distribution_is_the_numpy_samplers(params):
        """sampling_probs (what the kernel draws from) vs gpu/sampling/sampler.sample_row, by drawing."""
        rng = np.random.default_rng(2)
        logits = (rng.standard_normal(12) * 2).astype(np.float32)
        probs = ref.sampling_probs(logits, *params)
        gen = np.random.default_rng(3)
        n = 20000
        draws = np.bincount([cpu_sampler.sample_row(logits, *params, gen) for _ in range(n)],
                            minlength=12) / n
        assert set(np.flatnonzero(draws)) <= set(np.flatnonzero(probs))   # nothing filtered is drawn
        assert set(np.flatnonzero(probs > 1e-3)) <= set(np.flatnonzero(draws))
        assert 0.5 * np.abs(draws - probs).sum() < 0.015

else:
    pytestmark = pytest.mark.sim
    from numba import config as numba_config
    from numba import cuda

    from ringserve.gpu.cuda import sampling_kernels as sk
    from ringserve.gpu.cuda.sampler import CudaSampler, pack_penalties

    assert numba_config.ENABLE_CUDASIM

    def _logits(rng, B, V):
        x = (rng.standard_normal((B, V)) * 2).astype(np.float32)
        x[:, 5] = x[:, 9] = x.max() + 1.0  # a tie at the top: greedy takes the first
        return x

    def test_penalties_match_the_numpy_sampler():
        rng = np.random.default_rng(4)
        x = _logits(rng, 4, 20)
        meta = _penalty_meta(rng, 4, 20)
        expect = cpu_sampler.apply_penalties(x.copy(), meta)
        p = pack_penalties(meta, 4)
        got = x.copy()
        sk.penalties(got, p.seen_ids, p.seen_offsets, p.count_ids, p.counts, p.count_offsets,
                     p.banned_ids, p.banned_offsets, p.presence, p.frequency, p.repetition,
                     threads=THREADS)
        np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)

    def test_greedy_and_filtered_sampling_match_the_references():
        rng = np.random.default_rng(5)
        rows = [(0.0, 0, 1.0, 0.0), (0.9, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0),
                (0.8, 0, 1.0, 0.3), (1.0, 5, 0.9, 0.02), (0.7, 1, 1.0, 0.0)]
        x = _logits(rng, len(rows), 24)
        meta = _meta(rows)
        u = np.array([0.0, 0.13, 0.5, 0.77, 0.999, 0.31, 0.6], np.float32)
        out = np.full(len(rows), -1, np.int32)
        sk.sample(x, meta.temperature, meta.top_k, meta.top_p, meta.min_p, u, out, threads=THREADS)
        assert out[0] == 5  # first of the tied maxima, as np.argmax
        for r, params in enumerate(rows[1:], 1):
            assert out[r] == ref.inverse_cdf(ref.sampling_probs(x[r], *params), float(u[r])), (r, params)
        # u sweeps [0, 1) over one row (top_p and min_p): every draw is the reference's token
        params = (4.0, 0, 0.9, 0.02)  # flat enough for several tokens to be kept
        sweep = np.linspace(0, 0.999, 6, dtype=np.float32)
        probs = ref.sampling_probs(x[3], *params)
        xs = np.repeat(x[3:4], len(sweep), 0)
        m = _meta([params] * len(sweep))
        got = np.zeros(len(sweep), np.int32)
        sk.sample(xs, m.temperature, m.top_k, m.top_p, m.min_p, sweep, got, threads=THREADS)
        assert [ref.inverse_cdf(probs, float(s)) for s in sweep] == got.tolist()
        assert len(set(got.tolist())) > 2

    def test_draft_rows_are_rejection_sampled_as_the_reference():
        """Rows verifying a draft model's token (sample_kernel's draft=): over sweeps of both
        uniform numbers, every token is ref.accept_or_resample's (gpu/sampling/sampler.py's
        rule): kept, or drawn from the residual max(p - q, 0), or from p where q is p itself
        (a residual of rounding only); a row without q (-1) is sampled as before."""
        rng = np.random.default_rng(15)
        V = 24
        params = [(1.0, 0, 1.0, 0.0), (0.8, 5, 0.9, 0.0), (1.2, 0, 1.0, 0.05), (1.0, 0, 1.0, 0.0)]
        x = _logits(rng, len(params), V)
        probs = [ref.sampling_probs(x[r], *params[r]) for r in range(len(params))]
        q = np.stack([ref.sampling_probs(_logits(rng, 1, V)[0], 1.0, 0, 1.0, 0.0),
                      ref.sampling_probs(_logits(rng, 1, V)[0], 0.7, 0, 1.0, 0.0),
                      probs[2]]).astype(np.float32)             # row 2: q is p
        q_rows = np.array([0, 1, 2, -1], np.int32)
        # drafts with p/q nearest 1/2: kept at a small u, rejected at a large one
        near_half = [int(np.argmin(np.where(q[r] > 0.01, np.abs(probs[r] / q[r] - 0.5), np.inf)))
                     for r in range(2)]
        drafts = np.array([*near_half, int(np.argmax(probs[2])), 0], np.int32)
        seen = set()
        for u, u2 in [(0.05, 0.3), (0.5, 0.9), (0.95, 0.1), (0.999, 0.6), (0.7, 0.45)]:
            m = _meta(params)
            uniforms = np.full(len(params), u, np.float32)
            residual = np.full(len(params), u2, np.float32)
            out = np.full(len(params), -1, np.int32)
            sk.sample(x, m.temperature, m.top_k, m.top_p, m.min_p, uniforms, out,
                      draft=(q, q_rows, drafts, residual), threads=THREADS)
            for r in range(3):
                want = ref.accept_or_resample(probs[r], int(drafts[r]), q[r].astype(np.float64),
                                              float(uniforms[r]), float(residual[r]))
                assert out[r] == want, (r, u, u2)
                seen.add((r, out[r] == drafts[r]))
            assert out[3] == ref.inverse_cdf(probs[3], float(u))
        assert {(0, True), (0, False), (1, False)} <= seen   # kept and resampled (row 1: top-k/p)

    def test_cuda_sampler_verifies_a_draft_models_tokens_as_the_numpy_sampler():
        """The whole host + device path with a draft model's q (engine/sampling_metadata.
        build_verify_metadata's draft_probs): the same seeds give the numpy sampler's tokens,
        both uniform numbers of a row drawn on the host in its order; a greedy row compares."""
        rng = np.random.default_rng(16)
        V = 30
        x = _logits(rng, 5, V)
        meta = _meta([(1.0, 0, 1.0, 0.0), (0.9, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0),
                      (1.1, 0, 1.0, 0.0)], seed=21)
        qs = [cpu_sampler.dense_distribution(_logits(rng, 1, V)[0], 1.0, 0, 1.0, 0.0) for _ in range(3)]
        meta.draft_probs = [qs[0], qs[1], None, None, qs[2]]   # row 2: the bonus row; 3: greedy
        meta.draft_token_ids = [int(np.argmax(qs[0])), int(np.argsort(qs[1])[-2]), -1, 4,
                                int(np.argmax(qs[2]))]
        want = cpu_sampler.sample(x, _copy_meta(meta, seed=21))
        got = CudaSampler(threads=THREADS).sample(cuda.to_device(x), _copy_meta(meta, seed=21))
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        assert got.token_ids[3] == x[3].argmax()

    def test_cuda_sampler_matches_the_numpy_sampler():
        """The whole host + device path: the same seeds give the same tokens as gpu/sampling/sampler.py
        where its draw is unambiguous (greedy, top_k 1, or one dominant token), and logprobs agree."""
        rng = np.random.default_rng(6)
        B, V = 4, 30
        x = (rng.standard_normal((B, V))).astype(np.float32)
        x[1, 17] += 30.0  # sampled row with one dominant token
        meta = _penalty_meta(rng, B, V)
        meta.temperature = np.array([0.0, 1.0, 0.0, 0.7], np.float32)
        meta.top_k = np.array([0, 0, 0, 1], np.int32)
        meta.max_num_logprobs = 3
        expect = cpu_sampler.sample(x, _copy_meta(meta, seed=11))
        sampler = CudaSampler(threads=THREADS)
        got = sampler.sample(cuda.to_device(x), _copy_meta(meta, seed=11))
        np.testing.assert_array_equal(got.token_ids, expect.token_ids)
        np.testing.assert_array_equal(got.logprobs.token_ids, expect.logprobs.token_ids)
        np.testing.assert_allclose(got.logprobs.logprobs, expect.logprobs.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.logprobs.sampled_rank, expect.logprobs.sampled_rank)
        # a second call reuses the buffers; a smaller batch without extras
        small = _meta([(0.0, 0, 1.0, 0.0)] * 2)
        again = sampler.sample(cuda.to_device(x[:2]), small)
        np.testing.assert_array_equal(again.token_ids, x[:2].argmax(-1))
        assert again.logprobs is None

    def test_token_bitmask_matches_the_numpy_sampler():
        """Structured outputs: the kernel sets -inf exactly where gpu/sampling/sampler.py's
        apply_token_bitmask does, on the constrained rows only; sampled through CudaSampler, a
        row only ever gets an allowed token."""
        rng = np.random.default_rng(8)
        B, V = 3, 70  # 3 words per row, the last one partly past the vocabulary
        x = _logits(rng, B, V)
        mask = np.full((B, 3), -1, np.int32)
        mask[0] = [0, 1 << 4, 0]                           # token 36 only
        mask[2] = rng.integers(-2**31, 2**31 - 1, 3, dtype=np.int64).astype(np.int32)
        expect = x.copy()
        cpu_sampler.apply_token_bitmask(expect, mask)
        rows = np.array([0, 2], np.int32)
        got = x.copy()
        sk.bitmask(got, np.ascontiguousarray(mask[rows]), rows, threads=THREADS)
        np.testing.assert_array_equal(got, expect)
        assert np.isneginf(got[0]).sum() == V - 1 and not np.isneginf(got[1]).any()
        calls = []  # the engine hands over a function: computed when sampling, once
        meta = _meta([(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.5, 0, 1.0, 0.0)], seed=3,
                     allowed_token_bitmask=lambda: calls.append(1) or mask, max_num_logprobs=1)
        want = cpu_sampler.sample(x, _copy_meta(meta, seed=3))
        out = CudaSampler(threads=THREADS).sample(cuda.to_device(x), meta)
        assert len(calls) == 2 and meta.token_bitmask() is mask and len(calls) == 2
        assert out.token_ids[0] == 36 and out.token_ids[1] == x[1].argmax()
        assert np.isfinite(expect[2, out.token_ids[2]])    # an allowed token
        assert out.token_ids[:2].tolist() == want.token_ids[:2].tolist()
        # logprobs are the raw model's, as on the CPU
        np.testing.assert_allclose(out.logprobs.logprobs, want.logprobs.logprobs, rtol=1e-5, atol=1e-5)

    def test_cuda_sampler_samples_verify_rows_as_the_numpy_sampler():
        """Speculative decoding's verify rows (engine/sampling_metadata.build_verify_metadata:
        1 + k rows a request, row j as if its first j drafts were accepted) on the device as
        gpu/sampling/sampler.py samples them on the CPU: the same tokens and logprobs. Row by
        row the drafts count: token 11 leads every row of `a`, and once it is a draft before
        the row its repetition and frequency penalties push it down; eos leads every row of
        `b` (min_tokens 3, one output), banned until its output and drafts make 3."""
        from ringserve.engine.request import Request
        from ringserve.engine.sampling_metadata import build_verify_metadata
        from ringserve.ipc.sampling_params import SamplingParams

        V, eos = 40, 2
        a = Request("a", [1, 3], SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.5,
                                                frequency_penalty=0.5, logprobs=2), eos_token_ids=(eos,))
        b = Request("b", [4], SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3),
                    eos_token_ids=(eos,))
        c = Request("c", [5, 6], SamplingParams(temperature=0.0, max_tokens=9), eos_token_ids=(eos,))
        for req, out in ((a, [7, 8]), (b, [9]), (c, [10])):
            for t in out:
                req.append_output_token(t)
        drafts = [[11, 12, 13], [eos, 14], None]
        meta = build_verify_metadata([a, b, c], drafts, lambda reqs, drafts: None)
        x = np.random.default_rng(12).standard_normal((4 + 3 + 1, V)).astype(np.float32)
        x[:4, 11] = x[:4].max() + 0.5
        x[4:7, eos] = x[4:7].max() + 0.5
        want = cpu_sampler.sample(x, _copy_meta(meta, seed=0))
        got = CudaSampler(threads=THREADS).sample(cuda.to_device(x), _copy_meta(meta, seed=0))
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        tokens = got.token_ids.tolist()
        assert tokens[0] == 11 and 11 not in tokens[1:4]          # a: 11 a draft before rows 1-3
        assert eos not in tokens[4:6] and tokens[6] == eos        # b: 1 + 2 drafts reach min_tokens
        assert tokens[7] == x[7].argmax()
        np.testing.assert_array_equal(got.logprobs.token_ids, want.logprobs.token_ids)
        np.testing.assert_allclose(got.logprobs.logprobs, want.logprobs.logprobs, rtol=1e-5, atol=1e-5)

    def test_one_pending_sample_at_a_time():
        sampler = CudaSampler(threads=THREADS)
        x = cuda.to_device(np.arange(8, dtype=np.float32).reshape(2, 4))
        pending = sampler.sample_async(x, _meta([(0.0, 0, 1.0, 0.0)] * 2))
        with pytest.raises(RuntimeError, match="result"):
            sampler.sample_async(x, _meta([(0.0, 0, 1.0, 0.0)] * 2))
        assert pending.result().token_ids.tolist() == [3, 3]
        assert sampler.sample(x, _meta([(0.0, 0, 1.0, 0.0)] * 2)).token_ids.tolist() == [3, 3]

    def test_warmup_metadata_launch_every_kernel_with_inputs_from_pinned_buffers(monkeypatch):
        """What CudaModelRunner.warm_up samples with: every sampling kernel runs (none compiles
        later, on a request), and every host input reaches the device from a pinned buffer
        (from pageable memory the copy would wait for the stream's forward)."""
        from ringserve.gpu.cuda.sampler import warmup_metadata
        launched = set()
        for name in ("penalties", "sample", "logprobs", "bitmask"):
            real = getattr(sk, name)
            monkeypatch.setattr(sk, name, lambda *a, _n=name, _f=real, **k: (launched.add(_n), _f(*a, **k)))
        sampler = CudaSampler(threads=THREADS)
        x = cuda.to_device(np.arange(8, dtype=np.float32).reshape(1, 8))
        for meta in warmup_metadata():
            out = sampler.sample(x, meta)
            assert out.logprobs is not None and out.token_ids.shape == (1,)
        assert launched == {"penalties", "sample", "logprobs", "bitmask"}
        inputs = set(sampler._dev.arrays) - {"work", "token_ids", "lp_ids", "lp_vals", "lp_rank"}
        assert "sampling_rows" in inputs and "seen_ids" in inputs and "mask" in inputs
        for name in inputs:
            staged = sampler._host.arrays.get("in_" + name)
            assert staged is not None, f"{name}: copied to the device from pageable memory"

    def _copy_meta(meta, seed):
        import copy
        m = copy.copy(meta)
        m.generators = [np.random.default_rng(seed + i) for i in range(len(meta.temperature))]
        return m
