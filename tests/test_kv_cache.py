"""The block pool and prefix caching (engine/kv_cache.py)."""
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.request import Request
from ringserve.ipc.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit like the scheduler does; returns the prefix-cache hit in tokens."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    req.num_computed_tokens = req.num_tokens
    return n_hit


def test_a_new_block_every_block_size_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    req = make_req("a", list(range(5)))           # 5 tokens -> 2 blocks
    admit(kv, req)
    assert len(kv.block_ids(req)) == 2
    for n_tokens, n_blocks in [(6, 2), (7, 2), (8, 2), (9, 3)]:
        req.append_output_token(1)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert req.num_tokens == n_tokens and len(kv.block_ids(req)) == n_blocks
    assert kv.num_free_blocks == 5
    kv.free(req)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    a = make_req("a", list(range(8)))
    admit(kv, a)
    b = make_req("b", list(range(9)))             # needs 3 blocks, 1 free
    assert not kv.allocate_slots(b, 9)
    assert kv.num_free_blocks == 1 and kv.block_ids(b) == []


def test_prefix_hit_reuses_blocks_and_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_req("a", list(range(12)))            # 3 full blocks
    assert admit(kv, a) == 0
    b = make_req("b", list(range(12)))            # same prompt: only 2 blocks may hit
    assert admit(kv, b) == 8
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2]
    assert kv.block_ids(b)[2] != kv.block_ids(a)[2]
    c = make_req("c", list(range(8)) + [99, 98, 97, 96, 95])   # diverges in block 2
    assert admit(kv, c) == 8
    assert kv.pool.blocks[kv.block_ids(a)[0]].ref_cnt == 3
    assert kv.take_stats() == (12 + 12 + 13, 0 + 8 + 8)
    d = make_req("d", [7] + list(range(1, 12)))   # differs in the first token: no hit at all
    assert admit(kv, d) == 0


