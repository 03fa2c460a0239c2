// Linears over weights kept packed on the device (launchers: gpu/cuda/quant.py, plans:
// gpu/cuda/quant_linear.py). The planes are gpu/loader/quant.py's, uploaded as they are:
//   u4: unsigned char [N, K/2], 4-bit quants in 64-weight groups (byte j of group g: weight
//       64g + j in its low nibble, 64g + 32 + j in its high one): Q4_0, Q4_1, Q4_K, AWQ, GPTQ;
//   u6: unsigned char [N, 3K/4], Q6_K's v = q + 32: a row's u4 plane of v & 15, then its 2-bit
//       highs, 16 bytes a 64-weight group (byte i, bits 2j: weight 64g + 16j + i; to_u6);
//   i8: signed char [N, K], one quant a byte: Q8_0, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K;
//   scale, offset: [N, K/block] (offset may be null): weight = scale * q + offset, each plane in
//       one of three forms, scale_bytes says which (both planes share it): 4, float32; 2, fp16
//       (legacy types, GPTQ: exact halves); 1, int8 factors of the float32 super planes
//       scale_super, offset_super [N, K/256] (the K-quants: sc * d and m * -dmin, the float32
//       products gpu/loader/quant.py computes, so bit-identical), all read by plane_at /
//       plane_raw; a null offset with zero != 0 is -zero * scale (Q4_0, GPTQ: as_zero_point),
// so one kernel per plane kind serves every type. Why the compact forms: a batch-1 step streams
// the planes with the quants (Q4_K 0.594 B/weight factored, not 0.75; Q6_K 0.828, not 1.078).
// Why a runtime scale_bytes and not a template parameter: one uniform branch per group in a
// memory-bound kernel, and the kernel count (compile time) stays. ptxas -v (sm_80, sm_90):
// docs/deploy.md "Quantized weights" lists each kernel's registers and shared memory; 0 spills.
// Every 16 contiguous weights share one scale (block is a multiple of 16), and quants are read
// in 16-byte loads (row pitches K/2, 3K/4 and K are multiples of 16 bytes: K % 64 == 0 for u4
// and u6, K % 16 for i8);
//   bf16: unsigned short [N, K], bfloat16 bits (BF16 GGUF tensors, HF bfloat16 checkpoints),
//       no scale or offset (null, block unused): a weight is the upper half of a float32, so
//       widening is exact, a shift; a 16-byte load holds 8 weights (K % 8 == 0).
//
// matvec_*_r<R>: decode (M <= R rows of x, R in 1, 2, 4, 8, 16): the design and why, where it
// is written (below); float32 sums, warp shuffle sums at the end, fp16 out[m, n] (row pitch
// ldo: a fused weight's part writes its own columns).
// gemm_*: a large batch (QuantLinear's large_batch "tiled"): 64 x 64 tiles of out, the
// weight dequantized into shared memory a tile at a time and multiplied on tensor cores
// (below, after the mat-vecs).
// dequant_*_{f16,bf16,f32}: the weight's rows (ids[r], or row_begin + r when ids is null) as
// floats: fp16 or bf16 (the activations' type) into the workspace the cuBLAS GEMM of a large
// batch reads, float32 for the embedding of a packed table.
// The activations x and out are fp16 (the plain names) or bf16 (matvec_*_bf16, gemm_*_bf16: x
// and out __nv_bfloat16, elem.cuh, and mma.sync .bf16), a template parameter; the scales stay
// as the store made them.
// Each is one template over a plane-kind policy (U4, U6, I8, BF16 for the dequantize kernels,
// MvU4.. for the mat-vec's units, TileU4.. for the GEMM's tiles), so a kind is written once per
// access pattern.
// NVRTC defines no libc and no stdint: only cuda_fp16.h and cuda_bf16.h are included (elem.cuh).
#include "elem.cuh"

#define FULL_MASK 0xffffffffu
#define QK_K 256  // weights a K-quant super-block holds: one super plane value a row's 256

union Chunk16 {  // 16 quant bytes in one vector load (union punning: see attention.cu)
    uint4 vector;
    unsigned char u[16];
    signed char s[16];
    unsigned int pairs[4];  // bf16: word i holds weight 2i in its low half, 2i + 1 in its high one
};
template <class T>
union Pairs8 {  // 8 16-bit values of x in one vector load
    uint4 vector;
    typename Elem<T>::Pair pairs[4];
};

// 8 values of x (16 bytes, one vector load; p is 16-byte aligned: ldx % 8 == 0) as floats.
template <class T>
__device__ __forceinline__ void load_x8(const T* p, float* f) {
    Pairs8<T> h;
    h.vector = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 t = to_float2(h.pairs[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// w[i] = scale * q[i] + offset for the 16 quants of one chunk: u4 low (half 0) / high (half 1)
// nibbles, or i8 bytes (the same float32 operations, in the same order, as gpu/loader/quant.py
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

template <int ROWS, class T>
__device__ __forceinline__ void write_rows(float* acc, int M, T* out, int ldo, int n) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == 0 && m < M) out[(size_t)m * ldo + n] = Elem<T>::from(v);
    }
}

// Value `at` of a scale or offset plane in the form `bytes` says (the header): float32, fp16, or
// an int8 factor times its row's super plane value for weight k. The one place a plane is read.
__device__ __forceinline__ float plane_at(const void* __restrict__ plane, const float* __restrict__ super,
                                          int bytes, size_t n, int K, int block, int k) {
    const size_t at = n * (size_t)(K / block) + k / block;
    if (bytes == 4) return static_cast<const float*>(plane)[at];
    if (bytes == 2) return __half2float(static_cast<const __half*>(plane)[at]);
    return (float)static_cast<const signed char*>(plane)[at] * super[n * (size_t)(K / QK_K) + k / QK_K];
}

