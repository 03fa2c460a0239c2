// Linears over weights kept packed on the device (launchers: gpu/cuda/quant.py, plans:
// gpu/cuda/quant_linear.py). The planes are gpu/quant.py's, uploaded as they are:
//   u4: unsigned char [N, K/2], 4-bit quants in 64-weight groups (byte j of group g: weight
//       64g + j in its low nibble, 64g + 32 + j in its high one): Q4_0, Q4_1, Q4_K, AWQ, GPTQ;
//   i8: signed char [N, K], one quant a byte: Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K;
//   scale, offset: float32 [N, K/block] (offset may be null): weight = scale * q + offset,
// so one kernel per plane kind serves every type. Every 16 contiguous weights share one
// scale (block is a multiple of 16), and every lane reads its 16 quant bytes with one 16-byte
// load (row pitches K/2 and K are multiples of 16 bytes: K % 64 == 0 for u4, K % 16 for i8);
//   bf16: unsigned short [N, K], bfloat16 bits (BF16 GGUF tensors, HF bfloat16 checkpoints),
//       no scale or offset (null, block unused): a weight is the upper half of a float32, so
//       widening is exact, a shift; a 16-byte load holds 8 weights (K % 8 == 0).
//
// matvec_*_r<R>: decode (M <= R rows of x, R in 1, 2, 4, 8, 16). One warp per output row:
// each lane loads a 16-byte chunk of quants once, dequantizes it in registers and dots it
// with the matching 16 (i8), 2 x 16 (u4) or 8 (bf16) values of every row of x; float32 sums, a warp
// shuffle sum at the end, fp16 out[m, n] (row pitch ldo: a fused weight's part writes its
// own columns).
// dequant_*_{f16,f32}: the weight's rows (ids[r], or row_begin + r when ids is null) as
// floats: fp16 into the workspace the cuBLAS GEMM of a large batch reads, float32 for the
// embedding of a packed table.
// Both are one template each over a plane-kind policy (U4, I8, BF16 below: what a chunk of
// 16 bytes holds and its weights' values), so a kind is written once and read by every kernel.
// NVRTC defines no libc and no stdint: only cuda_fp16.h is included.
#include <cuda_fp16.h>

#define FULL_MASK 0xffffffffu
#define QUANT_WARPS 4

union Chunk16 {  // 16 quant bytes in one vector load (union punning: see attention.cu)
    uint4 vector;
    unsigned char u[16];
    signed char s[16];
    unsigned int pairs[4];  // bf16: word i holds weight 2i in its low half, 2i + 1 in its high one
};
union Halves8 {
    uint4 vector;
    __half2 pairs[4];
};

