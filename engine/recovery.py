"""Which request made a step fail? (engine/core.py `EngineCore._recover` acts on the answer.)

Nothing one request carries may stop the others. A step that raises is examined request by
request: each sampled request's sampling row is built and drawn alone on neutral logits; those
that raise are at fault. The common path pays nothing for this: it runs only after a failure."""
from __future__ import annotations

import numpy as np

from ringserve.engine.logprobs import position_logprobs
from ringserve.engine.request import Request
from ringserve.engine.sampling_metadata import build_sampling_metadata
from ringserve.engine.scheduler import ScheduledRequest
from ringserve.gpu.sampling.sampler import sample

# Whole steps failing in a row with no request at fault: the device is broken (the engine
# raises, and its process is restarted).
MAX_FAILED_STEPS = 3


def find_culprits(scheduled: list[ScheduledRequest], vocab_size: int) -> dict[str, str]:
    """request id -> why it fails alone, for each request of the step that samples a token."""
    culprits: dict[str, str] = {}
    for s in scheduled:
        if s.samples_token and s.request.request_id not in culprits:
            why = probe(s.request, vocab_size)
            if why is not None:
                culprits[s.request.request_id] = why
    return culprits


def probe(req: Request, vocab_size: int) -> str | None:
    """Why this request's sampling raises on its own (on neutral logits, with a throwaway
    generator: the request's own draws are untouched), or None."""
    try:
        meta = build_sampling_metadata([req])
        meta.generators = [None if g is None else np.random.default_rng(0) for g in meta.generators]
        out = sample(np.zeros((1, vocab_size), np.float32), meta)
        if out.failed:
            return next(iter(out.failed.values()))
        if req.params.logprobs is not None:
            position_logprobs(out.logprobs, 0, req.params.logprobs)
    except Exception as e:  # noqa: BLE001 - that is the answer
        return f"{type(e).__name__}: {e}"
    return None