// A weight's scale and offset planes, as the kernels take them (offset may be null: 0).
// zero: where the offset plane is left out (null), the quants' zero point: o = -zero * s
// (exact: gpu/loader/quant.py as_zero_point; Q4_0 and GPTQ keep their raw 0.5625 / 0.516 B/weight).
struct Scales {
    const void* scale;
    const void* offset;
    const float* scale_super;
    const float* offset_super;
    int bytes, block, zero;
    // weight k of row n (K weights a row): its scale s and offset o
    __device__ __forceinline__ void at(size_t n, int K, int k, float& s, float& o) const {
        s = plane_at(scale, scale_super, bytes, n, K, block, k);
        o = offset ? plane_at(offset, offset_super, bytes, n, K, block, k) : (float)-zero * s;
    }
};

// Each plane kind's 16-byte chunk c of row n (row: its first quant byte): which weights it
// holds and their values. chunk(row, c, scales, n, K, use) loads the chunk and calls use(k, w)
// once for each run of RUN weights k..k + RUN - 1 of it, with w their float32 values (the
// dequantize kernels; the mat-vec and the tiled GEMM read the same planes in units and tiles).
struct U4 {  // two runs of 16: the low nibbles (weights k_lo..) and the high ones (k_lo + 32..)
    using Q = unsigned char;
    static constexpr int WEIGHTS = 32, RUN = 16;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K / 2; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const unsigned char* row, int c, const Scales& sc, size_t n,
                                                 int K, Use use) {
        Chunk16 bits;
        bits.vector = *reinterpret_cast<const uint4*>(row + 16 * c);
        const int k_lo = 64 * (c >> 1) + 16 * (c & 1);
        float w[16];  // NOTE: one nibble half at a time: 16 weights live, not 32 (registers)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int k = k_lo + 32 * half;
            float s, o;
            sc.at(n, K, k, s, o);
            dequant16_u4(bits, half, s, o, w);
            use(k, w);
        }
    }
};

// u6 (gpu/loader/quant.py to_u6: Q6_K): the u4 nibble plane of v & 15, then the high bits v >> 4,
// 16 bytes a 64-weight group (byte i, bits 2j: weight 64 g + 16 j + i); the quant is v - 32.
__device__ __forceinline__ void dequant16_u6(const Chunk16& lo, const Chunk16& hi, int run, float s, float o,
                                             float* w) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int v = ((lo.u[i] >> (4 * (run >> 1))) & 15) | (((hi.u[i] >> (2 * run)) & 3) << 4);
        w[i] = s * (float)(v - 32) + o;  // NOTE: as the int8 plane's s * q + o: the same bits
    }
}

struct U6 {  // U4's chunks and runs, each with its high bits
    using Q = unsigned char;
    static constexpr int WEIGHTS = 32, RUN = 16;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K / 4 * 3; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const unsigned char* row, int c, const Scales& sc, size_t n,
                                                 int K, Use use) {
        Chunk16 lo, hi;
        lo.vector = *reinterpret_cast<const uint4*>(row + 16 * c);
        hi.vector = *reinterpret_cast<const uint4*>(row + K / 2 + 16 * (c >> 1));
        const int k_lo = 64 * (c >> 1) + 16 * (c & 1);
        float w[16];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int k = k_lo + 32 * half;
            float s, o;
            sc.at(n, K, k, s, o);
            dequant16_u6(lo, hi, (c & 1) + 2 * half, s, o, w);
            use(k, w);
        }
    }
};

struct I8 {  // one run of 16: weights 16c..16c + 15
    using Q = signed char;
    static constexpr int WEIGHTS = 16, RUN = 16;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const unsigned char* row, int c, const Scales& sc, size_t n,
                                                 int K, Use use) {
        Chunk16 bits;
        bits.vector = *reinterpret_cast<const uint4*>(row + 16 * c);
        const int k = 16 * c;
        float w[16], s, o;
        sc.at(n, K, k, s, o);
        dequant16_i8(bits, s, o, w);
        use(k, w);
    }
};

// The scales: unused (a bf16 weight is its own value; block may be 0), taken so that every
// kind has the launchers' one signature.
struct BF16 {  // one run of 8: weights 8c..8c + 7
    using Q = unsigned short;
    static constexpr int WEIGHTS = 8, RUN = 8;
    static __device__ __forceinline__ size_t row_bytes(int K) { return 2 * (size_t)K; }
    template <class Use>
    static __device__ __forceinline__ void chunk(const unsigned char* row, int c, const Scales&, size_t, int,
                                                 Use use) {
        Chunk16 bits;
        bits.vector = *reinterpret_cast<const uint4*>(row + 16 * c);
        float w[8];
        widen8_bf16(bits, w);
        use(8 * c, w);
    }
};

// Every kernel's weight arguments: the quants, then the Scales' fields (bf16: ignored).
#define WEIGHT_PARAMS(QT)                                                                          \
    const QT *__restrict__ q, const void *__restrict__ scale, const void *__restrict__ offset,     \
        const float *__restrict__ scale_super, const float *__restrict__ offset_super,             \
        int scale_bytes, int block, int zero
#define SCALES Scales{scale, offset, scale_super, offset_super, scale_bytes, block, zero}

