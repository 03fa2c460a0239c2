"""When a sequence stops: the engine's one stop rule, on token ids (as vLLM V1's check_stop).

Stop *strings* are text and belong to the frontends (server/output_processor.py, for the HTTP
server and the offline LLM alike), which abort the engine request when one appears."""
from __future__ import annotations

from ringserve.engine.request import Request
from ringserve.ipc.messages import FinishReason


def check_stop(req: Request, token: int, max_model_len: int) -> FinishReason | None:
    """The finish reason once `token` (just appended to req) ends it, else None: eos or a
    stop_token_ids id once min_tokens are out (STOP; a stop id is kept in req.stop_reason),
    max_tokens or max_model_len reached (LENGTH)."""
    # PERF: once per running request per step; plain attributes, not the properties.
    num_output = len(req.output_token_ids)
    params = req.params
    if num_output >= params.min_tokens:
        if token in req.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
    # (max_tokens: resolved when the request was added, never None here)
    if num_output >= params.max_tokens or len(req.all_token_ids) >= max_model_len:  # type: ignore[operator]
        return FinishReason.LENGTH
    return None
