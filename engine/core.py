"""The engine core: one loop of schedule -> execute -> update per step (docs/design.md §1.3),
as vLLM V1's EngineCore. The parts live beside it, one idea each:

    request_checks.py    can a request ever run? (checked once, in add_request)
    scheduler.py         schedule: which requests run, how many tokens each
    inputs.py            execute: the step's Batch
    sampling_metadata.py execute: the step's sampling rows
    logprobs.py          execute/update: prompt-logprob rows out, logprobs back to requests
    stop.py              update: check_stop, the one stop rule
    recovery.py          a failed step: which request is at fault

Refusals and aborts: a request that can never run is not queued; it comes back from the next
step() as a finished EngineOutput (ipc/messages.py) with finish_reason ERROR and the message
in `.error`.
Invalid SamplingParams raise ValueError when they are built (ipc/sampling_params.py: by the
frontend, or by the engine process decoding a ring record). An abort comes
back the same way, with finish_reason ABORT. So every sample of every request gets exactly
one finished output.

Fault isolation: nothing one request carries may stop the others. A sampling row that raises
ends its request (every sample) with finish_reason "error" and the others are sampled as usual
(gpu/sampling/sampler.py); a step that raises anywhere else is examined request by request (_recover):
the requests found at fault end with "error" and the rest run the step again, as if it had
never happened; when no request is at fault (the batched forward failed) the step's requests
end with "error". The engine goes on either way, unless whole steps keep failing (a broken
device: MAX_FAILED_STEPS in a row raise, and the process is restarted). The common path pays
nothing for this: one try around the step, no check per request.

A request with n > 1 becomes n sequences (index 0..n-1, seed + index when seeded) that share
the prompt's blocks through the prefix cache (scoped to the request when caching is off).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ringserve.engine.config import EngineConfig, fit_max_model_len
from ringserve.engine.draft_proposer import DraftModelProposer, draft_limits, resolve_draft
from ringserve.engine.inputs import build_batch, verify_row_starts
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.logprobs import (
    PromptLogprobsOwners,
    position_logprobs,
    prompt_logprobs_spec,
    take_prompt_logprobs,
)
from ringserve.engine.recovery import MAX_FAILED_STEPS, find_culprits
from ringserve.engine.request import Request
from ringserve.engine.request_checks import check_request
from ringserve.engine.sampling_metadata import build_sampling_metadata, build_verify_metadata
from ringserve.engine.scheduler import Scheduler, SchedulerOutput
from ringserve.engine.speculation import Speculation
from ringserve.engine.speculative import SpeculativeConfig
from ringserve.engine.stats import SchedulerStats
from ringserve.engine.stop import check_stop
from ringserve.engine.structured_outputs import StructuredOutputs, advance
from ringserve.engine.trace import EngineTracer
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.runner import StepHandle
from ringserve.gpu.sampling.sampler import GREEDY_EPS, SamplerOutput, SamplingMetadata
from ringserve.ipc.limits import generator_seed
from ringserve.ipc.messages import EngineOutput, FinishReason
from ringserve.ipc.sampling_params import SamplingParams

log = logging.getLogger("ringserve.engine")
__all__ = ["EngineCore", "InFlightStep", "MAX_FAILED_STEPS"]


@dataclass
class InFlightStep:
    """A step between launch_step and finish_step."""
    sched: SchedulerOutput
    reqs: list[Request]              # the requests sampled this step, in the runner's row order
    handle: StepHandle | None        # runner.submit(...): result() -> SamplerOutput; None: nothing ran
    prompt_rows: PromptLogprobsOwners  # requests scoring prompt tokens, how many each, in order
    outputs: list[EngineOutput]      # refusals and aborts queued before the step
    start: float                     # monotonic start (tracing only)
    error: Exception | None = None   # launching it raised: finish_step recovers (_recover)
    # speculative decoding: each of reqs' draft tokens (None: none), when the step has any
    drafts: list[list[int] | None] | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, runner=None, draft_runner=None):
        """runner: a ready ModelRunner-like object (submit, config, block_size, num_blocks);
        None builds the ModelRunner for config.model. draft_runner: with a draft model in
        config.speculative, its ready runner (execute, as many blocks as runner's); None builds it."""
        self.config = config
        draft = draft_runner   # a draft model's runner, built beside the target's (CUDA: _make_runners)
        if runner is None:
            runner, draft = _make_runners(config)
        self.runner = runner
        model = runner.config
        self.vocab_size = model.vocab_size
        self.eos_token_ids = tuple(model.eos_token_ids)
        if (config.max_model_len or 0) > model.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} is longer than the model's "
                             f"max_position_embeddings {model.max_position_embeddings}")
        self.block_size = runner.block_size
        self.kv = KVCacheManager(runner.num_blocks, self.block_size,
                                 config.cache_config.enable_prefix_caching,
                                 sliding_window=model.uniform_window)
        pool_tokens = runner.num_blocks * self.block_size
        longest = max(config.max_model_len or 0, model.max_position_embeddings)
        if self.kv.max_blocks_held(longest, config.scheduler_config.token_budget) <= runner.num_blocks:
            pool_tokens = longest  # NOTE: a window on every layer bounds the blocks a request holds
        self.max_model_len, clamped = fit_max_model_len(
            config.max_model_len, model.max_position_embeddings, pool_tokens)
        if clamped is not None:
            log.warning("%s", clamped)
        self.scheduler = Scheduler(self.kv, config.scheduler_config)
        self.generator = np.random.default_rng(config.seed)   # for requests without a seed
        self.groups: dict[str, list[Request]] = {}            # request_id -> its n sequences
        self._pending: list[EngineOutput] = []               # refusals and aborts, out next step
        self._in_flight: InFlightStep | None = None          # launched, not finished
        # (request id, sample index, error message) of aborts that came while a step was in flight
        self._deferred_aborts: list[tuple[str, int | None, str | None]] = []
        self._failed_steps = 0                                # whole steps failed in a row
        self.stats = SchedulerStats()
        self.num_steps = 0
        self.tracer = EngineTracer(self)                      # records only traced requests
        tokenizer_dir = Path(config.tokenizer) if config.tokenizer else getattr(runner, "model_dir", None)
        self.structured = StructuredOutputs(tokenizer_dir, self.vocab_size, self.eos_token_ids)
        spec = config.speculative
        if spec is not None:
            proposer = None if spec.model is None else self._draft_proposer(spec, draft)
            self.scheduler.speculation = Speculation(spec, self.max_model_len, proposer)

    def _draft_proposer(self, spec: SpeculativeConfig, draft) -> DraftModelProposer:
        """The draft model's runner (engine/draft_proposer.py: its KV cache mirrors the
        target's blocks): built already (CUDA, _make_runners), or now on the target's backend
        and settings with as many blocks as the target's."""
        from ringserve.gpu.runner import ModelRunner

        if draft is None:
            draft_dir = resolve_draft(spec, self.config.model, getattr(self.runner, "model_dir", None),
                                      self.runner.config)
            cache = replace(self.config.cache_config, block_size=self.block_size,
                            num_gpu_blocks_override=self.runner.num_blocks)
            draft = ModelRunner(draft_dir, self.config.device_config, cache, draft_limits(self.config))
        return DraftModelProposer(draft, self.kv, spec.num_speculative_tokens, self.structured)

    # -- requests in -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                    params: SamplingParams, trace: bool = False) -> None:
        """trace: record the request's journey (engine/trace.py); it comes back on its last output."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        # One C call, no per-token Python int: an int32 array from the rings is taken as it is.
        prompt = np.asarray(prompt_token_ids)
        error, params = check_request(prompt, params, vocab_size=self.vocab_size,
                                      max_model_len=self.max_model_len,
                                      max_num_seqs=self.scheduler.max_num_seqs,
                                      max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                                      kv=self.kv)
        matchers: list | None = None  # structured outputs: one matcher per sample
        if error is None and isinstance(params.structured_outputs, str):  # made one in __post_init__
            try:
                matchers = self.structured.matchers(params.structured_outputs, params.n)
            except ValueError as e:
                error = str(e)
        if error is not None:  # one error output per sample (one for an n refused as too large)
            samples = params.n if params.n <= self.scheduler.max_num_seqs else 1
            self._pending.extend(EngineOutput(request_id, [], FinishReason.ERROR, index=i, error=error,
                                              num_prompt_tokens=len(prompt))
                                 for i in range(samples))
            return
        prompt = prompt.astype(np.int32, copy=False)
        caching = self.config.cache_config.enable_prefix_caching
        sharing_salt = request_id if params.n > 1 and not caching else None
        # Every sample is made before any is queued: a request that raises here leaves nothing.
        seed = None if params.seed is None else generator_seed(params.seed)
        group = [Request(request_id, prompt, params, index=i,
                         eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                         cache_salt=sharing_salt,
                         generator=(np.random.default_rng(seed + i) if seed is not None
                                    else None if params.temperature < GREEDY_EPS else self.generator),
                         matcher=None if matchers is None else matchers[i])
                 for i in range(params.n)]
        for req in group:
            if trace:
                self.tracer.watch(req)
            self.scheduler.add(req)
        self.groups[request_id] = group

    def abort_request(self, request_id: str, index: int | None = None,
                      error: str | None = None) -> None:
        """Stop a request now (only its sample `index` when given: a stop string ended that one);
        its blocks are free for the next step. Unknown ids are ignored (the request may have
        just finished). While a step is in flight, the abort waits for its end (the device may
        still be writing the request's blocks). error: end it with finish_reason "error" and
        this message instead of "abort" (it failed)."""
        if self._in_flight is not None:
            self._deferred_aborts.append((request_id, index, error))
            return
        reason = FinishReason.ABORT if error is None else FinishReason.ERROR
        for req in self.groups.get(request_id, ()):
            if not req.is_finished and (index is None or req.index == index):
                self.scheduler.finish(req, reason)
                self._pending.append(EngineOutput(request_id, [], reason, index=req.index,
                                                  num_prompt_tokens=req.num_prompt_tokens,
                                                  error=error))
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None and all(r.is_finished for r in group):
            del self.groups[request_id]

    # -- the loop ----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def draft_runner(self):
        """The draft model's runner (speculative decoding with a draft model), or None."""
        speculation = self.scheduler.speculation
        proposer = None if speculation is None else speculation.proposer
        return proposer.runner if isinstance(proposer, DraftModelProposer) else None

    @property
    def runner_is_asynchronous(self) -> bool:
        """Does runner.submit return before the device is done (so host work can overlap it)?"""
        return getattr(self.runner, "asynchronous", False)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def step(self) -> list[EngineOutput]:
        """One schedule -> execute -> update; the same as finish_step(launch_step())."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> InFlightStep:
        """Schedule, then execute: hand the step to the runner, which may return before the
        device is done (CUDA). Until finish_step, the caller may do host work that does not
        change this step: deliver the previous step's outputs, add requests (they wait for the
        next schedule), abort (applied in finish_step, after this step's tokens). Results are
        the same as step()'s."""
        if self._in_flight is not None:
            raise RuntimeError("launch_step: the previous step is not finished")
        outputs, self._pending = self._pending, []
        start = time.monotonic() if self.tracer.active else 0.0
        sched = self.scheduler.schedule()                                   # 1. schedule
        step = self._in_flight = InFlightStep(sched, [], None, [], outputs, start)
        if sched.scheduled:
            try:
                self._execute(step)                                         # 2. execute
            except Exception as e:  # noqa: BLE001 - finish_step finds the request(s) at fault
                step.error = e
        return step

    def _execute(self, step: InFlightStep) -> None:
        """Build the step's batch, sampling rows and prompt-logprob rows; submit them."""
        sched = step.sched
        speculation = self.scheduler.speculation
        # a draft model's forwards first: they fill the drafts in (and may drop some)
        draft_probs = None if speculation is None else speculation.proposer.prepare(sched)
        batch = build_batch(sched, self.kv)
        if self.tracer.active:
            self.tracer.on_scheduled(self.num_steps, step.start, sched, batch)
        rows = [i for i, s in enumerate(sched.scheduled) if s.samples_token]
        step.reqs = reqs = [sched.scheduled[i].request for i in rows]
        spec, step.prompt_rows = prompt_logprobs_spec(sched, batch)
        meta: SamplingMetadata | None
        if sched.num_draft_tokens:  # speculative decoding: 1 + k rows per request
            step.drafts = [sched.scheduled[i].draft_token_ids for i in rows]
            meta = build_verify_metadata(reqs, step.drafts, self.structured.verify_bitmask,
                                         None if draft_probs is None else [draft_probs[i] for i in rows])
            starts = verify_row_starts(sched)
            rows = [row for i in rows for row in range(starts[i], starts[i] + 1 + len(
                sched.scheduled[i].draft_token_ids or ()))]
        else:
            meta = build_sampling_metadata(reqs, self.structured.bitmask) if reqs else None
        step.handle = self.runner.submit(batch, np.asarray(rows, np.int64), meta, spec)

    def finish_step(self, step: InFlightStep) -> list[EngineOutput]:
        """Wait for the step's tokens and update: append them, check stops; then the aborts
        that came while it ran. Returns the step's outputs (with the refusals queued before it)."""
        if step is not self._in_flight:
            raise RuntimeError("finish_step: not the step in flight")
        outputs = step.outputs
        if step.handle is not None or step.error is not None:
            applied = False  # PERF: one try for the whole step; per request only on failure
            try:
                if step.error is not None:
                    raise step.error
                assert step.handle is not None                              # it ran
                result = step.handle.result()
                applied = True                                              # 3. update
                self.scheduler.update_after_step(step.sched)
                take_prompt_logprobs(step.prompt_rows, result.prompt_logprobs)
                outputs.extend(self.update(step.reqs, result, step.drafts))
                self._failed_steps = 0
            except Exception as e:  # noqa: BLE001 - ends the request(s) at fault, not the engine
                self._recover(step, e, retry=not applied)
        self._in_flight = None
        for request_id, index, error in self._deferred_aborts:
            self.abort_request(request_id, index, error)
        self._deferred_aborts.clear()
        outputs.extend(self._pending)  # those aborts, out with this step
        self._pending = []
        self._record_stats(step.sched)
        if self.tracer.active:
            self.tracer.on_step_end(self.num_steps, step.start, step.sched, outputs)
        self.num_steps += 1
        return outputs

    def update(self, reqs: list[Request], result: SamplerOutput,
               drafts: list[list[int] | None] | None = None) -> list[EngineOutput]:
        """The step's last phase: the scheduled tokens are in the cache and result holds one
        sampled token per request of reqs (those whose last token was computed), or 1 + k for
        a request that verified k drafts (drafts, engine/speculation.py); append, check stops,
        finish (blocks freed now)."""
        # Once per running request per step: the plain attributes, not the properties.
        outputs = []
        tokens = result.token_ids.tolist()
        starts = range(len(reqs)) if drafts is None else _row_starts(drafts)
        rows: Iterable[tuple[int, Request]] = enumerate(reqs)
        if result.failed:  # rare: rows whose sampling raised end their request (gpu/sampling/sampler.py)
            bad = {int(np.searchsorted(starts, j, side="right")) - 1 for j in result.failed}
            for j in bad:
                self.abort_request(reqs[j].request_id,
                                   error=f"sampling failed: {_failure_of(result.failed, starts, j)}")
            rows = [row for row in rows if row[0] not in bad]
        todo = iter(rows)
        while True:
            try:  # PERF: around the loop, entered again after a request that raises
                for j, req in todo:
                    out = EngineOutput(req.request_id, [], index=req.index,
                                       num_prompt_tokens=len(req.prompt_token_ids),
                                       num_cached_tokens=req.num_cached_tokens)
                    if req.params.logprobs is not None:
                        out.logprobs = []
                    reason = self._take_tokens(req, out, tokens, starts[j], result,
                                               None if drafts is None else drafts[j])
                    if (req.params.prompt_logprobs is not None and req.index == 0
                            and len(req.output_token_ids) == len(out.new_token_ids)):
                        out.prompt_logprobs = list(req.prompt_logprobs)
                    if reason is not None:
                        self.scheduler.finish(req, reason)
                        out.finish_reason, out.stop_reason = reason, req.stop_reason
                        self._forget_if_done(req.request_id)
                    outputs.append(out)
                return outputs
            except Exception as e:  # noqa: BLE001 - that request (every sample) ends, no other
                log.exception("request %s failed in the step's update", req.request_id)
                self.abort_request(req.request_id, error=f"the engine failed this request: "
                                                         f"{type(e).__name__}: {e}")

    def _take_tokens(self, req: Request, out: EngineOutput, tokens: list[int], row: int,
                     result: SamplerOutput, drafts: list[int] | None) -> FinishReason | None:
        """Append the request's sampled token at `row` to it and to out (with its logprobs);
        with drafts, go on while the token sampled equals the draft (accepted: the next row
        was computed after it), then count the accepted drafts into num_computed_tokens.
        Returns the finish reason if a token ends the request (no token after it is taken)."""
        params, new = req.params, out.new_token_ids
        k = len(drafts) if drafts else 0
        for i in range(k + 1):
            token = tokens[row + i]
            req.append_output_token(token)
            new.append(token)
            if out.logprobs is not None:
                out.logprobs.append(position_logprobs(result.logprobs, row + i, params.logprobs or 0))
            reason = check_stop(req, token, self.max_model_len)
            if req.matcher is not None:  # its grammar complete: "stop"
                reason = advance(req, token) or reason
            if reason is not None or i == k or token != drafts[i]:  # type: ignore[index]
                break
        if k:  # i drafts accepted: their K/V, written this step, stay; the rest are rewritten
            req.num_computed_tokens += i
            self.scheduler.speculation.record(req, k, i)  # type: ignore[union-attr]
        return reason

    def _record_stats(self, sched: SchedulerOutput) -> None:
        queries, hits = self.kv.take_stats()
        self.stats = SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            kv_cache_usage=self.kv.usage,
            num_preemptions=len(sched.preempted),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_scheduled_reqs=len(sched.scheduled),
        )

    # -- a step that raised (engine/recovery.py) -----------------------------------------------

    def _recover(self, step: InFlightStep, exc: Exception, retry: bool) -> None:
        """A step raised (exc). retry: nothing of it was applied, so the requests not at fault
        can run it again once those at fault (recovery.find_culprits) end with "error". When
        none is (or nothing can be retried), every request of the step ends with "error". The
        aborts are deferred to the end of finish_step, which sends them with the step's outputs."""
        scheduled = step.sched.scheduled
        culprits = find_culprits(scheduled, self.vocab_size) if retry else {}
        if culprits:
            self._failed_steps = 0
            log.warning("step %d raised %s: %s; ended %d request(s) at fault, the other %d "
                        "run it again", self.num_steps, type(exc).__name__, exc, len(culprits),
                        len({s.request.request_id for s in scheduled}) - len(culprits))
            for request_id, why in culprits.items():
                self.abort_request(request_id, error=f"the engine could not sample this request: {why}")
            return
        self._failed_steps += 1
        log.error("step %d failed (%d in a row); its %d requests end with an error",
                  self.num_steps, self._failed_steps, len(scheduled), exc_info=exc)
        for s in scheduled:
            # Its blocks' K/V may never have been written: not to be found by the prefix cache.
            self.kv.uncache(s.request)
            self.abort_request(s.request.request_id,
                               error=f"the engine step failed: {type(exc).__name__}: {exc}")
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_steps} engine steps failed in a row") from exc