// 8 halves of x (16 bytes, one vector load; p is 16-byte aligned: ldx % 8 == 0) as floats.
__device__ __forceinline__ void load_x8(const __half* p, float* f) {
    Halves8 h;
    h.vector = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = __half22float2(h.pairs[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// 16 halves of x (32 bytes, two vector loads) as floats.
__device__ __forceinline__ void load_x16(const __half* p, float* f) {
    load_x8(p, f);
    load_x8(p + 8, f + 8);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// w[i] = scale * q[i] + offset for the 16 quants of one chunk: u4 low (half 0) / high (half 1)
// nibbles, or i8 bytes (the same float32 operations, in the same order, as gpu/quant.py
// dequantize).
__device__ __forceinline__ void dequant16_u4(const Chunk16& c, int half, float s, float o, float* w) {
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = s * (float)((c.u[i] >> (4 * half)) & 15) + o;
}

__device__ __forceinline__ void dequant16_i8(const Chunk16& c, float s, float o, float* w) {
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = s * (float)c.s[i] + o;
}

// The 8 bf16 weights of one chunk as floats: bf16 is float32's upper half, so the widening is
// exact (a shift or a mask, no conversion instruction).
__device__ __forceinline__ void widen8_bf16(const Chunk16& c, float* w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = __uint_as_float(c.pairs[i] << 16);
        w[2 * i + 1] = __uint_as_float(c.pairs[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float dot8(const float* w, const __half* x) {
    float xv[8];
    load_x8(x, xv);
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) d += w[i] * xv[i];
    return d;
}

__device__ __forceinline__ float dot16(const float* w, const __half* x) {
    float xv[16];
    load_x16(x, xv);
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) d += w[i] * xv[i];
    return d;
}

template <int ROWS>
__device__ __forceinline__ void write_rows(float* acc, int M, __half* out, int ldo, int n) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == 0 && m < M) out[(size_t)m * ldo + n] = __float2half(v);
    }
}

// Each plane kind's 16-byte chunk c of a row: which weights it holds and their values.
// chunk(bits, c, srow, ...) calls use(k, w) once for each run of RUN weights k..k + RUN - 1 of
// the chunk, with w their float32 values; the mat-vec and the dequantize kernels share this
// and differ only in what use() does with them.
struct U4 {  // two runs of 16: the low nibbles (weights k_lo..) and the high ones (k_lo + 32..)
    using Q = unsigned char;
    static constexpr int WEIGHTS = 32, RUN = 16;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K / 2; }
    static __device__ __forceinline__ int scales_per_row(int K, int block) { return K / block; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const Chunk16& bits, int c, const float* scale,
                                                 const float* offset, size_t srow, int block, Use use) {
        const int k_lo = 64 * (c >> 1) + 16 * (c & 1);
        float w[16];  // NOTE: one nibble half at a time: 16 weights live, not 32 (registers)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int k = k_lo + 32 * half;
            dequant16_u4(bits, half, scale[srow + k / block], offset ? offset[srow + k / block] : 0.0f, w);
            use(k, w);
        }
    }
};

struct I8 {  // one run of 16: weights 16c..16c + 15
    using Q = signed char;
    static constexpr int WEIGHTS = 16, RUN = 16;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K; }
    static __device__ __forceinline__ int scales_per_row(int K, int block) { return K / block; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const Chunk16& bits, int c, const float* scale,
                                                 const float* offset, size_t srow, int block, Use use) {
        const int k = 16 * c;
        float w[16];
        dequant16_i8(bits, scale[srow + k / block], offset ? offset[srow + k / block] : 0.0f, w);
        use(k, w);
    }
};

// scale, offset, block: unused (a bf16 weight is its own value; block may be 0), taken so that
// every kind has the launchers' one signature.
struct BF16 {  // one run of 8: weights 8c..8c + 7
    using Q = unsigned short;
    static constexpr int WEIGHTS = 8, RUN = 8;
    static __device__ __forceinline__ size_t row_bytes(int K) { return 2 * (size_t)K; }
    static __device__ __forceinline__ int scales_per_row(int, int) { return 0; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const Chunk16& bits, int c, const float*,
                                                 const float*, size_t, int, Use use) {
        float w[8];
        widen8_bf16(bits, w);
        use(8 * c, w);
    }
};

template <int RUN>
__device__ __forceinline__ float dot_run(const float* w, const __half* x) {
    if constexpr (RUN == 16) return dot16(w, x);
    else return dot8(w, x);
}

// One warp per output row n: each lane loads 16-byte chunks of the row's quants (PERF: the one
// weight load, once for every row of x), dequantizes them in registers and dots them with the
// matching weights of every row of x.
template <class Kind, int ROWS>
__device__ __forceinline__ void matvec(
        const typename Kind::Q* __restrict__ q, const float* __restrict__ scale,
        const float* __restrict__ offset, int block, const __half* __restrict__ x, int ldx, int M,
        int N, int K, __half* __restrict__ out, int ldo) {
    const int lane = threadIdx.x & 31, n = blockIdx.x * QUANT_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;  // the whole warp: n is the warp's
    const unsigned char* qrow = reinterpret_cast<const unsigned char*>(q) + (size_t)n * Kind::row_bytes(K);
    const size_t srow = (size_t)n * Kind::scales_per_row(K, block);
    float acc[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) acc[m] = 0.0f;
    for (int c = lane; c < K / Kind::WEIGHTS; c += 32) {
        Chunk16 bits;
        bits.vector = *reinterpret_cast<const uint4*>(qrow + 16 * c);
        Kind::chunk(bits, c, scale, offset, srow, block, [&](int k, const float* w) {
#pragma unroll
            for (int m = 0; m < ROWS; ++m)
                if (m < M) acc[m] += dot_run<Kind::RUN>(w, x + (size_t)m * ldx + k);
        });
    }
    write_rows<ROWS>(acc, M, out, ldo, n);
}