def test_a_freed_block_keeps_its_hash_until_reused_in_lru_order():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5])            # blocks [1,2] [3,4] [5]
    admit(kv, a)
    first, second, _ = kv.block_ids(a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_req("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == 4                      # both full blocks found after the free
    assert kv.block_ids(b)[:2] == [first, second]
    kv.free(b)
    # Tail blocks were freed first, so fresh allocations evict the tails before the prefix.
    c = make_req("c", [50, 51])               # one block: the oldest free one, a tail
    admit(kv, c)
    d = make_req("d", [1, 2, 3, 4, 9])
    assert admit(kv, d) == 4
    kv.free(c), kv.free(d)
    e = make_req("e", [60, 61, 62, 63, 64, 65, 66, 67])   # takes the whole pool: evicts everything
    admit(kv, e)
    kv.free(e)
    assert admit(kv, make_req("f", [1, 2, 3, 4, 9])) == 0


def test_caching_off_shares_only_within_a_salted_group():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    assert admit(kv, make_req("a", list(range(9)))) == 0
    assert admit(kv, make_req("b", list(range(9)))) == 0
    s0, s1 = make_req("g", list(range(9)), salt="g"), make_req("g#1", list(range(9)), salt="g")
    assert admit(kv, s0) == 0
    assert admit(kv, s1) == 8
    assert kv.block_ids(s0)[:2] == kv.block_ids(s1)[:2]
    assert admit(kv, make_req("h", list(range(9)), salt="h")) == 0


def test_every_block_returns_to_the_pool():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True)
    reqs = [make_req(str(i), list(range(10))) for i in range(3)]
    for r in reqs:
        admit(kv, r)
    assert kv.num_free_blocks == 6 - 3 - 1 - 1    # 2 shared full blocks + one tail each
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_blocks_are_keyed_by_sha256_of_parent_hash_and_int32_tokens():
    import hashlib

    import numpy as np

    from ringserve.engine.kv_cache import root_hash
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_req("a", list(range(9)))             # 2 full blocks
    admit(kv, a)
    h0 = hashlib.sha256(root_hash(None) + np.arange(4, dtype=np.int32).tobytes()).digest()
    h1 = hashlib.sha256(h0 + np.arange(4, 8, dtype=np.int32).tobytes()).digest()
    assert a.block_hashes == [h0, h1]
    assert kv.pool.cached[h0].block_id == kv.block_ids(a)[0]


def test_a_forced_hash_collision_never_reuses_a_wrong_block(monkeypatch):
    """Every block hashes to one of two keys: a hit must still check the tokens (and the
    parent), so requests with other prompts get no block of another's KV."""
    from ringserve.engine import kv_cache
    monkeypatch.setattr(kv_cache, "hash_block", lambda key: bytes([len(key) % 2]))
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_req("a", list(range(12)))
    assert admit(kv, a) == 0
    assert len(set(a.block_hashes)) == 1          # the collision really happens
    b = make_req("b", [50, 51, 52, 53] + list(range(4, 12)))  # block 0 differs, 1-2 equal
    assert admit(kv, b) == 0
    assert not set(kv.block_ids(b)) & set(kv.block_ids(a))
    c = make_req("c", list(range(4)) + [60, 61, 62, 63, 8, 9, 10, 11])  # block 1 differs
    assert admit(kv, c) == 4                      # only block 0 is really the same
    assert kv.block_ids(c)[0] == kv.block_ids(a)[0]
    assert not set(kv.block_ids(c)[1:]) & set(kv.block_ids(a))
    d = make_req("d", list(range(12)))            # the same prompt still hits where it can:
    assert admit(kv, d) == 4                      # one block per key, the first registered
    assert kv.block_ids(d)[0] == kv.block_ids(a)[0]


# -- a sliding window on every layer: blocks before it go back to the pool ----------------------

def decode(kv: KVCacheManager, req: Request, n: int) -> list[int]:
    """n decode steps as the scheduler runs them; the blocks the request holds after each."""
    held = []
    for _ in range(n):
        req.append_output_token(req.num_tokens % 7)
        assert kv.allocate_slots(req, 1)
        held.append(kv.num_held_blocks(req))
        req.num_computed_tokens += 1
    return held


def test_a_sliding_window_frees_the_blocks_before_it():
    """Window 6, blocks of 4: a token at position p reads keys p-5..p, so a request holds at
    most ceil(6 / 4) + 1 = 3 blocks however long it runs; freed entries are -1 in its table (a
    prefix of it) and count as free in the pool (usage)."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, sliding_window=6)
    req = make_req("a", list(range(9)))           # 9 tokens: the 10th (position 9) reads 4..9
    admit(kv, req)
    assert kv.num_held_blocks(req) == 3
    held = decode(kv, req, 40)                    # 49 tokens: 13 blocks' worth from a pool of 8
    assert max(held) == 3 and kv.num_free_blocks == 8 - held[-1]
    ids = kv.block_ids(req)
    first_read = (48 - 6 + 1) // 4                # the last step computed position 48
    assert len(ids) == 13 and ids[:first_read] == [-1] * first_read and -1 not in ids[first_read:]
    table = kv.block_tables_of([req])[0]
    assert table.tolist() == ids
    assert kv.usage == held[-1] / 8
    kv.free(req)
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_window_hit_needs_only_the_blocks_inside_the_window():
    """A freed block keeps its hash: a later request with the same tokens hits. Once the
    blocks before the window are evicted it still hits, from the right: the hit's first token
    (position k) reads keys k-5.., blocks before those come back as -1, never held."""
    kv = KVCacheManager(num_blocks=7, block_size=4, enable_caching=True, sliding_window=6)
    prompt = list(range(20))
    a = make_req("a", prompt)
    admit(kv, a)                                  # the prefill's first token reads block 0
    assert kv.num_held_blocks(a) == 5
    decode(kv, a, 1)                              # position 20 reads 15..20: blocks 3, 4, 5
    assert kv.block_ids(a)[:3] == [-1] * 3 and kv.num_held_blocks(a) == 3
    kv.free(a)
    b = make_req("b", prompt)
    assert admit(kv, b) == 16                     # 4 full blocks; 16 on are recomputed, reading 11..
    assert kv.block_ids(b)[:2] == [-1] * 2 and kv.num_held_blocks(b) == 3
    kv.free(b)
    # 4 blocks: a's partial block and the one never used (no hash: taken first), then the LRU
    # ones, a's 1 and 0
    evict = make_req("x", [90 + i for i in range(16)])
    admit(kv, evict)
    assert all(kv.pool.lookup(h, kv._block_key(a, i)) is None for i, h in enumerate(a.block_hashes[:2]))
    c = make_req("c", prompt)
    assert admit(kv, c) == 16
    kv.free(c), kv.free(evict)
    d = make_req("d", prompt[:12] + [77] * 8)     # blocks 0-2 equal, but k = 3 needs 1, 2: no hit

    assert admit(kv, d) == 0


def test_window_samples_sharing_blocks_free_them_by_reference():
    """Two samples of one request share their prompt's blocks (a salted hash): each sample's
    window releases its own reference; a block goes back to the pool when both have."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, sliding_window=5)
    s0, s1 = (make_req(f"g#{i}", list(range(10)), salt="g") for i in range(2))
    admit(kv, s0)
    assert admit(kv, s1) == 8
    assert kv.num_free_blocks == 16 - 3 - 1       # block 1 shared; s1 never holds block 0 (-1)
    assert kv.block_ids(s1)[0] == -1
    decode(kv, s0, 8)                             # s0 passes the shared blocks, s1 does not
    shared = kv.block_ids(s1)[1]
    assert shared not in kv.block_ids(s0) and kv.pool.blocks[shared].ref_cnt == 1
    decode(kv, s1, 8)
    assert kv.pool.blocks[shared].ref_cnt == 0
    kv.free(s0), kv.free(s1)
    assert kv.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_freed_block_without_a_hash_is_reused_first():
    """Caching off: blocks freed are taken again before a block never used (whose memory the CPU
    pool has not touched yet), so the pool's touched blocks stay the most ever held at once."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    used: set[int] = set()
    for i in range(20):  # two at a time, 3 blocks each: 6 blocks ever, not 64
        pair = [make_req(f"r{i}-{j}", list(range(10))) for j in range(2)]
        for r in pair:
            admit(kv, r)
            used.update(kv.block_ids(r))
        for r in pair:
            kv.free(r)
    assert len(used) == 6 and kv.num_free_blocks == 64
    # Caching on: a request's partial last block is taken again first; its full blocks stay cached
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_req("a", list(range(10)))                  # blocks 0, 1 full (cached), 2 partial
    admit(kv, a)
    assert kv.block_ids(a) == [0, 1, 2]
    kv.free(a)
    b = make_req("b", [99, 98, 97])
    admit(kv, b)
    assert kv.block_ids(b) == [2]
    kv.free(b)
    assert admit(kv, make_req("a2", list(range(10)))) == 8   # a's two full blocks, still cached
