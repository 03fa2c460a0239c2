"""Speculative decoding with a draft model (engine/draft_proposer.py): the config, the refusal of
a draft with another vocabulary, the rejection sampler against the target distribution, and the
real engine on the real default model with real drafts: the default model's first 6 layers (an
early-exit draft, right only now and then) and the default model itself (every greedy draft
right, which only a draft KV cache that mirrors the target's through preemption, prefix hits
and rejections gives)."""
import json

import httpx
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ringserve.engine.config import EngineConfig
from ringserve.gpu.sampling.sampler import SamplingMetadata, dense_distribution, sample
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server.llm import LLM
from test_http_server import metric_samples
from test_speculative import PROMPTS, _chi_square_same, _tokens

# one thread: a parallel region waits for a core the other test processes hold
COMMON = dict(device="cpu", max_model_len=512, num_gpu_blocks_override=256, cpu_threads=1)


def _draft(model, k=3, **extra):
    return {"model": str(model), "num_speculative_tokens": k, "disable_by_batch_size": 256, **extra}


def test_draft_model_config_as_vllm():
    spec = EngineConfig.create(speculative_config={"model": "/m", "num_speculative_tokens": 2},
                               device="cpu").speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m", 2)
    same = EngineConfig.create(speculative_config={"method": "draft_model", "model": "/m",
                                                   "num_speculative_tokens": 2}, device="cpu")
    assert same.speculative == spec
    on_cuda = EngineConfig.create(speculative_config={"model": "/m", "num_speculative_tokens": 2},
                                  device="cuda")
    assert on_cuda.speculative == spec   # a draft runs on CUDA too (docs/speculative.md)


@pytest.mark.parametrize("value, field", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": 3, "num_speculative_tokens": 2}, "model"),
    ({"model": "/m", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "model"),
])
def test_bad_draft_config_refused_in_one_line(value, field):
    with pytest.raises(ValueError) as e:
        EngineConfig.create(speculative_config=json.dumps(value), device="cpu")
    assert field in str(e.value) and "\n" not in str(e.value)


