"""Speculative decoding with n-gram drafts (engine/speculation.py): the config's refusals, the
proposer against a plain search, and the real engine on the real default model: greedy output
the same token for token with and without speculation, sampled output from the same
distribution, and the counters on a real server's /metrics."""
import json
import math

import httpx
import numpy as np
import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.ngram_proposer import propose_ngram
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server.llm import LLM
from test_http_server import metric_samples

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CODE = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
        "def sub(a, b):\n    return a - b\n")
PROMPTS = [
    "Repeat this code exactly, but rename add to plus:\n\n" + CODE + "\nThe code with plus:\n",
    "Days: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday, Tuesday,",
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("value, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 10**6}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": NaN}', "NaN"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1,
      "prompt_lookup_min": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 2}, "draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ("{not json", "not JSON"),
    ("[4]", "JSON object"),
])
def test_bad_speculative_config_refused_in_one_line(value, field):
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(ValueError) as e:
        EngineConfig.create(speculative_config=text, device="cpu")
    assert field in str(e.value) and "\n" not in str(e.value)


def test_speculative_decoding_on_cuda_tells_the_runner_its_verify_steps():
    """On CUDA the runner captures verify graphs (gpu/cuda/plan.py) for K and the most requests
    a step that speculates runs (disable_by_batch_size); without it, none."""
    limits = EngineConfig.create(speculative_config=NGRAM, device="cuda", max_num_seqs=32).step_limits
    assert (limits.num_speculative_tokens, limits.max_num_verify_seqs) == (4, 8)
    plain = EngineConfig.create(device="cuda", max_num_seqs=32).step_limits
    assert (plain.num_speculative_tokens, plain.max_num_verify_seqs) == (0, 0)


def test_speculative_config_defaults_as_vllm():
    spec = EngineConfig.create(speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                               device="cpu").speculative
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 5)
    one = EngineConfig.create(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 4}, device="cpu").speculative
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix n-gram's earliest earlier occurrence, the plain way."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(0, length - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_a_plain_search():
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(400):
        tokens = rng.integers(0, 3 + trial % 7, size=int(rng.integers(1, 40))).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        want = _brute_force(tokens.tolist(), lo, hi, k)
        assert propose_ngram(tokens, lo, hi, k).tolist() == want, (tokens.tolist(), lo, hi, k)
        found += bool(want)
    assert 100 < found < 400   # both cases are exercised


@pytest.fixture(scope="module")
def llms(default_model_dir):
    """The default model without and with n-gram speculation (speculating at any batch size,
    for the sampling test's 200 sequences)."""
    common = dict(model=str(default_model_dir), device="cpu", max_model_len=512,
                  max_num_batched_tokens=2048)
    return LLM(**common), LLM(**common, speculative_config={**NGRAM, "disable_by_batch_size": 256})


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_output_is_the_same_token_for_token(llms):
    plain, spec = llms
    before = spec.engine.scheduler.speculation.stats.num_accepted_tokens
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=24, n=2),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0, max_tokens=5)]   # max_tokens mid-acceptance
    a, b = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert _tokens(a) == _tokens(b)
    for o, p in zip(b, params, strict=True):
        assert all(len(c.token_ids) <= p.max_tokens for c in o.outputs)
    for x, y in zip(a[2].outputs[0].logprobs, b[2].outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        for t in x:   # a verify row is one of many query tokens: the same logits to float error
            assert abs(x[t].logprob - y[t].logprob) < 2e-3
    accepted = spec.engine.scheduler.speculation.stats.num_accepted_tokens - before
    assert accepted > 20    # the copy-heavy prompts were sped up, not just run


def test_greedy_same_with_stops_penalties_min_tokens_and_grammar(llms):
    plain, spec = llms
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "days": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "days"]}
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=["mul"]),            # a stop string
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[11]),     # a stop id (",")
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[3],
               "Reply with JSON: name is Ada, days are Monday, Tuesday, Monday, Tuesday.\n"]
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert _tokens(a) == _tokens(b)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert "mul" not in b[0].outputs[0].text and b[0].outputs[0].finish_reason == "stop"
    assert len(b[3].outputs[0].token_ids) >= 12
    assert set(json.loads(b[4].outputs[0].text)) == {"name", "days"}


