// Paged attention, the fast path (launcher: gpu/cuda/attention.py; the Numba kernel in
// numba_kernels.py is the reference and fallback). Compiled per model with
// -DHEAD_DIM=<64|128|256> -DGQA_GROUP=<query heads per KV head>.
//
// One block (4 warps) per (query token, KV head, split): the GQA group's query heads share
// every K/V row read. A K/V row is read by a row group of ROW_LANES lanes, PER_LANE contiguous
// dims each in one vector load (16 bytes where the registers allow: FlashDecoding's loads), so
// a warp reads 32 / ROW_LANES rows at once; it loads KEYS_PER_GROUP runs of them before it
// scores any (the warps' runs interleaved), a dot is a shuffle sum inside the row group, and
// each row group keeps an online softmax per head, merged across the warp's row groups by
// shuffles and across warps in shared memory. Works for prefill chunks and decode alike (each
// token attends to its own
// request's keys 0..pos through the block table; with a sliding window > 0 only keys
// pos - window < k <= pos, and no block-table entry before the window is read: the KV manager
// may have freed those blocks). Long contexts with few tokens (decode) are split along the keys
// (FlashDecoding): gridDim.z splits, each an equal share of its query's own keys (so a graph's
// split count, planned for max_model_len, keeps every split busy at any length); partial
// (acc, max, sum) go to part_*, and the last split of a (token, KV head) to finish combines them
// in the same launch (an atomic ticket in `tickets`, which that block resets: no second launch).
// q, the KV cache and out are in the activations' element type T: each kernel is a template,
// instantiated as extern "C" kernels for fp16 (the plain names) and bf16 (_bf16) (elem.cuh);
// scores, softmax and sums are float32 in both.
#include "elem.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head_dim>"
#endif
#ifndef GQA_GROUP
#error "compile with -DGQA_GROUP=<num_heads / num_kv_heads>"
#endif

#define FULL_MASK 0xffffffffu
#define WARPS 4
#define NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "HEAD_DIM: 64, 128, 192 or 256");

// Dims a lane holds of a row: 8 (a 16-byte load) unless the GQA group's q and acc registers
// (2 * GQA_GROUP * PER_LANE) would pass 64 of the 128 the launch bounds allow (then 8 bytes,
// or a whole row over the warp); 192 dims are 32 lanes of 6 (12 bytes: 24 lanes of 8 is no
// power of two, and a row group must divide the warp).
#if HEAD_DIM == 192
#define PER_LANE 6
#elif GQA_GROUP <= 4
#define PER_LANE 8
#elif GQA_GROUP <= 8 && HEAD_DIM <= 128
#define PER_LANE 4
#else
#define PER_LANE (HEAD_DIM / 32)
#endif
#define ROW_LANES (HEAD_DIM / PER_LANE)  // lanes that read one K/V row: 8, 16 or 32
#define ROWS (32 / ROW_LANES)            // rows a warp reads at once, one per row group
static_assert(ROW_LANES * PER_LANE == HEAD_DIM && ROWS * ROW_LANES == 32, "row groups must tile the warp");

// Rows a row group loads before it uses any: a decode step is bound by memory latency, and one
// K/V row in flight per lane leaves most of the bandwidth idle. Fewer when the GQA group's
// q and acc registers are many (the 128-register cap below must not spill).
#define KEYS_PER_GROUP ((GQA_GROUP * PER_LANE <= 16) ? 4 : 2)
#define KEY_TILE (ROWS * KEYS_PER_GROUP)  // keys a warp reads per pass

// A lane's PER_LANE contiguous 16-bit values (16, 12, 8 or 4 bytes) in one vector load; its
// offset is a multiple of PER_LANE values, and CuPy allocations are 256-byte aligned. The union
// reads the loaded bits as pairs of T (GCC and NVCC define union punning; a pointer cast would
// break strict aliasing).
#if PER_LANE == 8
typedef uint4 RowVector;
#elif PER_LANE == 6
typedef uint3 RowVector;  // HEAD_DIM 192: 12 bytes, 4-byte aligned (three loads)
#elif PER_LANE == 4
typedef uint2 RowVector;
#else
typedef unsigned int RowVector;
#endif
template <class T>
union RowBits {
    RowVector vector;
    typename Elem<T>::Pair pairs[PER_LANE / 2];
};