// ---- matvec_<kind>_r<R>: decode (M <= R rows of x, R in 1, 2, 4, 8, 16), one launch a linear.
// Why this shape (the first device run, issue 29: one 16-byte load a lane per loop trip, scales
// re-read per 16 weights, x re-read from global by every row: 24-380 GB/s of the card's 4,268):
// - a lane's unit of work is 32 contiguous quant bytes of one row (two 16-byte loads, one 32-byte
//   sector: u4 64 weights, i8 32, bf16 16), and a warp computes MvRows rows at once (2 x 2
//   loads a trip at batch 1), and the next trip's loads (quants and raw scales) are issued
//   before this trip's math (Fetch below, double-buffered): 8 16-byte loads in flight a lane
//   at batch 1, 4 from 2 rows of x (where each load serves R rows);
// - scales are read once per group: a unit's two scale slots (u4: its low-nibble and high-nibble
//   32-weight groups; i8: its two 16-weight runs) and one super value, as raw bits; decoded
//   (plane_value) only when used, so no ALU op waits on a load in flight;
// - x is staged in shared memory once per block (a tile of MV_X_HALVES / R weights for each of
//   its rows, zero past K), padded 8 halves every 64 so that the lanes' 16-byte reads of
//   neighbouring units fall in different banks; every row of the warp reads it once;
// - a group's dot is s * sum(q x) + o * sum(x) (llama.cpp's mmvq does the same with the min):
//   one FMA a weight and x's sums shared by the warp's rows; quants become floats by the
//   exponent trick (2^23 + v, minus 2^23: exact, full-rate ops, not the quarter-rate I2F).
// Sums are float32; the order differs from dequantize-then-dot, within the same bound
// (tests/test_cuda_quant_host.py: (K + 2) 2^-23 sum |x| (|s q| + |o|)).
#define MV_WARPS 4
#define MV_X_HALVES 16384  // x staged a block: R rows x MV_X_HALVES / R weights (36 KB with padding)
#define MV_PAD(k) ((k) + ((k) >> 6) * 8)  // a staged row's half k: 8 halves of padding every 64

// Output rows a warp computes (launch.py matvec_rows_per_warp says the same): 2 at one row of x
// for the kinds of 2 chunks a unit, else 1: from 2 rows of x each weight load already serves R
// rows, and two weight rows' fetch buffers spilled with 2 x R accumulators (ptxas sm_90: u4 r2
// 252 bytes, r4 792) or with u6's 3 chunks and 4 scale slots (r1: 112).
template <class Kind, int R> struct MvRows { static constexpr int value = R == 1 && Kind::CHUNKS == 2 ? 2 : 1; };

// v (0 <= v < 2^23) as a float: exact, one OR and one FADD.
__device__ __forceinline__ float small_float(unsigned v) {
    return __uint_as_float(0x4B000000u | v) - 8388608.0f;
}

// A scale or offset plane's value `at` as raw bits (4: float32, 2: fp16, 1: int8 sign-extended):
// the load alone, decoded by plane_value once it has arrived.
__device__ __forceinline__ unsigned plane_raw(const void* __restrict__ plane, int bytes, size_t at) {
    if (bytes == 4) return static_cast<const unsigned*>(plane)[at];
    if (bytes == 2) return static_cast<const unsigned short*>(plane)[at];
    return (unsigned)(int)static_cast<const signed char*>(plane)[at];
}

__device__ __forceinline__ float plane_value(unsigned raw, int bytes, float super) {
    if (bytes == 4) return __uint_as_float(raw);
    if (bytes == 2) {
        return __half2float(__ushort_as_half((unsigned short)raw));
    }
    return (float)(int)raw * super;
}

// One unit of one row in flight: its quant chunks and the raw bits of its scale slots.
template <int CHUNKS, int SLOTS>
struct Fetch {
    Chunk16 bits[CHUNKS];
    unsigned s[SLOTS], o[SLOTS];
    float ss, os;  // the super plane values (int8 factors), else 1
};

