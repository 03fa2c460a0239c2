"""One step's SamplingMetadata (gpu/sampling/sampler.py) from the requests it samples, in row order."""
from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from ringserve.engine.request import Request
from ringserve.gpu.sampling.sampler import SamplingMetadata


def build_sampling_metadata(reqs: list[Request],
                            bitmask: Callable[[list[Request]], np.ndarray | None] | None = None
                            ) -> SamplingMetadata:
    """Per row: temperature, top_k (0: off), top_p, min_p and the generator; penalties,
    banned ids (min_tokens), the top-N logprobs and the structured-output token bitmask (made
    by `bitmask`, engine/structured_outputs.py) only when some request asks."""
    ps = [r.params for r in reqs]  # read as they are: one column per parameter
    meta = SamplingMetadata(temperature=np.array([p.temperature for p in ps], np.float32),
                            top_k=np.array([p.top_k for p in ps], np.int32),
                            top_p=np.array([p.top_p for p in ps], np.float32),
                            min_p=np.array([p.min_p for p in ps], np.float32),
                            generators=[r.generator for r in reqs])
    special = [r for r in reqs if r.has_sampling_extras]
    if not special:                                   # the common case: nothing more to do
        return meta
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
    if bitmask is not None and any(r.matcher is not None for r in special):
        # computed by the sampler when it samples: on CUDA, while the forward runs
        meta.allowed_token_bitmask = partial(bitmask, reqs)
    return meta