#define MATVEC(KIND, QT, R)                                                                        \
    extern "C" __global__ void __launch_bounds__(QUANT_WARPS * 32, 4) matvec_##KIND##_r##R(         \
            const QT* __restrict__ q, const float* __restrict__ scale,                             \
            const float* __restrict__ offset, int block, const __half* __restrict__ x, int ldx,    \
            int M, int N, int K, __half* __restrict__ out, int ldo) {                              \
        matvec<KIND_##KIND, R>(q, scale, offset, block, x, ldx, M, N, K, out, ldo);                \
    }
using KIND_u4 = U4;
using KIND_i8 = I8;
using KIND_bf16 = BF16;
MATVEC(u4, unsigned char, 1)
MATVEC(u4, unsigned char, 2)
MATVEC(u4, unsigned char, 4)
MATVEC(u4, unsigned char, 8)
MATVEC(u4, unsigned char, 16)
MATVEC(i8, signed char, 1)
MATVEC(i8, signed char, 2)
MATVEC(i8, signed char, 4)
MATVEC(i8, signed char, 8)
MATVEC(i8, signed char, 16)
MATVEC(bf16, unsigned short, 1)
MATVEC(bf16, unsigned short, 2)
MATVEC(bf16, unsigned short, 4)
MATVEC(bf16, unsigned short, 8)
MATVEC(bf16, unsigned short, 16)

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half(v); }

// Grid-stride over (row, chunk); each thread dequantizes one 16-byte chunk of quants.
// NOTE: bf16 into the fp16 workspace (a large batch's GEMM) is exact for |w| in [2^-14, 65504]
// (fp16 keeps 11 significant bits, bf16 8); smaller weights round to fp16 subnormals (an
// absolute error under 2^-25) and larger ones would overflow to inf: trained LLM weights sit
// far inside that range, and the fp16 store made the same narrowing of every bf16 weight
// before. The mat-vec (decode) reads the bf16 bits as they are.
template <class Kind, typename T>
__device__ __forceinline__ void dequant(
        const typename Kind::Q* __restrict__ q, const float* __restrict__ scale,
        const float* __restrict__ offset, int block, int K, const int* __restrict__ ids,
        int row_begin, int nrows, T* __restrict__ out, int ldo) {
    const int chunks = K / Kind::WEIGHTS;
    const size_t total = (size_t)nrows * chunks;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / chunks), c = (int)(i - (size_t)r * chunks);
        const size_t src = ids ? (size_t)ids[r] : (size_t)(row_begin + r);
        Chunk16 bits;
        bits.vector = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(q) +
                                                      src * Kind::row_bytes(K) + 16 * c);
        T* o = out + (size_t)r * ldo;
        Kind::chunk(bits, c, scale, offset, src * Kind::scales_per_row(K, block), block,
                    [&](int k, const float* w) {
#pragma unroll
                        for (int j = 0; j < Kind::RUN; ++j) put(o + k + j, w[j]);
                    });
    }
}

#define DEQUANT(KIND, QT, T, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(256) dequant_##KIND##_##SUFFIX(                   \
            const QT* __restrict__ q, const float* __restrict__ scale,                             \
            const float* __restrict__ offset, int block, int K, const int* __restrict__ ids,       \
            int row_begin, int nrows, T* __restrict__ out, int ldo) {                              \
        dequant<KIND_##KIND, T>(q, scale, offset, block, K, ids, row_begin, nrows, out, ldo);      \
    }
DEQUANT(u4, unsigned char, __half, f16)
DEQUANT(u4, unsigned char, float, f32)
DEQUANT(i8, signed char, __half, f16)
DEQUANT(i8, signed char, float, f32)
DEQUANT(bf16, unsigned short, __half, f16)
DEQUANT(bf16, unsigned short, float, f32)