template <class T>
__device__ __forceinline__ void load_row(const T* p, float* f) {
    RowBits<T> bits;
    bits.vector = *reinterpret_cast<const RowVector*>(p);
#pragma unroll
    for (int i = 0; i < PER_LANE / 2; ++i) {
        const float2 x = to_float2(bits.pairs[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// FlashDecoding's combine, in the split kernel's own launch: each block, once its partials are
// written and fenced (visible device-wide), takes a ticket for its (token, KV head); the block
// that takes the last one reads every split's partials of the group's heads (through L2:
// __ldcg, never a stale L1 line) and writes out, and resets the ticket to 0 for the next launch
// (a CUDA graph replays this one). One launch where a reduce kernel was a second.
template <class T>
__device__ __forceinline__ void combine_if_last(const float* __restrict__ part_acc,
                                                const float* __restrict__ part_ml, int* __restrict__ tickets,
                                                int t, int kvh, int num_kv_heads, int splits,
                                                T* __restrict__ out) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* ticket = tickets + (size_t)t * num_kv_heads + kvh;
        last = atomicAdd(ticket, 1) == splits - 1;
        if (last) *ticket = 0;  // every other split has taken its ticket
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int num_heads = num_kv_heads * GQA_GROUP;
    for (int idx = threadIdx.x; idx < GQA_GROUP * HEAD_DIM; idx += WARPS * 32) {
        const int g = idx / HEAD_DIM, d = idx - g * HEAD_DIM, h = kvh * GQA_GROUP + g;
        const size_t base = ((size_t)t * num_heads + h) * splits;
        float mx = NEG_INF;
        for (int s = 0; s < splits; ++s) mx = fmaxf(mx, __ldcg(part_ml + (base + s) * 2));
        float a = 0.0f, sum = 0.0f;
        if (mx != NEG_INF) {
            for (int s = 0; s < splits; ++s) {
                const float f = __expf(__ldcg(part_ml + (base + s) * 2) - mx);
                a += __ldcg(part_acc + (base + s) * HEAD_DIM + d) * f;
                sum += __ldcg(part_ml + (base + s) * 2 + 1) * f;
            }
        }
        out[((size_t)t * num_heads + h) * HEAD_DIM + d] = Elem<T>::from(sum > 0.0f ? a / sum : 0.0f);
    }
}

// One value of a head after RoPE (HF rotate_half over its first 2 * rot_half dims: dim d pairs
// with d + rot_half; the rest passes through), before rounding: fused.cu rope_store_kv's formula.
template <class T>
__device__ __forceinline__ float rotated(const T* head, int d, const float* c, const float* s, int rot_half) {
    const float x = to_float(head[d]);
    if (d < rot_half) return x * c[d] - to_float(head[d + rot_half]) * s[d];
    if (d < 2 * rot_half) return x * c[d - rot_half] + to_float(head[d - rot_half]) * s[d - rot_half];
    return x;
}

// A lane's PER_LANE dims of a head, rotated and rounded to T once (what rope_store_kv stores).
template <class T>
__device__ __forceinline__ void load_rotated(const T* head, int dim0, const float* c, const float* s,
                                             int rot_half, float* f) {
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
        f[i] = to_float(Elem<T>::from(rotated(head, dim0 + i, c, s, rot_half)));
}

// One pass of a row group's online softmax over its KEYS_PER_GROUP loaded rows (valid[u]
// false: no key there, weight 0), for each head of the GQA group: a dot is a shuffle sum over
// the row group's lanes (every lane of the warp takes part, valid or not).
__device__ __forceinline__ void attend(const float (&q)[GQA_GROUP][PER_LANE],
                                       const float (&k)[KEYS_PER_GROUP][PER_LANE],
                                       const float (&v)[KEYS_PER_GROUP][PER_LANE],
                                       const bool (&valid)[KEYS_PER_GROUP], float (&acc)[GQA_GROUP][PER_LANE],
                                       float (&m)[GQA_GROUP], float (&l)[GQA_GROUP]) {
#pragma unroll
    for (int g = 0; g < GQA_GROUP; ++g) {
        float sc[KEYS_PER_GROUP];
        float m_new = m[g];
#pragma unroll
        for (int u = 0; u < KEYS_PER_GROUP; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) dot += q[g][i] * k[u][i];
#pragma unroll
            for (int o = ROW_LANES / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
            sc[u] = valid[u] ? dot : NEG_INF;
            m_new = fmaxf(m_new, sc[u]);
        }
        // a row group with no key in this pass (the last pass) adds nothing; otherwise m_new
        // is finite: no exp(-inf - -inf)
        if (m_new == NEG_INF) continue;
        const float corr = __expf(m[g] - m_new);
        float p[KEYS_PER_GROUP], p_sum = 0.0f;
#pragma unroll
        for (int u = 0; u < KEYS_PER_GROUP; ++u) {
            p[u] = __expf(sc[u] - m_new);
            p_sum += p[u];
        }
        l[g] = l[g] * corr + p_sum;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            float a = acc[g][i] * corr;
#pragma unroll
            for (int u = 0; u < KEYS_PER_GROUP; ++u) a += p[u] * v[u][i];
            acc[g][i] = a;
        }
        m[g] = m_new;
    }
}

// RoPE inputs of the decode-only variant (ROPE): each token's slot, the cos/sin tables
// [positions, rot_half]; the caches written through k_out / v_out (the same arrays as k_cache,
// v_cache: only the slot of this launch's own tokens, which no block reads from the cache).
template <class T>
struct RopeArgs {
    const int* slot_mapping;
    const float* cos_table;
    const float* sin_table;
    int rot_half;
    T* k_out;
    T* v_out;
};

// The kernel body, for element type T (launch bounds: the instantiations at the end). ROPE: the
// decode-only variant (one token per request, so a token's own key is its request's last): q
// and the token's own k rotated on the fly from qkv (unrotated, as the QKV GEMM left it), the
// own key and value read from qkv rather than the cache, and split 0 of each (token, KV head)
// writes them to the cache for the next steps (fused.cu rope_store_kv's work, in this launch).
template <class T, bool ROPE>
__device__ __forceinline__ void paged_attention_t(
        const T* __restrict__ qkv, int row_stride,  // q heads at the start of each row
        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
        const int* __restrict__ positions, const int* __restrict__ query_start_loc,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
        int num_reqs, int num_kv_heads, int block_size, float scale, int window,
        T* __restrict__ out,                                          // [T, H * D]
        float* __restrict__ part_acc, float* __restrict__ part_ml,  // [T, H, S, D], [T, H, S, 2]
        int* __restrict__ tickets,                                  // [T, KVH], zero between launches
        RopeArgs<T> rope) {
    __shared__ float sm_acc[WARPS][GQA_GROUP][HEAD_DIM];
    __shared__ float sm_m[WARPS][GQA_GROUP], sm_l[WARPS][GQA_GROUP];
    const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane / ROW_LANES, dim0 = (lane % ROW_LANES) * PER_LANE;  // row group, first dim
    const int num_heads = num_kv_heads * GQA_GROUP;

    int lo = 0, hi = num_reqs - 1;  // the request owning token t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int r = lo;
    const int pos = positions[t];
    const int num_keys = min(pos + 1, seq_lens[r]);
    const int first = window > 0 ? max(0, pos + 1 - window) : 0;  // the window's first key
    // Split s covers [first + s * share, ...) of this query's keys [first, num_keys) (one split:
    // all of them; a padding row, no keys: none).
    const int share = (max(num_keys - first, 0) + splits - 1) / splits;
    const int begin = first + split * share;
    const int end = min(num_keys, begin + share);

    const T* row = qkv + (size_t)t * row_stride;
    const T* own_k = row + (size_t)(num_heads + kvh) * HEAD_DIM;                 // ROPE: this token's
    const T* own_v = row + (size_t)(num_heads + num_kv_heads + kvh) * HEAD_DIM;  // k and v heads
    const float* c = nullptr;
    const float* s = nullptr;
    if (ROPE) {
        c = rope.cos_table + (size_t)pos * rope.rot_half;
        s = rope.sin_table + (size_t)pos * rope.rot_half;
        const int slot = rope.slot_mapping[t];
        if (split == 0 && slot >= 0) {  // -1: a graph's padding row writes nothing
            const size_t at = ((size_t)slot * num_kv_heads + kvh) * HEAD_DIM;
            for (int d = threadIdx.x; d < HEAD_DIM; d += WARPS * 32) {
                rope.k_out[at + d] = Elem<T>::from(rotated(own_k, d, c, s, rope.rot_half));
                rope.v_out[at + d] = own_v[d];
            }
        }
    }

    float q[GQA_GROUP][PER_LANE], acc[GQA_GROUP][PER_LANE], m[GQA_GROUP], l[GQA_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; ++g) {
        const T* head = row + (kvh * GQA_GROUP + g) * HEAD_DIM;
        if (ROPE) load_rotated(head, dim0, c, s, rope.rot_half, q[g]);
        else load_row(head + dim0, q[g]);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) { q[g][i] *= scale; acc[g][i] = 0.0f; }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    const int* table = block_tables + (size_t)r * max_blocks;
    // Warp w takes the KEY_TILE keys from j0 = begin + w * KEY_TILE, then strides by
    // WARPS * KEY_TILE; row group r of the warp reads keys j0 + u * ROWS + r (u < KEYS_PER_GROUP),
    // all its loads issued before the first use. ROPE: the cache holds keys up to pos - 1; the own key after.
    const int cached_end = ROPE ? min(end, pos) : end;
    for (int j0 = begin + warp * KEY_TILE; j0 < cached_end; j0 += WARPS * KEY_TILE) {
        float k[KEYS_PER_GROUP][PER_LANE], v[KEYS_PER_GROUP][PER_LANE];
        bool valid[KEYS_PER_GROUP];
#pragma unroll
        for (int u = 0; u < KEYS_PER_GROUP; ++u) {
            const int j = j0 + u * ROWS + group;
            valid[u] = j < cached_end;
            if (valid[u]) {
                const size_t off = (((size_t)table[j / block_size] * block_size + j % block_size)
                                    * num_kv_heads + kvh) * HEAD_DIM + dim0;
                load_row(k_cache + off, k[u]);
                load_row(v_cache + off, v[u]);
            } else {  // past the end: weight 0, and 0 * v must not be 0 * garbage (NaN)
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) { k[u][i] = 0.0f; v[u][i] = 0.0f; }
            }
        }
        attend(q, k, v, valid, acc, m, l);
    }
    if (ROPE && warp == 0 && begin <= pos && pos < end) {  // the own key, in this block's share
        float k[KEYS_PER_GROUP][PER_LANE] = {}, v[KEYS_PER_GROUP][PER_LANE] = {};
        bool valid[KEYS_PER_GROUP] = {};
        valid[0] = group == 0;  // one row group counts it (the warp's shuffles need every lane)
        load_rotated(own_k, dim0, c, s, rope.rot_half, k[0]);
        load_row(own_v + dim0, v[0]);
        attend(q, k, v, valid, acc, m, l);
    }
    // The warp's row groups merged (lane x and x ^ o hold the same dims of two groups' states);
    // then row group 0 holds the warp's.
#pragma unroll
    for (int o = ROW_LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; ++g) {
            const float om = __shfl_xor_sync(FULL_MASK, m[g], o), ol = __shfl_xor_sync(FULL_MASK, l[g], o);
            const float mx = fmaxf(m[g], om);
            const float f = m[g] == NEG_INF ? 0.0f : __expf(m[g] - mx);  // 0 for a group that saw no key
            const float of = om == NEG_INF ? 0.0f : __expf(om - mx);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const float other = __shfl_xor_sync(FULL_MASK, acc[g][i], o);
                acc[g][i] = acc[g][i] * f + other * of;
            }
            l[g] = l[g] * f + ol * of;
            m[g] = mx;
        }
    }
    if (group == 0) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; ++g) {
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) sm_acc[warp][g][dim0 + i] = acc[g][i];
            if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GQA_GROUP * HEAD_DIM; idx += WARPS * 32) {
        const int g = idx / HEAD_DIM, d = idx - g * HEAD_DIM, h = kvh * GQA_GROUP + g;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float a = 0.0f, sum = 0.0f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = __expf(sm_m[w][g] - mx);  // 0 for a warp that saw no key
                a += sm_acc[w][g][d] * f;
                sum += sm_l[w][g] * f;
            }
        }
        if (splits == 1) {
            out[(size_t)t * num_heads * HEAD_DIM + h * HEAD_DIM + d] = Elem<T>::from(sum > 0.0f ? a / sum : 0.0f);
        } else {
            const size_t part = ((size_t)t * num_heads + h) * splits + split;
            part_acc[part * HEAD_DIM + d] = a;
            if (d == 0) { part_ml[part * 2] = mx; part_ml[part * 2 + 1] = sum; }
        }
    }
    if (splits > 1) combine_if_last<T>(part_acc, part_ml, tickets, t, kvh, num_kv_heads, splits, out);
}

