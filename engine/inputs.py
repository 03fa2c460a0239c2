"""From a SchedulerOutput to the gpu Batch: the super-sequence, positions, slots, block tables."""
from __future__ import annotations

import numpy as np

from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.request import Request
from ringserve.engine.scheduler import SchedulerOutput
from ringserve.gpu.batch import Batch


def build_batch(out: SchedulerOutput, kv: KVCacheManager) -> Batch:
    # One pass of Python per request for what only the request knows (its tokens, counts and
    # block-table row); everything per token is numpy.
    scheduled = out.scheduled
    num_reqs = len(scheduled)
    counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, num_reqs)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int32, num_reqs)
    input_ids = np.fromiter(_new_token_ids(out), np.int32, int(counts.sum()))
    batch = batch_of(kv, [s.request for s in scheduled], starts, counts, input_ids)
    if out.num_draft_tokens:
        batch.sample_indices = _verify_rows(out, batch.query_start_loc)
    return batch


def batch_of(kv: KVCacheManager, reqs: list[Request], starts: np.ndarray, counts: np.ndarray,
             input_ids: np.ndarray) -> Batch:
    """The Batch of counts[i] tokens of reqs[i] from position starts[i] (int32 arrays), their
    ids input_ids, K/V slots from the requests' block tables (a draft model's forwards use it
    too: its cache mirrors the target's block ids, engine/draft_proposer.py)."""
    bs = kv.block_size
    num_reqs = len(reqs)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = starts + counts
    block_tables = kv.block_tables_of(reqs)

    # Per token: its request, its position, and its slot (block_table[pos // bs] * bs + pos % bs).
    req_of = np.repeat(np.arange(num_reqs), counts)
    positions = (starts[req_of] + np.arange(num_tokens, dtype=np.int32)
                 - query_start_loc[:-1][req_of]).astype(np.int32)
    slot_mapping = (block_tables[req_of, positions // bs] * bs + positions % bs).astype(np.int32)
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
    )


def _verify_rows(out: SchedulerOutput, query_start_loc: np.ndarray) -> np.ndarray:
    """Speculative decoding: logits rows per request, its last token's and one per draft token
    (1 + k, the last 1 + k rows of its tokens), else one at its last scheduled token."""
    ends = query_start_loc[1:]
    rows = [np.arange(end - 1 - len(s.draft_token_ids), end) if s.draft_token_ids else end - 1
            for s, end in zip(out.scheduled, ends.tolist(), strict=True)]
    return np.hstack(rows).astype(np.int32)


def verify_row_starts(out: SchedulerOutput) -> np.ndarray:
    """Where each request's first logits row is in Batch.sample_indices (see _verify_rows)."""
    sizes = np.fromiter((1 + len(s.draft_token_ids) if s.draft_token_ids else 1
                         for s in out.scheduled), np.int64, len(out.scheduled))
    starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts


def _new_token_ids(out: SchedulerOutput):
    """The tokens each request computes this step, in batch order. A decode step's single
    token is read without slicing a list (the most common row, once per running request)."""
    for s in out.scheduled:
        tokens = s.request.all_token_ids
        if s.num_new_tokens == 1:
            yield tokens[s.num_computed_tokens]
        elif s.draft_token_ids:  # the last token, then the drafts to verify
            yield tokens[s.num_computed_tokens]
            yield from s.draft_token_ids
        else:
            yield from tokens[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