def test_preemption_and_abort_with_drafts(default_model_dir, llms):
    """A pool too small for all: requests with drafts in flight are preempted and recomputed,
    and their output is still the plain engine's; an abort mid-way frees every block."""
    plain, _ = llms
    small = LLM(model=str(default_model_dir), device="cpu", max_model_len=192,
                num_gpu_blocks_override=12, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=24)
    assert _tokens(small.generate(PROMPTS[:3], params)) == _tokens(plain.generate(PROMPTS[:3], params))
    core = small.engine
    assert core.stats is not None and core.scheduler.speculation.stats.num_drafts > 0
    core.add_request("x", small.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=60))
    got = []
    while len(got) < 12:
        got += [t for o in core.step() for t in o.new_token_ids]
    core.abort_request("x")
    outs = core.step()
    assert [o.finish_reason for o in outs] == ["abort"] and not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def _chi_square_same(xs: list[int], ys: list[int]) -> tuple[float, float]:
    """The chi-square statistic of two samples being one distribution (categories with fewer
    than 10 in both pooled as one) and its 0.999 quantile (Wilson-Hilferty)."""
    cats = sorted(set(xs) | set(ys))
    cx = {c: xs.count(c) for c in cats}
    cy = {c: ys.count(c) for c in cats}
    rows, other = [], [0, 0]
    for c in cats:
        if cx[c] + cy[c] >= 10:
            rows.append([cx[c], cy[c]])
        else:
            other[0] += cx[c]
            other[1] += cy[c]
    if sum(other):
        rows.append(other)
    table = np.array(rows, np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = max(len(rows) - 1, 1)
    z = 3.09   # the 0.999 normal quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_target_distribution(llms):
    """160 seeded samples each, temperature 1: the tokens after drafts (positions 2-3, sampled
    in verify rows when drafts were accepted) have the same distribution with and without
    speculation (a chi-square test at 0.999; fixed seeds: it cannot flake)."""
    plain, spec = llms
    prompt = "Colors: red, blue, green, red, blue, green, red, blue,"
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=3, n=160, seed=7, ignore_eos=True)
    stats = spec.engine.scheduler.speculation.stats
    before = stats.num_accepted_tokens
    a, b = plain.generate([prompt], params)[0].outputs, spec.generate([prompt], params)[0].outputs
    assert stats.num_accepted_tokens - before > 60    # drafts were accepted and sampled after
    for pos in (1, 2):
        xs, ys = [c.token_ids[pos] for c in a], [c.token_ids[pos] for c in b]
        stat, limit = _chi_square_same(xs, ys)
        assert stat < limit, (pos, stat, limit)
    joint_a = [tuple(c.token_ids[1:3]) for c in a]
    joint_b = [tuple(c.token_ids[1:3]) for c in b]
    codes = {t: i for i, t in enumerate(sorted(set(joint_a) | set(joint_b)))}
    stat, limit = _chi_square_same([codes[t] for t in joint_a], [codes[t] for t in joint_b])
    assert stat < limit


def test_spec_decode_counters_on_metrics(serve, tiny_model_dir):
    server = serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu",
                   "--drain-timeout", "2", "--speculative-config", json.dumps(NGRAM))
    body = {"model": "m", "prompt": "one two three one two three one two three one two",
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    models = httpx.get(server.url + "/v1/models").json()["data"]
    body["model"] = models[0]["id"]
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    text = httpx.get(server.url + "/metrics").text

    def total(name):
        return sum(v for _, v in metric_samples(text, f"ringserve:spec_decode_{name}_total"))
    drafts, draft_tokens = total("num_drafts"), total("num_draft_tokens")
    accepted = total("num_accepted_tokens")
    per_pos = metric_samples(text, "ringserve:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and 0 <= accepted <= draft_tokens <= 4 * drafts
    assert len(per_pos) == 4 and sum(v for _, v in per_pos) == accepted
    assert 'position="3"' in per_pos[3][0]
    assert metric_samples(text, "ringserve:spec_decode_num_disabled_steps_total")


def test_a_verify_row_whose_sampling_raises_ends_only_its_request(llms):
    """A request whose top_p turns 0 in float32 mid-way (it slipped past validation) fails in a
    verify step's rows: it ends with "error", the request beside it keeps its greedy tokens."""
    plain, spec = llms
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = plain.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    core = spec.engine
    ids = spec.tokenizer.encode(PROMPTS[0])
    core.add_request("good", ids, greedy)
    bad = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1)
    core.add_request("bad", ids, bad)
    got: dict[str, list] = {"good": [], "bad": []}
    outs = []
    for step in range(200):
        if step == 2:
            bad.top_p = 1e-46
            drafts_before = core.scheduler.speculation.stats.num_drafts
        outs = core.step()
        if step == 2:
            assert core.scheduler.speculation.stats.num_drafts > drafts_before  # a verify step
        for o in outs:
            got[o.request_id].append(o)
        if not core.has_unfinished_requests():
            break
    assert got["bad"][-1].finish_reason == "error" and "sampling failed" in got["bad"][-1].error
    assert [t for o in got["good"] for t in o.new_token_ids] == want
    assert core.kv.num_free_blocks == core.kv.num_blocks