// Each plane kind's unit: UNIT weights in CHUNKS 16-byte loads (u4, i8, bf16: 32 contiguous
// bytes; u6: u4's and 16 bytes of high bits); SLOTS scale slots of SLOT weights each; run r of
// RUNS (RUN weights each, starting at weight RUN r of the unit): its scale slot and its quants
// as floats.
struct MvU4 {  // runs: chunk 0 low, chunk 1 low (slot 0: weights 0-31), chunk 0 high, 1 high (slot 1)
    static constexpr int UNIT = 64, CHUNKS = 2, SLOTS = 2, SLOT = 32, RUNS = 4, RUN = 16;
    using F = Fetch<CHUNKS, SLOTS>;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K / 2; }
    static __device__ __forceinline__ bool scaled() { return true; }
    static __device__ __forceinline__ void load(const unsigned char* row, int K, int k, F& f) {
        const unsigned char* p = row + k / 2;
        f.bits[0].vector = *reinterpret_cast<const uint4*>(p);
        f.bits[1].vector = *reinterpret_cast<const uint4*>(p + 16);
    }
    static __device__ __forceinline__ void quants(const F& f, int run, float* q) {
        const Chunk16& c = f.bits[run & 1];
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = small_float((c.u[i] >> (4 * (run >> 1))) & 15);
    }
    static __device__ __forceinline__ int slot(int run) { return run >> 1; }
};
struct MvU6 {  // MvU4's runs, each its own 16-weight slot (Q6_K), the high bits a third chunk
    static constexpr int UNIT = 64, CHUNKS = 3, SLOTS = 4, SLOT = 16, RUNS = 4, RUN = 16;
    using F = Fetch<CHUNKS, SLOTS>;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K / 4 * 3; }
    static __device__ __forceinline__ bool scaled() { return true; }
    static __device__ __forceinline__ void load(const unsigned char* row, int K, int k, F& f) {
        const unsigned char* p = row + k / 2;
        f.bits[0].vector = *reinterpret_cast<const uint4*>(p);
        f.bits[1].vector = *reinterpret_cast<const uint4*>(p + 16);
        f.bits[2].vector = *reinterpret_cast<const uint4*>(row + K / 2 + k / 4);
    }
    static __device__ __forceinline__ void quants(const F& f, int run, float* q) {
        const Chunk16 &c = f.bits[run & 1], &h = f.bits[2];
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = small_float(((c.u[i] >> (4 * (run >> 1))) & 15) | (((h.u[i] >> (2 * run)) & 3) << 4)) - 32.0f;
    }
    static __device__ __forceinline__ int slot(int run) { return run; }
};
struct MvI8 {  // runs: chunk 0 (slot 0), chunk 1 (slot 1); the second chunk may be past K
    static constexpr int UNIT = 32, CHUNKS = 2, SLOTS = 2, SLOT = 16, RUNS = 2, RUN = 16;
    using F = Fetch<CHUNKS, SLOTS>;
    static __device__ __forceinline__ size_t row_bytes(int K) { return (size_t)K; }
    static __device__ __forceinline__ bool scaled() { return true; }
    static __device__ __forceinline__ void load(const unsigned char* row, int K, int k, F& f) {
        const unsigned char* p = row + k;
        f.bits[0].vector = *reinterpret_cast<const uint4*>(p);
        f.bits[1].vector = k + 16 < K ? *reinterpret_cast<const uint4*>(p + 16) : uint4{0u, 0u, 0u, 0u};
    }
    static __device__ __forceinline__ void quants(const F& f, int run, float* q) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = small_float(f.bits[run].u[i] ^ 0x80u) - 128.0f;
    }
    static __device__ __forceinline__ int slot(int run) { return run; }
};
struct MvBF16 {  // runs: chunk 0, chunk 1, 8 weights each (the second may be past K), no scales
    static constexpr int UNIT = 16, CHUNKS = 2, SLOTS = 2, SLOT = 8, RUNS = 2, RUN = 8;
    using F = Fetch<CHUNKS, SLOTS>;
    static __device__ __forceinline__ size_t row_bytes(int K) { return 2 * (size_t)K; }
    static __device__ __forceinline__ bool scaled() { return false; }
    static __device__ __forceinline__ void load(const unsigned char* row, int K, int k, F& f) {
        const unsigned char* p = row + 2 * (size_t)k;
        f.bits[0].vector = *reinterpret_cast<const uint4*>(p);
        f.bits[1].vector = k + 8 < K ? *reinterpret_cast<const uint4*>(p + 16) : uint4{0u, 0u, 0u, 0u};
    }
    static __device__ __forceinline__ void quants(const F& f, int run, float* q) { widen8_bf16(f.bits[run], q); }
    static __device__ __forceinline__ int slot(int run) { return run; }
};

// Row n's unit at weight k into f: the quant loads (Kind::load), then the raw scale loads of its
// slots (a slot past K, which i8 rows allow, reads nothing and weighs 0).
template <class Kind>
__device__ __forceinline__ void fetch_unit(const unsigned char* __restrict__ q, const Scales& sc, size_t n,
                                           int K, int k, typename Kind::F& f) {
    Kind::load(q + n * Kind::row_bytes(K), K, k, f);
    if (!Kind::scaled()) return;
    const size_t row = n * (size_t)(K / sc.block);
#pragma unroll
    for (int j = 0; j < Kind::SLOTS; ++j) {
        const int kj = k + Kind::SLOT * j;
        f.s[j] = kj < K ? plane_raw(sc.scale, sc.bytes, row + kj / sc.block) : 0u;
        f.o[j] = kj < K && sc.offset ? plane_raw(sc.offset, sc.bytes, row + kj / sc.block) : 0u;
    }
    f.ss = f.os = 1.0f;
    if (sc.bytes == 1) {
        const size_t at = n * (size_t)(K / QK_K) + k / QK_K;
        f.ss = sc.scale_super[at];
        f.os = sc.offset ? sc.offset_super[at] : 0.0f;
    }
}

// The block's tile of x: rows m < M, weights k0..k0 + width (width a whole number of units;
// zeros past K), into xs (row pitch MV_PAD(XK) halves), one 16-byte piece a thread at a time.
template <int R, class T>
__device__ __forceinline__ void stage_x(const T* __restrict__ x, int ldx, int M, int K, int k0, int width,
                                        uint4* xs) {
    constexpr int XK = MV_X_HALVES / R;
    const int pieces = width / 8;
    for (int i = threadIdx.x; i < M * pieces; i += MV_WARPS * 32) {
        const int m = i / pieces, k = 8 * (i - m * pieces);
        xs[(m * MV_PAD(XK) + MV_PAD(k)) / 8] = k0 + k < K
            ? *reinterpret_cast<const uint4*>(x + (size_t)m * ldx + k0 + k) : uint4{0u, 0u, 0u, 0u};
    }
}

// The math of one unit (weight k of the staged tile) of the warp's RPW rows f[r], against every
// row of x: acc[r][m] += sum over slots of s * sum(q x) + o * sum(x).
template <class Kind, int R, int RPW, class T>
__device__ __forceinline__ void unit_dot(const typename Kind::F (&f)[RPW], const uint4* xs, int k, int M,
                                         int bytes, int zero, float (&acc)[RPW][R]) {
    constexpr int XK = MV_X_HALVES / R, SLOTS = Kind::SLOTS;
    float s[RPW][SLOTS], o[RPW][SLOTS];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            s[r][j] = Kind::scaled() ? plane_value(f[r].s[j], bytes, f[r].ss) : 1.0f;
            o[r][j] = !Kind::scaled() ? 0.0f : zero ? (float)-zero * s[r][j] : plane_value(f[r].o[j], bytes, f[r].os);
        }
#pragma unroll
    for (int m = 0; m < R; ++m) {
        if (m >= M) break;
        float qx[RPW][SLOTS], sx[SLOTS];
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            sx[j] = 0.0f;
#pragma unroll
            for (int r = 0; r < RPW; ++r) qx[r][j] = 0.0f;
        }