def test_rejection_sampling_follows_the_target_distribution():
    """20,000 rows, each verifying a token drawn from q (far from p), with temperature 0.7 and
    top_k 6 applied to the target row: the tokens out follow p (chi-square at 0.999), the draft
    is kept min(1, p/q) of the time, and a sampler that kept every draft fails."""
    rng = np.random.default_rng(0)
    vocab, n = 10, 20000
    target = rng.normal(0, 1.5, vocab).astype(np.float32)
    p = dense_distribution(target, 0.7, 6, 1.0, 0.0)
    q = dense_distribution(rng.normal(0, 1.5, vocab).astype(np.float32), 1.0, 0, 1.0, 0.0)
    drafts = rng.choice(vocab, size=n, p=q)
    gen = np.random.default_rng(1)
    meta = SamplingMetadata(temperature=np.full(n, 0.7, np.float32), top_k=np.full(n, 6, np.int32),
                            top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                            generators=[gen] * n, draft_token_ids=drafts.tolist(), draft_probs=[q] * n)
    tokens = sample(np.tile(target, (n, 1)), meta).token_ids
    seen = np.bincount(tokens, minlength=vocab)
    keep = p > 0
    stat = float(((seen[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
    assert seen[~keep].sum() == 0 and stat < 27.9, stat          # 0.999 quantile, 9 df at most
    accepted = float((tokens == drafts).mean())
    assert abs(accepted - np.minimum(p, q).sum()) < 0.02
    kept_all = np.bincount(drafts, minlength=vocab)                 # what keeping every draft gives
    assert float(((kept_all[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum()) > 1000


@pytest.fixture(scope="module")
def early_exit_draft(default_model_dir, tmp_path_factory):
    """The default model's first 6 of its 30 layers, its embeddings, norm and tokenizer: a cheap
    draft that shares the vocabulary, far from the target (its q is not p)."""
    keep = 6
    out = tmp_path_factory.mktemp("early-exit-draft")
    with safe_open(str(default_model_dir / "model.safetensors"), "np") as f:
        meta = f.metadata()
        names = [k for k in f.keys()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep]
        save_file({k: f.get_tensor(k) for k in names}, str(out / "model.safetensors"),
                  metadata={**meta, "ringserve.block_types": json.dumps(
                      {k: v for k, v in json.loads(meta["ringserve.block_types"]).items() if k in names})})
    config = json.loads((default_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": keep}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((default_model_dir / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def engines(default_model_dir, early_exit_draft):
    """The default model without speculation, and with the early-exit draft (K = 3)."""
    return (LLM(model=str(default_model_dir), **COMMON),
            LLM(model=str(default_model_dir), **COMMON, speculative_config=_draft(early_exit_draft)))


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(default_model_dir, tiny_model_dir):
    with pytest.raises(ValueError) as e:   # refused before the draft is loaded
        LLM(model=str(tiny_model_dir), **COMMON, speculative_config=_draft(default_model_dir))
    msg = str(e.value)
    assert str(tiny_model_dir) in msg and str(default_model_dir) in msg and "vocab" in msg
    assert "\n" not in msg


def test_a_draft_model_not_found_is_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="--speculative-config: the draft model: .*missing.gguf") as e:
        LLM(model=str(tiny_model_dir), **COMMON, speculative_config=_draft(tmp_path / "missing.gguf"))
    assert "\n" not in str(e.value)


def test_greedy_output_is_the_same_token_for_token(engines):
    plain, spec = engines
    stats = spec.engine.scheduler.speculation.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "days": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "days"]}
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=16, n=2, logprobs=2),
              SamplingParams(temperature=0, max_tokens=5),                       # max_tokens mid-acceptance
              SamplingParams(temperature=0, max_tokens=30, stop=["mul"]),
              SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[11]),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                             presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=12),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema))]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[3],
               "Reply with JSON: name is Ada, days are Monday, Tuesday, Monday, Tuesday.\n"]
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a[1].outputs[0].logprobs, b[1].outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()    # the target's logprobs, to float error (a verify row)
        assert all(abs(x[t].logprob - y[t].logprob) < 2e-3 for t in x)
    assert "mul" not in b[3].outputs[0].text and len(b[6].outputs[0].token_ids) >= 12
    assert set(json.loads(b[7].outputs[0].text)) == {"name", "days"}
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert 0 < accepted < drafted     # both accepted and rejected drafts


def test_sampled_tokens_follow_the_target_distribution(engines):
    """160 seeded samples each at temperature 1 (top_p 0.95): the first two tokens sampled in
    verify rows (positions 1 and 2) and their pair have the target's distribution (chi-square
    at 0.999; fixed seeds: it cannot flake), with drafts both accepted and rejected."""
    plain, spec = engines
    prompt = "Colors: red, blue, green, red, blue, green, red, blue,"
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=3, n=160, seed=7, ignore_eos=True)
    stats = spec.engine.scheduler.speculation.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    a, b = plain.generate([prompt], params)[0].outputs, spec.generate([prompt], params)[0].outputs
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert accepted > 16 and drafted - accepted > 16
    for pos in (1, 2):
        stat, limit = _chi_square_same([c.token_ids[pos] for c in a], [c.token_ids[pos] for c in b])
        assert stat < limit, (pos, stat, limit)
    joint_a, joint_b = [tuple(c.token_ids[1:3]) for c in a], [tuple(c.token_ids[1:3]) for c in b]
    codes = {t: i for i, t in enumerate(sorted(set(joint_a) | set(joint_b)))}
    stat, limit = _chi_square_same([codes[t] for t in joint_a], [codes[t] for t in joint_b])
    assert stat < limit


