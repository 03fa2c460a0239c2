"""The KV-cache manager: a pool of fixed-size blocks, per-request block tables, prefix caching.

Prefix caching follows vLLM V1. Every full block is named by a chain hash: sha256 of its
parent block's hash and its own token ids (raw int32), so equal hashes mean equal prefixes. A
cryptographic hash because a collision would serve one request another's KV (vLLM moved from
Python's hash() to sha256 after exactly that report); and each hit is still checked against
the block's parent hash and tokens, so even a forced collision cannot reuse a wrong block. A block is
registered under its hash as soon as it is allocated for tokens that fill it (their K/V are
written by the same forward pass that may first read them: the runner writes a layer's K/V
for the whole step before that layer's attention). A freed block keeps its hash and stays
findable until it is taken for reuse; the free queue hands out the least recently freed
block first, and a request's blocks are freed tail first, so a shared prefix outlives the
tails that hang off it. A freed block without a hash (a partial last block; any block with
caching off) holds nothing to find: it goes to the head of the queue, reused before a cached
block is evicted and before a block never used is touched. On the CPU the pool's pages become
resident only when first written (gpu/cpu/memory.py), so with caching off the resident pool is
the most blocks ever held at once, as llama.cpp's per-slot cache holds what its slots filled;
with caching on it grows to the whole pool as cached blocks accumulate (they are the cache).
The last prompt token is always recomputed: its logits are needed.

With prefix caching off, no block is hashed, except for the n samples of one request, which
share their prompt's blocks through hashes salted with their request id (Request.cache_salt).

With a sliding window on every layer (Mistral v0.1 style; vLLM's SlidingWindowManager), no
token from position p on reads a key before p - window + 1: a running request's blocks wholly
before its next token's window go back to the pool at once (keeping their hashes, as any freed
block), and its list and table entries become NULL_BLOCK (-1), which the attention kernels never
read. A prefix hit then needs only the blocks inside the window of the first token it leaves to
compute (found from the right), so a hit survives the eviction of the blocks before it. A model
with any full-attention layer frees nothing early (KVCacheManager.sliding_window is 0).

With KV-cache events on (engine/kv_events.py), the manager records what its prefix cache gains
and loses, in order: BlockStored for each run of blocks a request registers, BlockRemoved for
a cached block evicted (taken for reuse) or uncached. The engine takes them once per step
(take_events). Salted blocks (n > 1 with caching off) are request-private: not announced.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ringserve.engine.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, external_hash
from ringserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_ROOT = b"ringserve-prefix-cache-v1"


def hash_block(block_key: bytes) -> bytes:
    """A block's chain hash: sha256 of its key (the parent block's hash + its int32 token ids)."""
    return hashlib.sha256(block_key).digest()


def root_hash(cache_salt: object) -> bytes:
    """The parent hash of a request's first block; a salt scopes sharing (n > 1, caching off)."""
    return hash_block(_ROOT + (b"" if cache_salt is None else str(cache_salt).encode()))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a full, registered block of tokens
    block_key: bytes | None = None   # what was hashed (parent hash + token bytes): checked on a hit


# The placeholder for a block freed before a sliding window: never in the pool, never hashed.
NULL_BLOCK = KVBlock(-1)


