"""The engine core: one loop of schedule -> execute -> update per step (docs/design.md §1.3).

Refusals: a request that can never run (empty prompt, ids outside the vocabulary, prompt +
max_tokens over max_model_len, or more blocks than the whole pool) is not queued; it comes back
from the next step() as a finished RequestOutput with finish_reason "error" and the message in
`.error` — the one answer that can travel back over the ipc rings. Invalid SamplingParams raise
ValueError when they are built, in the frontend. An abort comes back the same way, with
finish_reason "abort". So every sample of every request gets exactly one finished output.

prompt_logprobs: the runner scores the prompt tokens of the rows each prefill chunk computes
(vLLM V1 semantics; such a request does not read the prefix cache); they come back once, on the
request's first output, as [None, position 1, ...].

Fault isolation: nothing one request carries may stop the others. A sampling row that raises
ends its request (every sample) with finish_reason "error" and the others are sampled as usual
(gpu/sampler.py); a step that raises anywhere else is examined request by request (_recover):
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
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Sequence

import numpy as np

from ringserve.engine.config import EngineConfig
from ringserve.engine.inputs import build_batch
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.outputs import Logprob, PositionLogprobs, RequestOutput, SchedulerStats
from ringserve.engine.request import Request
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.scheduler import Scheduler, SchedulerOutput
from ringserve.engine.trace import EngineTracer
from ringserve.gpu.batch import Batch
from ringserve.gpu.prompt_logprobs import PromptLogprobsSpec
from ringserve.gpu.sampler import Logprobs, SamplerOutput, SamplingMetadata, sample

log = logging.getLogger("ringserve.engine")
MAX_FAILED_STEPS = 3   # whole steps failing in a row with no request at fault: the device is broken


@dataclass
class InFlightStep:
    """A step between launch_step and finish_step."""
    sched: SchedulerOutput
    reqs: list[Request]              # the requests sampled this step, in the runner's row order
    handle: object | None            # runner.submit(...): result() -> SamplerOutput; None: nothing ran
    prompt_rows: list[tuple[Request, int]]  # requests scoring prompt tokens, how many each, in order
    outputs: list[RequestOutput]     # refusals and aborts queued before the step
    start: float                     # monotonic start (tracing only)
    error: Exception | None = None   # launching it raised: finish_step recovers (_recover)


class EngineCore:
    def __init__(self, config: EngineConfig, runner=None):
        """runner: a ready ModelRunner-like object (submit, config, block_size, num_blocks);
        None builds the ModelRunner for config.model."""
        self.config = config
        if runner is None:
            runner = _make_runner(config)
        self.runner = runner
        model = runner.config
        self.vocab_size = model.vocab_size
        self.eos_token_ids = tuple(model.eos_token_ids)
        self.max_model_len = config.max_model_len or model.max_position_embeddings
        if self.max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} is longer than the model's "
                             f"max_position_embeddings {model.max_position_embeddings}")
        self.block_size = runner.block_size
        self.kv = KVCacheManager(runner.num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.generator = np.random.default_rng(config.seed)   # for requests without a seed
        self.groups: dict[str, list[Request]] = {}            # request_id -> its n sequences
        self._pending: list[RequestOutput] = []              # refusals and aborts, out next step
        self._in_flight: InFlightStep | None = None          # launched, not finished
        # (request id, sample index, error message) of aborts that came while a step was in flight
        self._deferred_aborts: list[tuple[str, int | None, str | None]] = []
        self._failed_steps = 0                                # whole steps failed in a row
        self._arrivals = 0
        self.stats = SchedulerStats()
        self.num_steps = 0
        self.tracer = EngineTracer(self)                      # records only traced requests

    # -- requests in -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                    params: SamplingParams, trace: bool = False) -> None:
        """trace: record the request's journey (engine/trace.py); it comes back on its last output."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        # One C call, no per-token Python int: an int32 array from the rings is taken as it is.
        prompt = np.asarray(prompt_token_ids)
        error, max_tokens = self._check(prompt, params)
        if error is not None:  # one error output per sample (one for an n refused as too large)
            samples = params.n if params.n <= self.scheduler.max_num_seqs else 1
            self._pending.extend(RequestOutput(request_id, [], True, "error", index=i, error=error,
                                               num_prompt_tokens=len(prompt))
                                 for i in range(samples))
            return
        prompt = prompt.astype(np.int32, copy=False)
        sharing_salt = request_id if params.n > 1 and not self.config.enable_prefix_caching else None
        # Every sample is made before any is queued: a request that raises here leaves nothing.
        group = [Request(request_id, prompt, params, arrival=self._arrivals + i, index=i,
                         eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                         max_tokens=max_tokens, cache_salt=sharing_salt,
                         generator=(np.random.default_rng(params.seed + i) if params.seed is not None
                                    else None if params.greedy else self.generator))
                 for i in range(params.n)]
        self._arrivals += params.n
        for req in group:
            if trace:
                self.tracer.watch(req)
            self.scheduler.add(req)
        self.groups[request_id] = group

    def _check(self, prompt: np.ndarray, params: SamplingParams) -> tuple[str | None, int]:
        """(why the request can never run, or None; its max_tokens resolved)."""
        n = len(prompt)
        if n == 0:
            return "the prompt is empty", 0
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            return f"token ids must be integers below the vocabulary size {self.vocab_size}", 0
        bad = prompt[(prompt < 0) | (prompt >= self.vocab_size)]
        if len(bad):
            return f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", 0
        # The other id lists and counts over the vocabulary: checked here too, whoever wrote
        # the record (an id past the vocabulary indexes past a row of logits, on the GPU too).
        vocab = self.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                return (f"stop_token_ids: token id {t} is outside the vocabulary "
                        f"(size {vocab})"), 0
        if params.n > self.scheduler.max_num_seqs:  # n Request objects are made at once
            return (f"n must be at most max_num_seqs ({self.scheduler.max_num_seqs}), got "
                    f"{params.n}"), 0
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and not 0 <= k <= vocab:
                return f"{name} must be between 0 and the vocabulary size {vocab}, got {k}", 0
        if n >= self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens, "
                    f"but the prompt has {n} tokens and at least one token must be generated."), 0
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for "
                    f"the completion)."), 0
        # The last sampled token is never written to the cache.
        blocks = self.kv.blocks_needed(n + max_tokens - 1)
        if blocks > self.kv.num_blocks:
            return (f"the request needs {blocks} KV-cache blocks ({n} prompt + {max_tokens} "
                    f"completion tokens) but the whole pool has {self.kv.num_blocks}"), 0
        return None, max_tokens

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
        reason = "abort" if error is None else "error"
        for req in self.groups.get(request_id, ()):
            if not req.is_finished and (index is None or req.index == index):
                self.scheduler.finish(req, reason)
                self._pending.append(RequestOutput(request_id, [], True, reason, index=req.index,
                                                   num_prompt_tokens=req.num_prompt_tokens,
                                                   error=error))
        self._forget_if_done(request_id)

    # -- the loop ----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

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

    def step(self) -> list[RequestOutput]:
        """One schedule -> execute -> update; the same as finish_step(launch_step())."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> InFlightStep:
        """Schedule, build the batch and sampling rows, and hand them to the runner, which
        may return before the device is done (CUDA). Until finish_step, the caller may do host
        work that does not change this step: deliver the previous step's outputs, add requests
        (they wait for the next schedule), abort (applied in finish_step, after this step's
        tokens). Results are the same as step()'s."""
        if self._in_flight is not None:
            raise RuntimeError("launch_step: the previous step is not finished")
        outputs, self._pending = self._pending, []
        tracing = self.tracer.active
        start = time.monotonic() if tracing else 0.0
        sched = self.scheduler.schedule()
        step = self._in_flight = InFlightStep(sched, [], None, [], outputs, start)
        if sched.scheduled:
            try:
                batch = build_batch(sched, self.kv)
                if tracing:
                    self.tracer.on_scheduled(self.num_steps, start, sched, batch)
                rows = [i for i, s in enumerate(sched.scheduled) if s.completes_prefill]
                step.reqs = reqs = [sched.scheduled[i].request for i in rows]
                spec, step.prompt_rows = _prompt_logprobs_spec(sched, batch)
                step.handle = self.runner.submit(batch, np.asarray(rows, np.int64),
                                                 self._sampling_metadata(reqs) if reqs else None, spec)
            except Exception as e:  # noqa: BLE001 - finish_step finds the request(s) at fault
                step.error = e
        return step

    def finish_step(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for the step's tokens, append them, check stops; then the aborts that came
        while it ran. Returns the step's outputs (with the refusals queued before it)."""
        if step is not self._in_flight:
            raise RuntimeError("finish_step: not the step in flight")
        outputs = step.outputs
        if step.handle is not None or step.error is not None:
            applied = False  # PERF: one try for the whole step; per request only on failure
            try:
                if step.error is not None:
                    raise step.error
                result = step.handle.result()
                applied = True
                self.scheduler.update_after_step(step.sched)
                _take_prompt_logprobs(step.prompt_rows, result.prompt_logprobs)
                outputs.extend(self.update(step.reqs, result))
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

    def update(self, reqs: list[Request], result: SamplerOutput) -> list[RequestOutput]:
        """The step's last phase: the scheduled tokens are in the cache and result holds one
        sampled token per request of reqs (those whose last token was computed); append,
        check stops, finish (blocks freed now)."""
        # Once per running request per step: the plain attributes, not the properties.
        outputs = []
        rows = enumerate(zip(reqs, result.token_ids.tolist()))
        if result.failed:  # rare: rows whose sampling raised end their request (gpu/sampler.py)
            for j, why in result.failed.items():
                self.abort_request(reqs[j].request_id, error=f"sampling failed: {why}")
            rows = [row for row in rows if row[0] not in result.failed]
        rows = iter(rows)
        while True:
            try:  # PERF: around the loop, entered again after a request that raises
                for j, (req, token) in rows:
                    req.append_output_token(token)
                    out = RequestOutput(req.request_id, [token], index=req.index,
                                        num_prompt_tokens=len(req.prompt_token_ids),
                                        num_cached_tokens=req.num_cached_tokens)
                    params = req.params
                    if params.logprobs is not None:
                        out.new_logprobs = [_position_logprobs(result.logprobs, j, params.logprobs)]
                    if params.prompt_logprobs is not None and req.index == 0 and len(req.output_token_ids) == 1:
                        out.prompt_logprobs = [None, *req.prompt_logprobs]
                    reason = self._stop_reason(req, token)
                    if reason is not None:
                        self.scheduler.finish(req, reason)
                        out.finished, out.finish_reason, out.stop_reason = True, reason, req.stop_reason
                        self._forget_if_done(req.request_id)
                    outputs.append(out)
                return outputs
            except Exception as e:  # noqa: BLE001 - that request (every sample) ends, no other
                log.exception("request %s failed in the step's update", req.request_id)
                self.abort_request(req.request_id, error=f"the engine failed this request: "
                                                         f"{type(e).__name__}: {e}")

    def _recover(self, step: InFlightStep, exc: Exception, retry: bool) -> None:
        """A step raised (exc). retry: nothing of it was applied, so the requests not at fault
        can run it again; each sampled request is checked alone (its sampling row built and
        drawn on neutral logits) to find those at fault, which end with "error". When none is
        (or nothing can be retried), every request of the step ends with "error". The aborts
        are deferred to the end of finish_step, which sends them with the step's outputs."""
        culprits = {}
        if retry:
            for s in step.sched.scheduled:
                if s.completes_prefill and s.request.request_id not in culprits:
                    why = self._probe(s.request)
                    if why is not None:
                        culprits[s.request.request_id] = why
        if culprits:
            self._failed_steps = 0
            log.warning("step %d raised %s: %s; ended %d request(s) at fault, the other %d "
                        "run it again", self.num_steps, type(exc).__name__, exc, len(culprits),
                        len({s.request.request_id for s in step.sched.scheduled}) - len(culprits))
            for request_id, why in culprits.items():
                self.abort_request(request_id, error=f"the engine could not sample this request: {why}")
            return
        self._failed_steps += 1
        log.error("step %d failed (%d in a row); its %d requests end with an error",
                  self.num_steps, self._failed_steps, len(step.sched.scheduled), exc_info=exc)
        for s in step.sched.scheduled:
            # Its blocks' K/V may never have been written: not to be found by the prefix cache.
            self.kv.uncache(s.request)
            self.abort_request(s.request.request_id,
                               error=f"the engine step failed: {type(exc).__name__}: {exc}")
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_steps} engine steps failed in a row") from exc

    def _probe(self, req: Request) -> str | None:
        """Why this request's sampling raises on its own (on neutral logits, with a throwaway
        generator: the request's own draws are untouched), or None."""
        try:
            meta = self._sampling_metadata([req])
            meta.generators = [None if g is None else np.random.default_rng(0) for g in meta.generators]
            out = sample(np.zeros((1, self.vocab_size), np.float32), meta)
            if out.failed:
                return next(iter(out.failed.values()))
            if req.params.logprobs is not None:
                _position_logprobs(out.logprobs, 0, req.params.logprobs)
        except Exception as e:  # noqa: BLE001 - that is the answer
            return f"{type(e).__name__}: {e}"
        return None

    def _stop_reason(self, req: Request, token: int) -> str | None:
        num_output = len(req.output_token_ids)
        if num_output >= req.params.min_tokens:
            if token in req.eos_token_ids:
                return "stop"
            if token in req.params.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return "length"
        return None

    def _forget_if_done(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None and all(r.is_finished for r in group):
            del self.groups[request_id]

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        # One flat pass (np.array over a list of tuples is ~1.5x slower).
        rows = np.fromiter(chain.from_iterable(r.sampling_row for r in reqs), np.float32,
                           4 * len(reqs)).reshape(-1, 4)
        meta = SamplingMetadata(temperature=rows[:, 0], top_k=rows[:, 1].astype(np.int32),
                                top_p=rows[:, 2], min_p=rows[:, 3],
                                generators=[r.generator for r in reqs])
        special = [r for r in reqs if r.has_sampling_extras]
        if not special:                                   # the common case: nothing more to do
            return meta
        ps = [r.params for r in reqs]
        if any(r.params.has_penalties for r in special):
            meta.presence_penalty = np.array([p.presence_penalty for p in ps], np.float32)
            meta.frequency_penalty = np.array([p.frequency_penalty for p in ps], np.float32)
            meta.repetition_penalty = np.array([p.repetition_penalty for p in ps], np.float32)
            meta.prompt_token_ids = [r.prompt_token_ids for r in reqs]
            meta.output_token_ids = [r.output_token_ids for r in reqs]
        if any(r.num_output_tokens < r.params.min_tokens for r in special):
            meta.banned_token_ids = [
                list(r.eos_token_ids) + r.params.stop_token_ids
                if r.num_output_tokens < r.params.min_tokens else () for r in reqs]
        wanted = [r.params.logprobs for r in special if r.params.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        return meta

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


def _position_logprobs(lps: Logprobs, row: int, num_top: int) -> PositionLogprobs:
    """The sampled token's logprob and rank, then the request's own top-N."""
    ids, vals = lps.token_ids[row], lps.logprobs[row]
    out: PositionLogprobs = {int(ids[0]): Logprob(float(vals[0]), int(lps.sampled_rank[row]))}
    for rank in range(1, num_top + 1):
        out.setdefault(int(ids[rank]), Logprob(float(vals[rank]), rank))
    return out


def _prompt_logprobs_spec(sched: SchedulerOutput, batch: Batch,
                          ) -> tuple[PromptLogprobsSpec | None, list[tuple[Request, int]]]:
    """The rows of this step's batch whose logits score a prompt token: for a request that
    asked for prompt_logprobs, each computed position p < num_prompt - 1 not yet scored (p's
    logits predict prompt token p + 1). Also which request owns how many of them, in order."""
    rows, targets, owners = [], [], []
    for i, s in enumerate(sched.scheduled):
        req = s.request
        if req.params.prompt_logprobs is None or not req.needs_prompt_logprobs:
            continue
        # Positions before len(req.prompt_logprobs) were scored in an earlier step (or before
        # a preemption); the prefix cache is not read, so nothing between is skipped.
        first = max(s.num_computed_tokens, len(req.prompt_logprobs))
        end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
        if first >= end:
            continue
        assert first == len(req.prompt_logprobs), "prompt positions computed but never scored"
        start = int(batch.query_start_loc[i]) - s.num_computed_tokens
        rows.append(np.arange(start + first, start + end, dtype=np.int64))
        targets.append(req.prompt_token_ids[first + 1:end + 1])
        owners.append((req, end - first))
    if not owners:
        return None, []
    num_top = max(req.params.prompt_logprobs for req, _ in owners)
    return PromptLogprobsSpec(np.concatenate(rows), np.concatenate(targets).astype(np.int32),
                              num_top), owners


def _take_prompt_logprobs(owners: list[tuple[Request, int]], lps: Logprobs | None) -> None:
    """Hand each request its rows of the step's prompt logprobs (spec order)."""
    at = 0
    for req, count in owners:
        num_top = req.params.prompt_logprobs
        req.prompt_logprobs.extend(_position_logprobs(lps, j, num_top) for j in range(at, at + count))
        at += count


def _make_runner(config: EngineConfig):
    from ringserve.gpu.model_store import resolve_model
    from ringserve.gpu.runner import ModelRunner

    model_dir: Path = resolve_model(config.model)
    return ModelRunner(model_dir, device=config.device, dtype=config.dtype,
                       block_size=config.block_size, num_blocks=config.num_gpu_blocks_override,
                       kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                       gpu_memory_utilization=config.gpu_memory_utilization,
                       max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens,
                       max_model_len=config.max_model_len, enforce_eager=config.enforce_eager,
                       attention_backend=config.attention_backend)
