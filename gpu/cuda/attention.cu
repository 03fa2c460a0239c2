// Paged attention, the fast path (launcher: gpu/cuda/attention.py; the Numba kernel in
// numba_kernels.py is the reference and fallback). Compiled per model with
// -DHEAD_DIM=<64|128|256> -DGQA_GROUP=<query heads per KV head>.
//
// One block (4 warps) per (query token, KV head, split): the GQA group's query heads share
// every K/V row read. Each warp walks runs of KEYS_PER_WARP keys (loaded together, then
// scored), the warps' runs interleaved; its 32 lanes hold
// HEAD_DIM/32 contiguous dims each, a dot is a warp-shuffle sum, and each warp keeps an online
// softmax per head. Works for prefill chunks and decode alike (each token attends to its own
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
#define PER_LANE (HEAD_DIM / 32)
#define NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "HEAD_DIM: 64, 128, 192 or 256");

// Keys a warp loads before it uses any: a decode step is bound by memory latency, and one
// K/V row in flight per warp leaves most of the bandwidth idle. Fewer when the GQA group's
// q and acc registers are many (the 128-register cap below must not spill).
#define KEYS_PER_WARP ((GQA_GROUP * PER_LANE <= 16) ? 4 : 2)

// A lane's PER_LANE contiguous 16-bit values (4, 8, 12 or 16 bytes) in one vector load; its
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

// The kernel body, for element type T (launch bounds: the instantiations at the end).
template <class T>
__device__ __forceinline__ void paged_attention_t(
        const T* __restrict__ qkv, int row_stride,  // q heads at the start of each row
        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
        const int* __restrict__ positions, const int* __restrict__ query_start_loc,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
        int num_reqs, int num_kv_heads, int block_size, float scale, int window,
        T* __restrict__ out,                                          // [T, H * D]
        float* __restrict__ part_acc, float* __restrict__ part_ml,  // [T, H, S, D], [T, H, S, 2]
        int* __restrict__ tickets) {                                // [T, KVH], zero between launches
    __shared__ float sm_acc[WARPS][GQA_GROUP][HEAD_DIM];
    __shared__ float sm_m[WARPS][GQA_GROUP], sm_l[WARPS][GQA_GROUP];
    const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int num_heads = num_kv_heads * GQA_GROUP;

    int lo = 0, hi = num_reqs - 1;  // the request owning token t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int r = lo;
    const int num_keys = min(positions[t] + 1, seq_lens[r]);
    const int first = window > 0 ? max(0, positions[t] + 1 - window) : 0;  // the window's first key
    // Split s covers [first + s * share, ...) of this query's keys [first, num_keys) (one split:
    // all of them; a padding row, no keys: none).
    const int share = (max(num_keys - first, 0) + splits - 1) / splits;
    const int begin = first + split * share;
    const int end = min(num_keys, begin + share);

    float q[GQA_GROUP][PER_LANE], acc[GQA_GROUP][PER_LANE], m[GQA_GROUP], l[GQA_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; ++g) {
        load_row(qkv + (size_t)t * row_stride + (kvh * GQA_GROUP + g) * HEAD_DIM + lane * PER_LANE, q[g]);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) { q[g][i] *= scale; acc[g][i] = 0.0f; }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    const int* table = block_tables + (size_t)r * max_blocks;
    // Warp w takes keys [j0, j0 + KEYS_PER_WARP) for j0 = begin + w * KEYS_PER_WARP, then
    // strides by WARPS * KEYS_PER_WARP; all its loads are issued before the first use.
    for (int j0 = begin + warp * KEYS_PER_WARP; j0 < end; j0 += WARPS * KEYS_PER_WARP) {
        float k[KEYS_PER_WARP][PER_LANE], v[KEYS_PER_WARP][PER_LANE];
#pragma unroll
        for (int u = 0; u < KEYS_PER_WARP; ++u) {
            const int j = j0 + u;
            if (j < end) {
                const size_t off = (((size_t)table[j / block_size] * block_size + j % block_size)
                                    * num_kv_heads + kvh) * HEAD_DIM + lane * PER_LANE;
                load_row(k_cache + off, k[u]);
                load_row(v_cache + off, v[u]);
            } else {  // past the end: weight 0, and 0 * v must not be 0 * garbage (NaN)
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) { k[u][i] = 0.0f; v[u][i] = 0.0f; }
            }
        }
#pragma unroll
        for (int g = 0; g < GQA_GROUP; ++g) {
            float s[KEYS_PER_WARP];
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < KEYS_PER_WARP; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) dot += q[g][i] * k[u][i];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
                s[u] = j0 + u < end ? dot : NEG_INF;
                m_new = fmaxf(m_new, s[u]);
            }
            // key j0 < end is real, so m_new is finite: no exp(-inf - -inf)
            const float corr = __expf(m[g] - m_new);
            float p[KEYS_PER_WARP], p_sum = 0.0f;
#pragma unroll
            for (int u = 0; u < KEYS_PER_WARP; ++u) {
                p[u] = __expf(s[u] - m_new);
                p_sum += p[u];
            }
            l[g] = l[g] * corr + p_sum;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                float a = acc[g][i] * corr;
#pragma unroll
                for (int u = 0; u < KEYS_PER_WARP; ++u) a += p[u] * v[u][i];
                acc[g][i] = a;
            }
            m[g] = m_new;
        }
    }
#pragma unroll
    for (int g = 0; g < GQA_GROUP; ++g) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) sm_acc[warp][g][lane * PER_LANE + i] = acc[g][i];
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
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
#define ATTENTION_KERNELS(T, SUFFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) paged_attention##SUFFIX(                  \
            const T* __restrict__ qkv, int row_stride, const T* __restrict__ k_cache,                    \
            const T* __restrict__ v_cache, const int* __restrict__ positions,                            \
            const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,                   \
            const int* __restrict__ block_tables, int max_blocks, int num_reqs, int num_kv_heads,        \
            int block_size, float scale, int window, T* __restrict__ out, float* __restrict__ part_acc,  \
            float* __restrict__ part_ml, int* __restrict__ tickets) {                                    \
        paged_attention_t<T>(qkv, row_stride, k_cache, v_cache, positions, query_start_loc, seq_lens,    \
                             block_tables, max_blocks, num_reqs, num_kv_heads, block_size, scale,        \
                             window, out, part_acc, part_ml, tickets);                                   \
    }
ATTENTION_KERNELS(__half, )
ATTENTION_KERNELS(__nv_bfloat16, _bf16)