def test_self_draft_is_always_right_through_preemption_prefix_hits_and_abort(default_model_dir, engines):
    """The default model drafting for itself in an 8-block pool: requests are preempted and
    recomputed, the second round finds their prompts in the prefix cache, and every greedy
    draft is still accepted (a draft K/V missing or stale anywhere would cost acceptance);
    the output is the plain engine's; an abort mid-way frees every block."""
    plain, _ = engines
    small = LLM(model=str(default_model_dir), device="cpu", max_model_len=128, cpu_threads=1,
                num_gpu_blocks_override=8, speculative_config=_draft(default_model_dir))
    core, params = small.engine, SamplingParams(temperature=0, max_tokens=24)
    want = _tokens(plain.generate(PROMPTS[:3], params))
    stats = core.scheduler.speculation.stats
    preempted = hits = 0
    for round_ in range(2):
        for i, prompt in enumerate(PROMPTS[:3]):
            core.add_request(f"{round_}-{i}", small.tokenizer.encode(prompt), params)
        got: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            preempted += core.stats.num_preemptions
            hits += core.stats.prefix_cache_hits
        assert [[got[f"{round_}-{i}"]] for i in range(3)] == want
    assert preempted > 0 and hits > 0
    assert stats.num_draft_tokens > 60 and stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens
    core.add_request("x", small.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=60))
    for _ in range(4):
        core.step()
    core.abort_request("x")
    assert [o.finish_reason for o in core.step()] == ["abort"] and not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def _draft_cache_mirrors_the_target(core, req) -> int:
    """With a self-draft, the draft's K/V equals the target's at every slot the target holds
    for req, but the last one when its drafts were all accepted (written by the next catch-up);
    returns how many slots were compared."""
    target, draft = core.runner.kv_caches, core.draft_runner.kv_caches
    blocks, bs = core.kv.block_ids(req), core.block_size
    n = req.num_computed_tokens - 1
    for pos in range(n):
        b, o = blocks[pos // bs], pos % bs
        for t, d in zip(target, draft, strict=True):
            np.testing.assert_allclose(d.k[b, o], t.k[b, o], atol=1e-4, err_msg=f"position {pos}")
            np.testing.assert_allclose(d.v[b, o], t.v[b, o], atol=1e-4, err_msg=f"position {pos}")
    return n


def test_a_step_run_again_after_a_failure_keeps_the_draft_cache_whole(tiny_model_dir):
    """A step fails in the draft's catch-up, before its forward (a request added with corrupt
    state: a token that is not one, a temperature that is not a number, so it is found at
    fault) and the others run it again (engine/core.py _recover): the catch-up of the step run
    again starts where the failed one would have, one token early for the request whose
    drafts were all accepted, so the draft's K/V (a self-draft: the target's own) still
    mirrors the target's at every position, and every greedy draft stays accepted."""
    llm = LLM(model=str(tiny_model_dir), device="cpu", max_model_len=256, cpu_threads=1,
              num_gpu_blocks_override=64, speculative_config=_draft(tiny_model_dir))
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    core.add_request("good", list(range(5, 25)), params)
    for _ in range(4):
        core.step()
    good = core.groups["good"][0]
    core.add_request("bad", [9, 10, 11], SamplingParams(temperature=0, max_tokens=4))
    bad = core.groups["bad"][0]
    bad.params.temperature = "hot"      # corrupt state: at fault (recovery.probe)
    bad.all_token_ids[1] = "x"          # and the catch-up's token ids raise
    outs = core.step()
    assert [o.finish_reason for o in outs if o.request_id == "bad"] == ["error"]
    core.step()   # "good" runs the failed step again
    assert _draft_cache_mirrors_the_target(core, good) > 20
    while core.has_unfinished_requests():
        core.step()
    stats = core.scheduler.speculation.stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_draft_counters_and_memory_on_metrics(serve, tiny_model_dir):
    """A real server with a draft model (the tiny model drafting for itself): vLLM's counters,
    and the draft's weights and KV pool as memory parts of their own, as large as the target's
    (the same model, a KV pool of the same blocks), in /metrics and in the start-up line."""
    server = serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu",
                   "--drain-timeout", "2", "--speculative-config",
                   json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 2}))
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    text = httpx.get(server.url + "/metrics").text

    def total(name):
        return sum(v for _, v in metric_samples(text, f"ringserve:spec_decode_{name}_total"))
    assert total("num_drafts") > 0 and total("num_draft_tokens") <= 2 * total("num_drafts")
    assert total("num_accepted_tokens") > 0.9 * total("num_draft_tokens")

    parts = {labels.split('part="')[1].split('"')[0]: v
             for labels, v in metric_samples(text, "ringserve:memory_bytes")}
    assert parts["draft_weights"] == parts["weights_packed"] + parts["weights_float"] > 0
    assert parts["draft_kv_cache"] == parts["kv_cache"] > 0
    assert "draft model weights" in server.log.read_text()