#pragma unroll
        for (int run = 0; run < Kind::RUNS; ++run) {
            float xv[Kind::RUN], q[Kind::RUN];
            // PERF: 16-byte shared reads, conflict-free across a quarter warp (MV_PAD)
            const T* xp = reinterpret_cast<const T*>(xs) + m * MV_PAD(XK) + MV_PAD(k + Kind::RUN * run);
#pragma unroll
            for (int i = 0; i < Kind::RUN; i += 8) load_x8(xp + i, xv + i);  // a run never crosses a pad
            const int j = Kind::slot(run);
            if (Kind::scaled())
#pragma unroll
                for (int i = 0; i < Kind::RUN; ++i) sx[j] += xv[i];
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                Kind::quants(f[r], run, q);
#pragma unroll
                for (int i = 0; i < Kind::RUN; ++i) qx[r][j] += q[i] * xv[i];
            }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
            for (int j = 0; j < SLOTS; ++j) acc[r][m] += s[r][j] * qx[r][j] + o[r][j] * sx[j];
    }
}

// The block: MV_WARPS warps of RPW rows each (rows n0.. of out); x staged a tile at a time; a
// lane's units stride 32 through the tile, the next one fetched before this one's math.
template <class Kind, int R, class T>
__device__ __forceinline__ void matvec(
        const unsigned char* __restrict__ q, const Scales& scales, const T* __restrict__ x, int ldx,
        int M, int N, int K, T* __restrict__ out, int ldo) {
    constexpr int RPW = MvRows<Kind, R>::value, XK = MV_X_HALVES / R;
    __shared__ uint4 xs[R * MV_PAD(XK) / 8];
    const int lane = threadIdx.x & 31, n0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * RPW;
    float acc[RPW][R];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int m = 0; m < R; ++m) acc[r][m] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += XK) {
        const int width = min(XK, (K - k0 + Kind::UNIT - 1) / Kind::UNIT * Kind::UNIT);
        __syncthreads();  // every warp is done with the previous tile
        stage_x<R>(x, ldx, M, K, k0, width, xs);
        __syncthreads();
        if (n0 >= N) continue;  // NOTE: after the barriers: the whole block takes every one
        const int units = width / Kind::UNIT;
        typename Kind::F cur[RPW], next[RPW];
        const auto fetch = [&](int u, typename Kind::F (&f)[RPW]) {
#pragma unroll
            for (int r = 0; r < RPW; ++r)
                if (n0 + r < N) fetch_unit<Kind>(q, scales, n0 + r, K, k0 + Kind::UNIT * u, f[r]);
                else f[r] = typename Kind::F{};  // a row past N: zeros, never written
        };
        if (lane < units) fetch(lane, cur);
        for (int u = lane; u < units; u += 32) {
            if (u + 32 < units) fetch(u + 32, next);  // PERF: in flight during this unit's math
            unit_dot<Kind, R, RPW, T>(cur, xs, Kind::UNIT * u, M, scales.bytes, scales.zero, acc);
#pragma unroll
            for (int r = 0; r < RPW; ++r) cur[r] = next[r];
        }
    }
    if (n0 >= N) return;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        if (n0 + r >= N) break;  // the warp's: uniform
        write_rows<R>(acc[r], M, out, ldo, n0 + r);
    }
}

// matvec_<kind>_r<R> (fp16 x and out) and matvec_<kind>_r<R>_bf16 (bf16 x and out)
#define MATVEC_T(KIND, QT, R, T, SUFFIX)                                                           \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32, 4) matvec_##KIND##_r##R##SUFFIX(    \
            WEIGHT_PARAMS(QT), const T* __restrict__ x, int ldx, int M, int N, int K,               \
            T* __restrict__ out, int ldo) {                                                         \
        matvec<MV_##KIND, R, T>(reinterpret_cast<const unsigned char*>(q), SCALES, x, ldx, M, N, K, out, ldo); \
    }
#define MATVEC(KIND, QT, R) MATVEC_T(KIND, QT, R, __half, ) MATVEC_T(KIND, QT, R, __nv_bfloat16, _bf16)
using MV_u4 = MvU4;
using MV_u6 = MvU6;
using MV_i8 = MvI8;
using MV_bf16 = MvBF16;
using KIND_u4 = U4;
using KIND_u6 = U6;
using KIND_i8 = I8;
using KIND_bf16 = BF16;
MATVEC(u4, unsigned char, 1)
MATVEC(u4, unsigned char, 2)
MATVEC(u4, unsigned char, 4)
MATVEC(u4, unsigned char, 8)
MATVEC(u4, unsigned char, 16)
MATVEC(u6, unsigned char, 1)
MATVEC(u6, unsigned char, 2)
MATVEC(u6, unsigned char, 4)
MATVEC(u6, unsigned char, 8)
MATVEC(u6, unsigned char, 16)
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

