"""Scheduling policy (engine/scheduler.py) on the real KV-cache manager.

The model step here is the scheduler's own contract: after a step, every scheduled token is
in the cache, and a request whose last token was computed gets one new token.
"""
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.engine.config import SchedulerConfig
from ringserve.engine.inputs import build_batch
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.request import Request, RequestStatus
from ringserve.engine.scheduler import Scheduler, SchedulerOutput
from ringserve.engine.speculation import Speculation
from ringserve.engine.speculative import parse_speculative_config
from ringserve.ipc.sampling_params import SamplingParams


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, caching=False,
               window=0, long_prefill_token_threshold=0):
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             long_prefill_token_threshold=long_prefill_token_threshold)
    return Scheduler(kv, config)


def make_req(rid, prompt_len, max_tokens=100, first_token=1):
    return Request(rid, [first_token + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler, token=7) -> SchedulerOutput:
    """Schedule, 'compute', append a token to each request whose last token was computed,
    and finish those that reached max_tokens (blocks freed in this same step)."""
    out = sched.schedule()
    sched.update_after_step(out)
    sample(sched, out, lambda: token)
    return out


def sample(sched: Scheduler, out: SchedulerOutput, next_token: Callable[[], int]) -> None:
    """What the engine does after a step: a token for each row that samples one, and the
    max_tokens stop."""
    for s in out.scheduled:
        if s.samples_token:
            s.request.append_output_token(next_token())
            if s.request.num_output_tokens >= s.request.max_tokens:
                sched.finish(s.request, "length")


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_decode_goes_before_prefill_and_a_long_prompt_is_chunked():
    sched = make_sched(max_num_batched_tokens=10)
    a = make_req("a", 6)
    sched.add(a)
    assert plan(run_step(sched)) == [("a", 6)]
    b = make_req("b", 20)
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 9)]      # a's decode first, b gets what is left
    assert [s.samples_token for s in out.scheduled] == [True, False]
    assert b.num_output_tokens == 0               # a partial prefill samples nothing
    assert plan(run_step(sched)) == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 2)] and out.scheduled[1].samples_token
    assert b.num_output_tokens == 1
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 2
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]


def test_long_prefill_token_threshold_caps_each_prompt_chunk_not_decodes():
    """vLLM's long_prefill_token_threshold: a prompt (or a recompute) takes at most that many
    tokens a step, whether it is admitted now or already running; decodes are never capped, and
    what the cap leaves of the budget goes to the next waiting request."""
    sched = make_sched(max_num_batched_tokens=20, long_prefill_token_threshold=6)
    a, b = make_req("a", 3), make_req("b", 15)
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [("a", 3), ("b", 6)]     # a fits under the cap whole
    c = make_req("c", 9)
    sched.add(c)
    assert plan(run_step(sched)) == [("a", 1), ("b", 6), ("c", 6)]
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 3), ("c", 3)] and all(s.samples_token for s in out.scheduled)
    assert plan(run_step(sched)) == [("a", 1), ("b", 1), ("c", 1)]


@pytest.mark.parametrize("threshold", [0, 6, 7, 10**9])
def test_with_or_without_the_cap_a_prompt_is_computed_once_whole(threshold):
    sched = make_sched(max_num_batched_tokens=7, long_prefill_token_threshold=threshold)
    a = make_req("a", 23, max_tokens=2)
    sched.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        chunks += [n for _, n in plan(run_step(sched))]
    assert sum(chunks) == 23 and max(chunks) == min(7, threshold or 7)


@pytest.mark.parametrize("value", [-1, -(2**31)])
def test_a_negative_long_prefill_token_threshold_is_refused(value):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be at least 0"):
        SchedulerConfig(long_prefill_token_threshold=value)


