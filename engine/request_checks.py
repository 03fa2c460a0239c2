"""Is a request one the engine can ever run? Checked once, when it is added (engine/core.py
`EngineCore.add_request`), never per step.

A refused request is not queued: it comes back from the next step as a finished output with
finish_reason "error" and the message, the one answer that can travel back over the ipc rings.
SamplingParams checked their own values when they were built (ipc/sampling_params.py
`validate`); what is checked here needs the model and the pool: the vocabulary, max_model_len
(ipc/limits.py `fit_context`, the rule the frontend applies too), max_num_seqs, the blocks."""
from __future__ import annotations

import msgspec
import numpy as np

from ringserve.engine.kv_cache import KVCacheManager
from ringserve.ipc.limits import fit_context
from ringserve.ipc.sampling_params import SamplingParams


def check_request(prompt: np.ndarray, params: SamplingParams, *, vocab_size: int,
                  max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                  kv: KVCacheManager) -> tuple[str | None, SamplingParams]:
    """(why the request can never run, or None; its params with max_tokens resolved against
    max_model_len: None becomes the room the prompt leaves, in a copy)."""
    n = len(prompt)
    error = check_vocabulary(prompt, params, vocab_size)
    if error is not None:
        return error, params
    if params.n > max_num_seqs:  # n Request objects are made at once
        return f"n must be at most max_num_seqs ({max_num_seqs}), got {params.n}", params
    max_tokens, error, _ = fit_context(n, params.max_tokens, max_model_len)
    if error is not None:
        return error, params
    # The last sampled token is never written to the cache; a sliding window bounds what is held.
    blocks = kv.max_blocks_held(n + max_tokens - 1, max_num_batched_tokens)
    if blocks > kv.num_blocks:
        return (f"the request needs {blocks} KV-cache blocks ({n} prompt + {max_tokens} "
                f"completion tokens) but the whole pool has {kv.num_blocks}"), params
    if params.max_tokens is None:  # (an offline caller's; the frontend sends it resolved)
        try:  # validated again: min_tokens may be more than the room
            params = msgspec.structs.replace(params, max_tokens=max_tokens)
        except ValueError as e:
            return str(e), params
    return None, params


def check_vocabulary(prompt: np.ndarray, params: SamplingParams, vocab_size: int) -> str | None:
    """Why the prompt or an id list or count over the vocabulary cannot be, or None. Checked
    here too, whoever wrote the record: an id past the vocabulary indexes past a row of logits
    (on the GPU too)."""
    if len(prompt) == 0:
        return "the prompt is empty"
    if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
        return f"token ids must be integers below the vocabulary size {vocab_size}"
    bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
    if len(bad):
        return f"token id {bad[0]} is outside the vocabulary (size {vocab_size})"
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            return f"stop_token_ids: token id {t} is outside the vocabulary (size {vocab_size})"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= vocab_size:
            return f"{name} must be between 0 and the vocabulary size {vocab_size}, got {k}"
    return None