// ---- gemm_<kind>: the large batch (M > MATVEC_MAX_ROWS) on tensor cores, the tiled option.
// out[M, N] = x[M, K] @ W[N, K]^T with W dequantized into shared memory a tile at a time, to
// exactly the values dequant_<kind>_{f16,bf16} writes (the activations' type), and fp32 accumulation by
// mma.sync.m16n8k16 (sm_80+). Why: dequant_* + cuBLAS writes and re-reads 4 bytes a weight
// (fp16 out, fp16 in) besides the quants; here each quant is read once per 64- or 128-row tile
// of x (from L2 after the first: the grid's x runs over M, so the M tiles of one weight tile
// are neighbours). No workspace: a CUDA graph captures it as it is.
// Block: 128 threads (4 warps, GEMM_WARPS), a 64 x 64 tile of out (gemm_*_m128: 256 threads, 128
// x 64), K in steps of 64 (one u4 group); warp w computes rows 32 (w >> 1).. and columns
// 32 (w & 1).. of it: 2 x 4 mma tiles of 16 x 8. The next K step's quants and x are loaded into registers before this step's mma
// (their global latency hides under the tensor-core work); a tail (rows past M, features past
// N, weights past K) is stored as zeros, so every mma is whole and only in-range outputs are
// written. K only needs whole 16-byte chunks: u4 K % 64, i8 K % 16, bf16 K % 8 (the planes').
#define GEMM_WARPS 4
#define GEMM_TILE 64                 // rows of x, output features and weights of K per step
#define GEMM_PITCH (GEMM_TILE / 2 + 4)  // 32-bit words a shared row: 64 halves + 8 of padding
// NOTE: with 36 words a row, the fragment loads (lane: word 36 g + t, g = lane >> 2,
// t = lane & 3) fall in 32 different banks: 4 g + t.

template <class T>
union Pack8 {  // 8 16-bit values, written as one 16-byte store into shared memory
    uint4 vector;
    T h[8];
};

#ifdef __CUDACC__
// c += a b for one 16 x 8 x 16 tile (fp16 in, or bf16 in: _bf16; fp32 accumulation), warp-collective; fragments
// in the PTX ISA's layout ("Matrix Fragments for mma.m16n8k16 with floating point type";
// g = lane >> 2, t = lane & 3):
//   a[0]: A[g][2t..2t+1], a[1]: A[g+8][2t..], a[2]: A[g][2t+8..], a[3]: A[g+8][2t+8..];
//   b[0]: B[2t..2t+1][g], b[1]: B[2t+8..2t+9][g];  c[0..1]: C[g][2t..2t+1], c[2..3]: C[g+8][2t..].
// The host shim (tests/cuda_host/cuda_host.h) has its own, same signature.
__device__ __forceinline__ void mma_m16n8k16(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_m16n8k16_bf16(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The mma of element type T (fp16 or bf16 fragments).
template <class T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
        mma_m16n8k16(a, b, c);
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
        mma_m16n8k16_bf16(a, b, c);
    }
};

// 8 floats in T (Elem<T>::from, as dequant_*_{f16,bf16} rounds them) into shared row `dst`.
template <class T>
__device__ __forceinline__ void store8(unsigned* dst, const float* w) {
    Pack8<T> p;
#pragma unroll
    for (int i = 0; i < 8; ++i) p.h[i] = Elem<T>::from(w[i]);
    *reinterpret_cast<uint4*>(dst) = p.vector;
}

__device__ __forceinline__ void store_zero8(unsigned* dst) {  // 8 zeros (fp16 and bf16 alike)
    *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u};
}

// One K step's weight tile: each thread fetches (global -> registers) its 16-byte chunks of
// quants and their scales, then puts them (dequantized, fp16) into w_tile[feature][k].
// u4: 64 features x 32 bytes (one group) = 128 chunks: one a thread, low and high nibbles.
template <class T>
struct TileU4 {
    Chunk16 bits;
    float s_lo, o_lo, s_hi, o_hi;
    bool valid;
    __device__ __forceinline__ void fetch(const unsigned char* __restrict__ q, const Scales& sc, int N, int K,
                                          int n0, int k0) {
        const int r = threadIdx.x >> 1, c = threadIdx.x & 1, n = n0 + r;
        valid = n < N;  // K % 64 == 0: every group is whole
        if (!valid) return;
        bits.vector = *reinterpret_cast<const uint4*>(q + (size_t)n * (K / 2) + k0 / 2 + 16 * c);
        const int k_lo = k0 + 16 * c;
        sc.at(n, K, k_lo, s_lo, o_lo);
        sc.at(n, K, k_lo + 32, s_hi, o_hi);
    }
    __device__ __forceinline__ void put(unsigned (*w_tile)[GEMM_PITCH]) const {
        const int r = threadIdx.x >> 1, c = threadIdx.x & 1;
        unsigned* lo = &w_tile[r][8 * c];  // weights 16c.. (words 8c..), high nibbles 32 + 16c..
        unsigned* hi = lo + 16;
        if (!valid) {
            store_zero8(lo), store_zero8(lo + 4), store_zero8(hi), store_zero8(hi + 4);
            return;
        }
        float w[16];
        dequant16_u4(bits, 0, s_lo, o_lo, w);
        store8<T>(lo, w), store8<T>(lo + 4, w + 8);
        dequant16_u4(bits, 1, s_hi, o_hi, w);
        store8<T>(hi, w), store8<T>(hi + 4, w + 8);
    }
};

// u6: TileU4's chunks, each with its 64-weight group's 16 bytes of high bits (the two threads of
// a feature load the same 16), and a scale slot of its own for each 16-weight run (Q6_K's).
template <class T>
struct TileU6 {
    Chunk16 lo, hi;
    float s_lo, o_lo, s_hi, o_hi;
    bool valid;
    __device__ __forceinline__ void fetch(const unsigned char* __restrict__ q, const Scales& sc, int N, int K,
                                          int n0, int k0) {
        const int r = threadIdx.x >> 1, c = threadIdx.x & 1, n = n0 + r;
        valid = n < N;  // K % 64 == 0: every group is whole
        if (!valid) return;
        const unsigned char* row = q + (size_t)n * (K / 4 * 3);
        lo.vector = *reinterpret_cast<const uint4*>(row + k0 / 2 + 16 * c);
        hi.vector = *reinterpret_cast<const uint4*>(row + K / 2 + k0 / 4);
        const int k_lo = k0 + 16 * c;
        sc.at(n, K, k_lo, s_lo, o_lo);
        sc.at(n, K, k_lo + 32, s_hi, o_hi);
    }
    __device__ __forceinline__ void put(unsigned (*w_tile)[GEMM_PITCH]) const {
        const int r = threadIdx.x >> 1, c = threadIdx.x & 1;
        unsigned* dlo = &w_tile[r][8 * c];  // weights 16c.. (runs c and 2 + c of the group)
        unsigned* dhi = dlo + 16;
        if (!valid) {
            store_zero8(dlo), store_zero8(dlo + 4), store_zero8(dhi), store_zero8(dhi + 4);
            return;
        }
        float w[16];
        dequant16_u6(lo, hi, c, s_lo, o_lo, w);
        store8<T>(dlo, w), store8<T>(dlo + 4, w + 8);
        dequant16_u6(lo, hi, 2 + c, s_hi, o_hi, w);
        store8<T>(dhi, w), store8<T>(dhi + 4, w + 8);
    }
};