// At least 4 blocks per SM: caps registers at 128 (ptxas then spills nothing; a cap of 64
// spilled at HEAD_DIM 128, GQA_GROUP 4 on sm_80, caught by tests/test_cuda_compile.py).
// paged_attention: q rotated and the step's K/V in the cache before it (fused.cu rope_store_kv);
// paged_attention_rope: decode-only steps, RoPE and the K/V write in this launch (its caches are
// written, hence not const; the extra arguments: slot_mapping, cos, sin, rot_half).
#define ATTENTION_PARAMS(T, KV_CONST)                                                                     \
    const T* __restrict__ qkv, int row_stride, KV_CONST T* __restrict__ k_cache,                         \
            KV_CONST T* __restrict__ v_cache, const int* __restrict__ positions,                         \
            const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,                   \
            const int* __restrict__ block_tables, int max_blocks, int num_reqs, int num_kv_heads,        \
            int block_size, float scale, int window, T* __restrict__ out, float* __restrict__ part_acc,  \
            float* __restrict__ part_ml, int* __restrict__ tickets
#define ATTENTION_ARGS                                                                                    \
    qkv, row_stride, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables, max_blocks,   \
            num_reqs, num_kv_heads, block_size, scale, window, out, part_acc, part_ml, tickets
#define ATTENTION_KERNELS(T, SUFFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)                                          \
            paged_attention##SUFFIX(ATTENTION_PARAMS(T, const)) {                                        \
        paged_attention_t<T, false>(ATTENTION_ARGS, RopeArgs<T>{});                                      \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) paged_attention_rope##SUFFIX(             \
            ATTENTION_PARAMS(T, ), const int* __restrict__ slot_mapping,                                 \
            const float* __restrict__ cos_table, const float* __restrict__ sin_table, int rot_half) {    \
        paged_attention_t<T, true>(ATTENTION_ARGS, RopeArgs<T>{slot_mapping, cos_table, sin_table,        \
                                                                rot_half, k_cache, v_cache});             \
    }
ATTENTION_KERNELS(__half, )
ATTENTION_KERNELS(__nv_bfloat16, _bf16)