def test_max_num_seqs_bounds_the_running_set_and_waiting_is_fcfs():
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [make_req(f"r{i}", 3, max_tokens=2) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert plan(run_step(sched)) == [("r0", 3), ("r1", 3)]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    out = run_step(sched)                         # r0, r1 finish: freed in this step
    assert plan(out) == [("r0", 1), ("r1", 1)] and reqs[0].is_finished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert plan(run_step(sched)) == [("r2", 3), ("r3", 3)]


def test_token_budget_is_shared_fcfs_without_overtaking():
    sched = make_sched(max_num_batched_tokens=8, num_blocks=3, block_size=4)
    a, b, c = make_req("a", 8), make_req("b", 9), make_req("c", 2)
    for r in (a, b, c):
        sched.add(r)
    assert plan(run_step(sched)) == [("a", 8)]
    # b does not fit the pool beside a; c would, but does not overtake b.
    out = sched.schedule()
    assert plan(out) == [("a", 1)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_the_newest_running_request_is_preempted_and_recomputed_first():
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=100)
    a, b = make_req("a", 7), make_req("b", 8)     # 2 blocks each: the pool is full
    sched.add(a), sched.add(b)
    run_step(sched, token=50)
    c = make_req("c", 2)
    sched.add(c)                                  # waits: no block left
    out = run_step(sched, token=51)               # a needs no block yet (8th token); b needs one
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [50]             # its generated tokens are kept ...
    assert [r.request_id for r in sched.waiting] == ["b", "c"]   # ... at the head of waiting
    assert sched.kv.block_ids(b) == []
    a_tokens = a.num_tokens
    sched.finish(a, "abort")
    assert sched.kv.num_free_blocks == 4
    out = run_step(sched, token=52)
    assert plan(out) == [("b", 9), ("c", 2)]      # ... and recomputed as part of its prompt
    assert b.output_token_ids == [50, 52] and a_tokens == 9


def test_prefix_cache_hit_skips_computed_blocks_but_not_the_last_token():
    sched = make_sched(block_size=4, caching=True)
    a = make_req("a", 12)
    sched.add(a)
    run_step(sched)
    b = make_req("b", 12)                         # same prompt
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 4)]      # 8 tokens hit, the last block recomputed
    assert sched.kv.block_ids(b)[:2] == sched.kv.block_ids(a)[:2]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    queries, hits = sched.kv.take_stats()
    assert (queries, hits) == (24, 8)


# -- the property: random workloads ---------------------------------------------------------