class BlockPool:
    """All blocks, the free queue (LRU order) and the hash → cached block map."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, oldest first. OrderedDict: O(1) pop from the head, append at the tail,
        # and removal from the middle when a cached free block is hit again.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.events: list | None = None  # KV-cache events on: what happened since take_events()

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take_new(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the head of the free queue, evicting their cached hashes."""
        assert n <= len(self.free_queue), "caller checks num_free first"
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self.uncache_block(block)
                block.block_key = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (out of the free queue if nobody held them)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks_tail_first) -> None:
        for block in blocks_tail_first:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:  # NOTE: holds nothing findable: reused first (module doc)
                    self.free_queue.move_to_end(block.block_id, last=False)

    def uncache_block(self, block: KVBlock) -> None:
        """Make a block unfindable by its hash (it is evicted, or its K/V may be wrong)."""
        h = block.block_hash
        assert h is not None
        if self.cached.get(h) is block:
            del self.cached[h]
            if self.events is not None:  # (a salted block's removal names a hash never announced)
                self.events.append(BlockRemoved([external_hash(h)], MEDIUM_GPU))
        block.block_hash = None

    def register(self, block: KVBlock, block_hash: bytes, block_key: bytes) -> bool:
        """Make a full block findable by its hash (the first block with a hash keeps it);
        whether it was registered."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.block_key = block_hash, block_key
            self.cached[block_hash] = block
            return True
        return False

    def lookup(self, block_hash: bytes, block_key: bytes) -> KVBlock | None:
        """The cached block of this hash if it really holds these tokens after this parent."""
        block = self.cached.get(block_hash)
        return block if block is not None and block.block_key == block_key else None


class BlockTables:
    """Every request's block ids as one row of a numpy array, written when its blocks change
    (every block_size tokens), so that a step's block tables are one gather of rows instead of
    a rebuild from Python lists (which costs per block of every running request, every step).
    A row holds -1 past the request's last block. Rows and columns grow by doubling."""

    def __init__(self, num_rows: int = 64, num_cols: int = 16):
        self.ids = np.full((num_rows, num_cols), -1, np.int32)
        self.lens = np.zeros(num_rows, np.int32)      # blocks in each row
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def add_row(self) -> int:
        if not self._free_rows:
            old = len(self.lens)
            self.ids = np.vstack([self.ids, np.full_like(self.ids, -1)])
            self.lens = np.concatenate([self.lens, np.zeros(old, np.int32)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self.lens[row])
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            cols = max(end, 2 * self.ids.shape[1])
            grown = np.full((len(self.lens), cols), -1, np.int32)
            grown[:, :self.ids.shape[1]] = self.ids
            self.ids = grown
        self.ids[row, start:end] = block_ids
        self.lens[row] = end

    def clear(self, row: int, start: int, end: int) -> None:
        """Blocks start..end-1 of a row freed (a sliding window passed them): -1, never read."""
        self.ids[row, start:end] = NULL_BLOCK.block_id

    def free_row(self, row: int) -> None:
        self.ids[row, :self.lens[row]] = -1
        self.lens[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The block tables [len(rows), the longest row's length] of these rows."""
        width = int(self.lens[rows].max()) if len(rows) else 0
        return self.ids[rows, :width]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int = 0):
        """sliding_window: the window of a model whose every layer slides (0: none, or a model
        with any full-attention layer): blocks before it are freed while a request runs."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self._pack_block = struct.Struct(f"{block_size}i").pack  # a block's ids as int32 bytes
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.tables = BlockTables()
        self.req_rows: dict[str, int] = {}          # per request: its row in self.tables
        self._num_registered: dict[str, int] = {}   # per request: leading blocks already hashed
        self._num_skipped: dict[str, int] = {}      # per request: leading blocks freed (NULL_BLOCK)
        # Prefix-cache counters in tokens (vLLM's queries/hits), reset by take_stats().
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (cached but free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.key, ())]

    def block_tables_of(self, reqs) -> np.ndarray:
        """int32 [len(reqs), their most blocks]: each request's block ids, then -1."""
        rows = self.req_rows
        return self.tables.gather(np.fromiter((rows[r.key] for r in reqs), np.intp))

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks that no token from position num_computed on reads: those wholly before
        its sliding window (keys >= num_computed - window + 1); 0 without a window."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens ever holds at once, computed max_chunk tokens
        at most per step: all of them, or with a window those of one window and one chunk
        (ceil((window - 1 + chunk) / block_size) + 1 at the worst alignment)."""
        full = self.blocks_needed(num_tokens)
        if not self.sliding_window:
            return full
        return min(full, cdiv(self.sliding_window - 1 + max_chunk, self.block_size) + 1)

    def num_held_blocks(self, req: Request) -> int:
        """Pool blocks a request holds now (its table, less the blocks freed before its window)."""
        return len(self.req_blocks.get(req.key, ())) - self._num_skipped.get(req.key, 0)

    def _hashing(self, req: Request) -> bool:
        return self.enable_caching or req.cache_salt is not None

    def _block_key(self, req: Request, i: int) -> bytes:
        """What block i of a request hashes: its parent's hash and its token ids (int32 bytes).
        Needs req.block_hashes[:i] (a parent is always hashed before its child)."""
        bs = self.block_size
        parent = req.block_hashes[i - 1] if i else root_hash(req.cache_salt)
        # PERF: struct over a list slice, ~3x faster than np.array(...).tobytes() here.
        return parent + self._pack_block(*req.all_token_ids[i * bs:(i + 1) * bs])

    def _update_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        # PERF: once per full block of a request (every block_size tokens), ~1 us each.
        hashes = req.block_hashes
        while len(hashes) < num_full_blocks:
            hashes.append(hash_block(self._block_key(req, len(hashes))))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks holding a prefix of a request that is not running, and their token count.

        At most num_tokens - 1 tokens: the last one is always recomputed for its logits. None
        for a request that still needs its prompt's logits (prompt_logprobs).
        """
        if not self._hashing(req) or req.needs_prompt_logprobs:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._update_hashes(req, max_blocks)
        if self.sliding_window:
            return self._window_hits(req, hashes[:max_blocks])
        hits: list[KVBlock] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(h, self._block_key(req, i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, req: Request, hashes: list[bytes]) -> tuple[list[KVBlock], int]:
        """The longest k cached-block prefix whose window blocks (skipped_blocks(k tokens) ..
        k - 1) are all cached; NULL_BLOCK before them (a chain hash names the whole prefix, so a
        block is valid whatever happened to its parents). From the right: a miss at block j rules
        out every k > j, so each block is looked up at most once."""
        k = len(hashes)
        while k > 0:
            first, j = self.skipped_blocks(k * self.block_size), k - 1
            found: list[KVBlock] = []
            while j >= first:
                block = self.pool.lookup(hashes[j], self._block_key(req, j))
                if block is None:
                    break
                found.append(block)
                j -= 1
            if j < first:
                return [NULL_BLOCK] * first + found[::-1], k * self.block_size
            k = j
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Give a request room for num_new_tokens more tokens in the cache; False if the pool is short.

        computed_blocks (from get_computed_blocks) are passed when a waiting request is admitted;
        they become the head of its block table. Nothing changes when False is returned, except
        that a running request's blocks before its sliding window are freed (nothing reads them).
        num_lookahead_tokens: slots for that many draft tokens after them (speculative decoding,
        vLLM's num_lookahead_tokens). Only full blocks of the num_new_tokens (real tokens) are
        hashed: a draft's K/V may be rejected, so a block is registered in a later step, once
        every token in it is real (accepted drafts' K/V are kept; rejected ones are rewritten
        before then).
        """
        blocks = self.req_blocks.get(req.key)
        bs = self.block_size
        skip = self.skipped_blocks(req.num_computed_tokens + len(computed_blocks or ()) * bs)
        if blocks is not None and not computed_blocks:
            # The common decode step: room in the last block, no block filled up or passed.
            total = req.num_computed_tokens + num_new_tokens
            if (total + num_lookahead_tokens <= len(blocks) * bs
                    and (total // bs <= self._num_registered[req.key] or not self._hashing(req))
                    and skip <= self._num_skipped[req.key]):
                return True
            self._free_skipped(req, blocks, skip)
        computed_blocks = computed_blocks or []
        admitting = blocks is None
        if blocks is None:
            blocks = []
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = (self.blocks_needed(total + num_lookahead_tokens) - len(blocks)
                          - len(computed_blocks))
        # Hits before the window (NULL_BLOCK from _window_hits) are neither touched nor held.
        held_hits = computed_blocks[skip:] if admitting else computed_blocks
        reviving = sum(1 for b in held_hits if b.ref_cnt == 0)  # these leave the free queue
        if num_new_blocks > self.pool.num_free - reviving:
            return False
        if admitting:
            self.req_blocks[req.key] = blocks
            self.req_rows[req.key] = self.tables.add_row()
            self._num_registered[req.key] = self._num_skipped[req.key] = min(skip, len(computed_blocks))
            if self._hashing(req) and not req.needs_prompt_logprobs:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += len(computed_blocks) * self.block_size
            computed_blocks = [NULL_BLOCK] * (len(computed_blocks) - len(held_hits)) + held_hits
        self.pool.touch(held_hits)
        new_blocks = computed_blocks + self.pool.take_new(max(num_new_blocks, 0))
        if new_blocks:
            blocks.extend(new_blocks)
            self.tables.append(self.req_rows[req.key], [b.block_id for b in new_blocks])
        if self._hashing(req):
            self._register_full_blocks(req, blocks, total // self.block_size)
        return True

    def _free_skipped(self, req: Request, blocks: list[KVBlock], skip: int) -> None:
        """Free a running request's blocks before block `skip` (its next token's window);
        NOTE: its table keeps their places (NULL_BLOCK): positions index the table."""
        done = self._num_skipped[req.key]
        if skip <= done:
            return
        skip = min(skip, len(blocks))
        dropped = blocks[done:skip]
        blocks[done:skip] = [NULL_BLOCK] * len(dropped)
        self.tables.clear(self.req_rows[req.key], done, skip)
        self._num_skipped[req.key] = skip
        self.pool.release(reversed(dropped))

    def _register_full_blocks(self, req: Request, blocks: list[KVBlock], num_full: int) -> None:
        start = max(self._num_registered[req.key], self._num_skipped[req.key])
        if num_full <= start:
            return
        hashes = self._update_hashes(req, num_full)
        pool = self.pool
        if pool.events is None or req.cache_salt is not None:
            for i in range(start, num_full):
                pool.register(blocks[i], hashes[i], self._block_key(req, i))
        else:
            registered = [i for i in range(start, num_full)
                          if pool.register(blocks[i], hashes[i], self._block_key(req, i))]
            if registered:
                self._record_stored(req, hashes, registered)
        self._num_registered[req.key] = num_full

    def _record_stored(self, req: Request, hashes: list[bytes], registered: list[int]) -> None:
        """One BlockStored per contiguous run of blocks just registered (vLLM: one per chain)."""
        bs, events = self.block_size, self.pool.events
        assert events is not None
        runs: list[list[int]] = []
        for i in registered:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            events.append(BlockStored(
                block_hashes=[external_hash(hashes[i]) for i in run],
                parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                token_ids=req.all_token_ids[first * bs:end * bs],
                block_size=bs, lora_id=None, medium=MEDIUM_GPU, lora_name=None))

    def free(self, req: Request) -> None:
        """Return a request's blocks to the pool (tail first: a prefix is evicted last)."""
        blocks = self.req_blocks.pop(req.key, None)
        self._num_registered.pop(req.key, None)
        skipped = self._num_skipped.pop(req.key, 0)
        row = self.req_rows.pop(req.key, None)
        if row is not None:
            self.tables.free_row(row)
        if blocks:
            self.pool.release(reversed(blocks[skipped:]))

    def uncache(self, req: Request) -> None:
        """Make a request's blocks unfindable by the prefix cache (a failed step may have left
        their K/V unwritten); they stay the request's until it is freed."""
        for block in self.req_blocks.get(req.key, ()):
            if block.block_hash is not None:
                self.pool.uncache_block(block)

    def enable_events(self) -> None:
        """Record KV-cache events from now on (whoever calls this takes them every step)."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list:
        """The KV-cache events since the last call (events on), oldest first."""
        events, self.pool.events = self.pool.events, []
        assert events is not None
        return events

    def take_stats(self) -> tuple[int, int]:
        """(prefix-cache query tokens, hit tokens) since the last call."""
        out = (self.prefix_queries, self.prefix_hits)
        self.prefix_queries = self.prefix_hits = 0
        return out
