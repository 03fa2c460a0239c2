"""The engine step split in two (launch_step / finish_step) so that host work overlaps a device
step: what a caller does between the two must not change any result. Runs the CPU backend on
the tiny model; the ordering logic is the same for CUDA, whose submit returns before the GPU
is done (gpu/cuda/runner.py)."""
from __future__ import annotations

import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.ipc.sampling_params import SamplingParams


def _engine(model_dir) -> EngineCore:
    return EngineCore(EngineConfig.create(model=str(model_dir), device="cpu", max_model_len=128,
                                          max_num_seqs=8, max_num_batched_tokens=64))


PARAMS = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=11, ignore_eos=True,
                         presence_penalty=0.5, logprobs=2)]
PROMPTS = [[5, 9, 33, 7, 100, 101], [17] * 40 + [3, 4], [200, 3]]


def _collect(outputs, into):
    for o in outputs:
        into.setdefault((o.request_id, o.index), []).append(
            (o.new_token_ids, o.finished, o.finish_reason,
             None if o.logprobs is None else [sorted(p) for p in o.logprobs]))


def test_work_between_launch_and_finish_changes_nothing(tiny_model_dir):
    """A request that arrives while a step is in flight is scheduled from the next step on,
    exactly as if it had arrived after the step: both engines give the same outputs."""
    plain, split = _engine(tiny_model_dir), _engine(tiny_model_dir)
    expect, got = {}, {}
    for e in (plain, split):
        e.add_request("a", PROMPTS[0], PARAMS[0])
        e.add_request("b", PROMPTS[1], PARAMS[1])
    step = 0
    while plain.has_unfinished_requests() or split.has_unfinished_requests():
        _collect(plain.step(), expect)
        in_flight = split.launch_step()
        if step == 2:  # arrives during step 2 of `split`, after step 2 of `plain`
            split.add_request("c", PROMPTS[2], PARAMS[2])
        _collect(split.finish_step(in_flight), got)
        if step == 2:
            plain.add_request("c", PROMPTS[2], PARAMS[2])
        step += 1
    assert got == expect
    assert {k for k in got} == {("a", 0), ("b", 0), ("c", 0)}
    assert got[("c", 0)][0][3] is not None  # logprobs came through


def test_abort_in_flight_waits_for_the_step(tiny_model_dir):
    e = _engine(tiny_model_dir)
    e.add_request("a", PROMPTS[0], PARAMS[0])
    e.step()                                  # prefill: one token out
    free_before = e.kv.num_free_blocks
    in_flight = e.launch_step()
    e.abort_request("a")                      # the device may be writing a's blocks: not yet
    assert e.kv.num_free_blocks == free_before and e.num_running == 1
    with pytest.raises(RuntimeError, match="not finished"):
        e.launch_step()
    outs = e.finish_step(in_flight)
    assert [(o.new_token_ids != [], o.finished, o.finish_reason) for o in outs] == \
        [(True, False, None), (False, True, "abort")]   # the step's token, then the abort
    assert e.num_running == 0 and not e.has_unfinished_requests()
    assert e.kv.num_free_blocks > free_before


def test_a_step_with_nothing_to_sample_still_runs(tiny_model_dir):
    """A long prompt chunked over steps: the first steps sample nothing (empty rows)."""
    e = _engine(tiny_model_dir)
    e.add_request("long", list(range(3, 103)), PARAMS[0])  # 100 tokens, 64 per step
    first = e.finish_step(e.launch_step())
    assert first == [] and e.scheduler.running[0].num_computed_tokens == 64
    second = e.finish_step(e.launch_step())
    assert len(second) == 1 and len(second[0].new_token_ids) == 1