workloads = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "num_blocks": st.integers(4, 40),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(1, 48),
    "caching": st.booleans(),
    "window": st.sampled_from([0, 0, 1, 3, 6, 17]),   # a sliding window on every layer, or none
    "requests": st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12),   # prompt, max_tokens
                                   st.integers(0, 15), st.integers(-1, 40)),  # arrival, abort step
                         min_size=1, max_size=14),
    "seed": st.integers(0, 2**16),
    "drafts": st.integers(0, 4),   # speculative decoding: n-gram drafts up to this many (0: off)
    "long_prefill": st.sampled_from([0, 0, 1, 3, 8]),   # long_prefill_token_threshold (0: none)
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_budgets_ownership_and_a_free_pool_over_random_workloads(w):
    sched = make_sched(w["num_blocks"], w["block_size"], w["max_num_seqs"],
                       w["max_num_batched_tokens"], w["caching"], w["window"], w["long_prefill"])
    kv, rng = sched.kv, random.Random(w["seed"])
    if w["drafts"]:
        sched.speculation = Speculation(parse_speculative_config(
            {"method": "ngram", "num_speculative_tokens": w["drafts"], "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "disable_by_batch_size": 4}), max_model_len=1 << 20)
    pending = []
    for i, (plen, max_tokens, arrival, abort_at) in enumerate(w["requests"]):
        # Few distinct tokens, so that prompts share prefixes and the cache gets hits.
        req = Request(f"r{i}", [rng.randrange(3) for _ in range(plen)], SamplingParams(max_tokens=max_tokens))
        # the engine refuses others (engine/request_checks.py): with a window, a request longer
        # than the pool runs, its blocks freed behind the window
        if kv.max_blocks_held(plen + max_tokens - 1, w["max_num_batched_tokens"]) <= kv.num_blocks:
            pending.append((arrival, abort_at, req))
    live: list[Request] = []
    for step in range(2000):
        for item in [p for p in pending if p[0] == step]:
            pending.remove(item)
            sched.add(item[2])
            live.append(item[2])
        for req in live:
            if step == req_abort(w, req) and not req.is_finished:
                sched.finish(req, "abort")
        out = sched.schedule()
        check_budgets(out, sched, w)
        check_ownership(sched)
        if out.scheduled:
            check_slots(out, kv)
            check_windows(out, kv, w["drafts"], w["max_num_batched_tokens"])
        check_registered(out, kv)
        sched.update_after_step(out)
        accept(sched, out, rng)
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "a request was left waiting forever"
    assert all(r.is_finished for r in live)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def check_budgets(out: SchedulerOutput, sched: Scheduler, w: dict) -> None:
    """The step within max_num_batched_tokens and max_num_seqs, each request once, and every
    prompt chunk within long_prefill_token_threshold (a verify row is 1 + drafts: not a chunk)."""
    assert out.total_num_scheduled_tokens <= w["max_num_batched_tokens"]
    assert len(out.scheduled) <= w["max_num_seqs"] and len(sched.running) <= w["max_num_seqs"]
    assert len({s.request.key for s in out.scheduled}) == len(out.scheduled)
    if w["long_prefill"]:
        assert all(s.num_new_tokens <= w["long_prefill"] for s in out.scheduled
                   if not s.draft_token_ids), plan(out)


def accept(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    """What the engine does after a step, with drafts (EngineCore._take_tokens): a random
    number of them accepted, then one sampled token, stopping at max_tokens; num_computed_tokens
    counts the accepted drafts."""
    for s in out.scheduled:
        req, drafts = s.request, s.draft_token_ids or []
        if not s.samples_token:
            continue
        taken = drafts[:rng.randint(0, len(drafts))] + [rng.randrange(3)]
        for token in taken:
            req.append_output_token(token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, "length")
                break
        else:
            req.num_computed_tokens += len(taken) - 1   # the accepted drafts


def check_registered(out, kv) -> None:
    """A block the prefix cache may hand out holds only real tokens (no draft's K/V): a
    request's registered blocks lie within its tokens, and a step's drafts never overrun
    max_tokens."""
    for s in out.scheduled:
        req = s.request
        assert kv._num_registered[req.key] * kv.block_size <= req.num_tokens
        if s.draft_token_ids:
            assert req.num_output_tokens + len(s.draft_token_ids) < req.max_tokens


def check_slots(out, kv) -> None:
    """No two tokens of a step write one KV slot, and each writes into its own request's blocks."""
    batch = build_batch(out, kv)
    slots = batch.slot_mapping.tolist()
    assert len(set(slots)) == len(slots), "two tokens write one slot"
    for i, s in enumerate(out.scheduled):
        own = set(kv.block_ids(s.request))
        lo, hi = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        assert {slot // kv.block_size for slot in slots[lo:hi]} <= own


def check_windows(out, kv, max_drafts: int, budget: int) -> None:
    """With a window, each scheduled request holds every block its first new token reads (keys
    from num_computed - window + 1), and no more than those and one step's tokens' blocks
    (drafts included): freed ones are a -1 prefix of its table."""
    if not kv.sliding_window:
        return
    bs = kv.block_size
    for s in out.scheduled:
        ids = kv.block_ids(s.request)
        first = max(0, s.num_computed_tokens - kv.sliding_window + 1) // bs
        assert all(b >= 0 for b in ids[first:]) and all(b == -1 for b in ids[:first]), (ids, first)
        assert kv.num_held_blocks(s.request) == len(ids) - first
        # NOTE: blocks taken for an earlier step's rejected drafts stay (the next steps write
        # them), so the bound is the window plus a whole step's budget, not this step's tokens
        bound = kv.max_blocks_held(s.request.num_tokens + max_drafts, budget)
        assert len(ids) - first <= bound


def req_abort(w, req: Request) -> int:
    return w["requests"][int(req.request_id[1:])][3]


def check_ownership(sched: Scheduler) -> None:
    """A block is held by exactly ref_cnt requests; only cached full blocks are shared; free
    blocks belong to nobody."""
    kv = sched.kv
    holders: dict[int, int] = {}
    for req in sched.running:
        ids = [b for b in kv.block_ids(req) if b >= 0]   # -1: freed before a sliding window
        assert len(ids) == len(set(ids))
        assert len(kv.block_ids(req)) * kv.block_size >= req.num_computed_tokens
        for b in ids:
            holders[b] = holders.get(b, 0) + 1
    for req in sched.waiting:
        assert kv.block_ids(req) == []
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in kv.pool.free_queue)
        if block.ref_cnt > 1:
            assert block.block_hash is not None
