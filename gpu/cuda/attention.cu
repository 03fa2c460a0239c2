// Paged attention, the fast path (launcher: gpu/cuda/attention.py; the Numba kernel in
// numba_kernels.py is the reference and fallback). Compiled per model with
// -DHEAD_DIM=<64|128|256> -DGQA_GROUP=<query heads per KV head>.
//
// One block (4 warps) per (query token, KV head, split): the GQA group's query heads share
// every K/V row read. Each warp walks keys j = warp, warp + 4, ...; its 32 lanes hold
// HEAD_DIM/32 contiguous dims each, a dot is a warp-shuffle sum, and each warp keeps an online
// softmax per head. Works for prefill chunks and decode alike (each token attends to its own
// request's keys 0..pos through the block table). Long contexts with few tokens (decode) are
// split along the keys (gridDim.z splits of partition_size keys): partial (acc, max, sum)
// go to part_* and attention_reduce combines them.
#include <cuda_fp16.h>

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

__device__ __forceinline__ void load_row(const __half* p, float* f) {
    // PER_LANE contiguous halves (4, 8 or 16 bytes): vector loads.
#pragma unroll
    for (int i = 0; i < PER_LANE; i += 2) {
        const float2 x = __half22float2(*reinterpret_cast<const __half2*>(p + i));
        f[i] = x.x;
        f[i + 1] = x.y;
    }
}

// At least 4 blocks per SM: caps registers at 128 (ptxas then spills nothing; a cap of 64
// spilled at HEAD_DIM 128, GQA_GROUP 4 on sm_80, caught by tests/test_cuda_compile.py).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) paged_attention(
        const __half* __restrict__ qkv, int row_stride,  // q heads at the start of each row
        const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,
        const int* __restrict__ positions, const int* __restrict__ query_start_loc,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
        int num_reqs, int num_kv_heads, int block_size, float scale, int partition_size,
        __half* __restrict__ out,                                // [T, H * D] when gridDim.z == 1
        float* __restrict__ part_acc, float* __restrict__ part_ml) {  // [T, H, S, D], [T, H, S, 2]
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
    // One split covers every key; with several, split s covers [s * partition_size, ...).
    const int begin = splits == 1 ? 0 : split * partition_size;
    const int end = splits == 1 ? num_keys : min(num_keys, begin + partition_size);

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
    for (int j = begin + warp; j < end; j += WARPS) {
        const size_t off = (((size_t)table[j / block_size] * block_size + j % block_size) * num_kv_heads
                            + kvh) * HEAD_DIM + lane * PER_LANE;
        float k[PER_LANE], v[PER_LANE];
        load_row(k_cache + off, k);
        load_row(v_cache + off, v);
#pragma unroll
        for (int g = 0; g < GQA_GROUP; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) s += q[g][i] * k[i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
            const float m_new = fmaxf(m[g], s);
            const float corr = __expf(m[g] - m_new), p = __expf(s - m_new);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) acc[g][i] = acc[g][i] * corr + p * v[i];
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
            out[(size_t)t * num_heads * HEAD_DIM + h * HEAD_DIM + d] = __float2half(sum > 0.0f ? a / sum : 0.0f);
        } else {
            const size_t part = ((size_t)t * num_heads + h) * splits + split;
            part_acc[part * HEAD_DIM + d] = a;
            if (d == 0) { part_ml[part * 2] = mx; part_ml[part * 2 + 1] = sum; }
        }
    }
}

// Combine the splits of each (token, head): grid (T, H), HEAD_DIM threads.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_acc,
                                            const float* __restrict__ part_ml, int splits,
                                            __half* __restrict__ out) {
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x, num_heads = gridDim.y;
    const size_t base = ((size_t)t * num_heads + h) * splits;
    float mx = NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    float a = 0.0f, sum = 0.0f;
    if (mx != NEG_INF) {
        for (int s = 0; s < splits; ++s) {
            const float f = __expf(part_ml[(base + s) * 2] - mx);
            a += part_acc[(base + s) * HEAD_DIM + d] * f;
            sum += part_ml[(base + s) * 2 + 1] * f;
        }
    }
    out[((size_t)t * num_heads + h) * HEAD_DIM + d] = __float2half(sum > 0.0f ? a / sum : 0.0f);
}
