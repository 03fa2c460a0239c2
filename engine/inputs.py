"""From a SchedulerOutput to the gpu Batch: the super-sequence, positions, slots, block tables."""
from __future__ import annotations

import numpy as np

from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.scheduler import SchedulerOutput
from ringserve.gpu.batch import Batch


def build_batch(out: SchedulerOutput, kv: KVCacheManager) -> Batch:
    bs = kv.block_size
    num_reqs = len(out.scheduled)
    counts = np.fromiter((s.num_new_tokens for s in out.scheduled), np.int32, num_reqs)
    starts = np.fromiter((s.num_computed_tokens for s in out.scheduled), np.int32, num_reqs)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    seq_lens = starts + counts

    input_ids: list[int] = []
    tables = kv.block_ids_of(s.request for s in out.scheduled)
    for s in out.scheduled:
        input_ids.extend(s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens])
    block_tables = np.full((num_reqs, max(map(len, tables), default=0)), -1, np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t

    # Per token: its request, its position, and its slot (block_table[pos // bs] * bs + pos % bs).
    req_of = np.repeat(np.arange(num_reqs), counts)
    positions = (starts[req_of] + np.arange(int(query_start_loc[-1]), dtype=np.int32)
                 - query_start_loc[:-1][req_of]).astype(np.int32)
    slot_mapping = (block_tables[req_of, positions // bs] * bs + positions % bs).astype(np.int32)
    return Batch(
        input_ids=np.asarray(input_ids, np.int32),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
    )