// i8: 64 features x 64 bytes = 256 chunks of 16 weights: two a thread.
template <class T>
struct TileI8 {
    Chunk16 bits[2];
    float s[2], o[2];
    bool valid[2];
    __device__ __forceinline__ void fetch(const signed char* __restrict__ q, const Scales& sc, int N, int K,
                                          int n0, int k0) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int i = threadIdx.x + GEMM_WARPS * 32 * j, n = n0 + (i >> 2), k = k0 + 16 * (i & 3);
            valid[j] = n < N && k < K;
            if (!valid[j]) continue;
            bits[j].vector = *reinterpret_cast<const uint4*>(q + (size_t)n * K + k);
            sc.at(n, K, k, s[j], o[j]);
        }
    }
    __device__ __forceinline__ void put(unsigned (*w_tile)[GEMM_PITCH]) const {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int i = threadIdx.x + GEMM_WARPS * 32 * j;
            unsigned* dst = &w_tile[i >> 2][8 * (i & 3)];
            if (!valid[j]) {
                store_zero8(dst), store_zero8(dst + 4);
                continue;
            }
            float w[16];
            dequant16_i8(bits[j], s[j], o[j], w);
            store8<T>(dst, w), store8<T>(dst + 4, w + 8);
        }
    }
};

// bf16: 64 features x 128 bytes = 512 chunks of 8 weights: four a thread.
template <class T>
struct TileBF16 {
    Chunk16 bits[4];
    bool valid[4];
    __device__ __forceinline__ void fetch(const unsigned short* __restrict__ q, const Scales&, int N, int K,
                                          int n0, int k0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = threadIdx.x + GEMM_WARPS * 32 * j, n = n0 + (i >> 3), k = k0 + 8 * (i & 7);
            valid[j] = n < N && k < K;
            if (valid[j]) bits[j].vector = *reinterpret_cast<const uint4*>(q + (size_t)n * K + k);
        }
    }
    __device__ __forceinline__ void put(unsigned (*w_tile)[GEMM_PITCH]) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = threadIdx.x + GEMM_WARPS * 32 * j;
            unsigned* dst = &w_tile[i >> 3][4 * (i & 7)];
            if (!valid[j]) {
                store_zero8(dst);
                continue;
            }
            float w[8];
            widen8_bf16(bits[j], w);
            store8<T>(dst, w);
        }
    }
};

// One K step's x tile: ROWS (64 or 128) rows x 64 halves = 8 ROWS chunks of 8 (16 bytes; ldx % 8
// == 0): four a thread of the block's 2 ROWS, copied as they are.
template <int ROWS>
struct TileX {
    static constexpr int THREADS = 2 * ROWS;
    uint4 bits[4];
    template <class T>
    __device__ __forceinline__ void fetch(const T* __restrict__ x, int ldx, int M, int K, int m0, int k0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = threadIdx.x + THREADS * j, m = m0 + (i >> 3), k = k0 + 8 * (i & 7);
            bits[j] = m < M && k < K ? *reinterpret_cast<const uint4*>(x + (size_t)m * ldx + k)
                                     : uint4{0u, 0u, 0u, 0u};
        }
    }
    __device__ __forceinline__ void put(unsigned (*x_tile)[GEMM_PITCH]) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = threadIdx.x + THREADS * j;
            *reinterpret_cast<uint4*>(&x_tile[i >> 3][4 * (i & 7)]) = bits[j];
        }
    }
};