def _row_starts(drafts: list[list[int] | None]) -> list[int]:
    """Each request's first row of a verify step's sampled rows (1 + k rows each)."""
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += 1 + len(d) if d else 1
    return starts


def _failure_of(failed: dict[int, str], starts, j: int) -> str:
    """The first failed row's message of request j (rows starts[j] up to starts[j + 1])."""
    end = starts[j + 1] if j + 1 < len(starts) else float("inf")
    return next(why for row, why in sorted(failed.items()) if starts[j] <= row < end)


def _make_runners(config: EngineConfig):
    """The target's runner, and on CUDA with a draft model the draft's (None: none, or built
    after the target: the CPU's pool is set bytes). On CUDA the draft comes first, its pool
    deferred, so that the target's profile sees it and sizes one pool of blocks for both
    (gpu/cuda/runner.py mirror); the two run on one stream."""
    from ringserve.gpu.loader.model_store import resolve_model
    from ringserve.gpu.runner import ModelRunner

    model_dir: Path = resolve_model(config.model)
    device, cache, spec = config.device_config, config.cache_config, config.speculative
    if spec is None or spec.model is None or device.check_backend(cache) != "cuda":
        return ModelRunner(model_dir, device, cache, config.step_limits), None
    draft_dir = resolve_draft(spec, config.model, model_dir, ModelConfig.from_dir(model_dir))
    draft = ModelRunner(draft_dir, device, cache, draft_limits(config), defer_kv_cache=True)
    return ModelRunner(model_dir, device, cache, config.step_limits, mirror=draft), draft
