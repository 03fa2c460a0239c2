"""The batch contract between the engine and the model runner (docs/design.md §3).

One step's scheduled tokens, from every request, packed into one padding-free
super-sequence. Request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    input_ids: np.ndarray        # int32 [T]   token ids of the super-sequence
    positions: np.ndarray        # int32 [T]   position of each token inside its request
    # int32 [T] where its K/V go: block * block_size + pos % block_size; -1 = skip
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray  # int32 [B+1] prefix sum of tokens scheduled per request
    seq_lens: np.ndarray         # int32 [B]   tokens in the cache for the request after this step
    block_tables: np.ndarray     # int32 [B, max_blocks] block ids, -1 past the end
    # The rows to compute logits at, when not one per request (speculative decoding: each
    # request's last token and its draft tokens); None: logits_indices below.
    sample_indices: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def logits_indices(self) -> np.ndarray:
        """The last scheduled token of each request: the rows sampled from (sample_indices
        instead when set). (Requests that ask for prompt_logprobs add their prompt rows; see
        gpu/sampling/prompt_logprobs.py.)"""
        if self.sample_indices is not None:
            return self.sample_indices
        return self.query_start_loc[1:] - 1