// ROWS rows of x a block (64: 4 warps; 128: 8 warps, gemm_*_m128), 64 output features: the
// weight tile is dequantized once for all ROWS rows (by the first GEMM_WARPS warps: the Tile*
// loaders' 128 threads), so a batch of up to ROWS rows streams each quant once and 128 rows
// halve the dequantize work and the weight's reads of a larger batch; each warp's 32 x 32
// corner, its registers, are the same in both.
template <class Tile, int ROWS, typename QT, class T>
__device__ __forceinline__ void gemm_tiles(
        const QT* __restrict__ q, const Scales& scales, const T* __restrict__ x, int ldx, int M, int N,
        int K, T* __restrict__ out, int ldo) {
    // NOTE: words, not halves: the fragments are 32-bit loads of two halves (k, k + 1)
    __shared__ unsigned x_tile[ROWS][GEMM_PITCH] __attribute__((aligned(16)));
    __shared__ unsigned w_tile[GEMM_TILE][GEMM_PITCH] __attribute__((aligned(16)));
    const int m0 = blockIdx.x * ROWS, n0 = blockIdx.y * GEMM_TILE;
    const bool loads_w = threadIdx.x < GEMM_WARPS * 32;  // warp-uniform: the first 4 warps
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = 32 * (warp >> 1), wn = 32 * (warp & 1);  // the warp's corner of the block tile
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    Tile wt;
    TileX<ROWS> xt;
    if (loads_w) wt.fetch(q, scales, N, K, n0, 0);
    xt.fetch(x, ldx, M, K, m0, 0);
    for (int k0 = 0; k0 < K; k0 += GEMM_TILE) {
        __syncthreads();  // every warp is done reading the previous step's tiles
        if (loads_w) wt.put(w_tile);
        xt.put(x_tile);
        __syncthreads();
        if (k0 + GEMM_TILE < K) {  // PERF: the next step's global loads in flight during the mma
            if (loads_w) wt.fetch(q, scales, N, K, n0, k0 + GEMM_TILE);
            xt.fetch(x, ldx, M, K, m0, k0 + GEMM_TILE);
        }
#pragma unroll
        for (int kk = 0; kk < GEMM_TILE / 2; kk += 8) {  // 16 halves = 8 words of k at a time
            unsigned a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const unsigned* lo = &x_tile[wm + 16 * i + g][kk + t];
                const unsigned* hi = lo + 8 * GEMM_PITCH;  // row g + 8
                a[i][0] = lo[0], a[i][1] = hi[0], a[i][2] = lo[4], a[i][3] = hi[4];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned* col = &w_tile[wn + 8 * j + g][kk + t];
                b[j][0] = col[0], b[j][1] = col[4];
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) Mma<T>::run(a[i], b[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + wm + 16 * i + g + 8 * (e >> 1), n = n0 + wn + 8 * j + 2 * t + (e & 1);
                if (m < M && n < N) out[(size_t)m * ldo + n] = Elem<T>::from(acc[i][j][e]);
            }
}

// gemm_<kind> (fp16 x and out, mma .f16) and gemm_<kind>_bf16 (bf16, mma .bf16), 64 rows a
// block; gemm_<kind>_m128[_bf16], 128 rows a block (8 warps; 2 blocks an SM keep 128 registers)
#define GEMM_T(KIND, QT, TILE, T, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMM_WARPS * 32, 4) gemm_##KIND##SUFFIX(          \
            WEIGHT_PARAMS(QT), const T* __restrict__ x, int ldx, int M, int N, int K,               \
            T* __restrict__ out, int ldo) {                                                         \
        gemm_tiles<TILE<T>, 64, QT, T>(q, SCALES, x, ldx, M, N, K, out, ldo);                      \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(2 * GEMM_WARPS * 32, 2) gemm_##KIND##_m128##SUFFIX( \
            WEIGHT_PARAMS(QT), const T* __restrict__ x, int ldx, int M, int N, int K,               \
            T* __restrict__ out, int ldo) {                                                         \
        gemm_tiles<TILE<T>, 128, QT, T>(q, SCALES, x, ldx, M, N, K, out, ldo);                     \
    }
#define GEMM(KIND, QT, TILE) GEMM_T(KIND, QT, TILE, __half, ) GEMM_T(KIND, QT, TILE, __nv_bfloat16, _bf16)
GEMM(u4, unsigned char, TileU4)
GEMM(u6, unsigned char, TileU6)
GEMM(i8, signed char, TileI8)
GEMM(bf16, unsigned short, TileBF16)

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Grid-stride over (row, chunk); each thread dequantizes one 16-byte chunk of quants.
// NOTE: bf16 into the fp16 workspace (a large batch's GEMM) is exact for |w| in [2^-14, 65504]
// (fp16 keeps 11 significant bits, bf16 8); smaller weights round to fp16 subnormals (an
// absolute error under 2^-25) and larger ones would overflow to inf: trained LLM weights sit
// far inside that range, and the fp16 store made the same narrowing of every bf16 weight
// before. The mat-vec (decode) reads the bf16 bits as they are.
template <class Kind, typename T>
__device__ __forceinline__ void dequant(
        const typename Kind::Q* __restrict__ q, const Scales& scales, int K, const int* __restrict__ ids,
        int row_begin, int nrows, T* __restrict__ out, int ldo) {
    const int chunks = K / Kind::WEIGHTS;
    const size_t total = (size_t)nrows * chunks;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / chunks), c = (int)(i - (size_t)r * chunks);
        const size_t src = ids ? (size_t)ids[r] : (size_t)(row_begin + r);
        const unsigned char* row = reinterpret_cast<const unsigned char*>(q) + src * Kind::row_bytes(K);
        T* o = out + (size_t)r * ldo;
        Kind::chunk(row, c, scales, src, K, [&](int k, const float* w) {
#pragma unroll
            for (int j = 0; j < Kind::RUN; ++j) put(o + k + j, w[j]);
        });
    }
}

#define DEQUANT(KIND, QT, T, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(256) dequant_##KIND##_##SUFFIX(                   \
            WEIGHT_PARAMS(QT), int K, const int* __restrict__ ids, int row_begin, int nrows,       \
            T* __restrict__ out, int ldo) {                                                        \
        dequant<KIND_##KIND, T>(q, SCALES, K, ids, row_begin, nrows, out, ldo);                    \
    }
DEQUANT(u4, unsigned char, __half, f16)
DEQUANT(u4, unsigned char, __nv_bfloat16, bf16)
DEQUANT(u4, unsigned char, float, f32)
DEQUANT(u6, unsigned char, __half, f16)
DEQUANT(u6, unsigned char, __nv_bfloat16, bf16)
DEQUANT(u6, unsigned char, float, f32)
DEQUANT(i8, signed char, __half, f16)
DEQUANT(i8, signed char, __nv_bfloat16, bf16)
DEQUANT(i8, signed char, float, f32)
DEQUANT(bf16, unsigned short, __half, f16)
DEQUANT(bf16, unsigned short, __nv_bfloat16, bf16)
DEQUANT(bf16, unsigned short, float, f32)
