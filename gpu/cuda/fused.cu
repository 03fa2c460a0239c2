// The layers' fused elementwise kernels (Llama's; Gemma 3's rms_norm and gelu_tanh_mul) (launchers: gpu/cuda/fused.py).
// 16-bit activations in and out, float32 math. Each kernel is one template over the element
// type T, instantiated as extern "C" kernels for fp16 (__half: the plain names) and bf16
// (__nv_bfloat16: the _bf16 names), so a launcher picks one by the arrays' dtype (float16, or
// bf16 bits in uint16) and nothing is mangled. Compiled at run time by NVRTC (through CuPy),
// which defines no INFINITY and no libc: only cuda_fp16.h and cuda_bf16.h are included (by
// elem.cuh: the element types' helpers, pasted in by toolchain.source).
#include "elem.cuh"

#define FULL_MASK 0xffffffffu

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the sum.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The residual step, one block per token: h += delta (h is the float32 residual stream; a
// null delta is the first layer's plain norm), then out = RMSNorm(h) * weight in T.
template <class T>
__device__ __forceinline__ void add_rms_norm_t(float* __restrict__ h, const T* __restrict__ delta,
                                               const T* __restrict__ weight, T* __restrict__ out, int hidden,
                                               float eps) {
    __shared__ float scratch[32];
    const size_t row = (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float x = h[row + i];
        if (delta != nullptr) {
            x += to_float(delta[row + i]);
            h[row + i] = x;
        }
        ss += x * x;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = Elem<T>::from(h[row + i] * r * to_float(weight[i]));
}

// Qwen3's q/k norm, in place on qkv [T, row_stride]: each of the num_q_heads q heads and the
// num_kv_heads k heads after them = RMSNorm(head) * weight (weight [2 head_dim]: q's, then k's).
// grid (T, q + kv heads), one warp per head: a head is at most 256 values, 8 a lane.
template <class T>
__device__ __forceinline__ void qk_norm_t(T* __restrict__ qkv, const T* __restrict__ weight, int num_q_heads,
                                          int head_dim, int row_stride, float eps) {
    const int head = blockIdx.y;
    T* x = qkv + (size_t)blockIdx.x * row_stride + (size_t)head * head_dim;
    const T* w = weight + (head < num_q_heads ? 0 : head_dim);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += 32) {
        const float v = to_float(x[i]);
        ss += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    const float r = rsqrtf(ss / (float)head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += 32)
        x[i] = Elem<T>::from(to_float(x[i]) * r * to_float(w[i]));
}

// RoPE and the KV-cache write in one pass (one launch where a rope kernel then a K/V scatter
// were two), one block per token: the q heads rotated in place in qkv [T, row_stride] (attention
// reads q there); the k heads rotated on their way into k_cache and the v heads copied into
// v_cache at the token's slot (caches [blocks, block_size, num_kv_heads, head_dim], flat by slot;
// slot -1, a graph's padding row, writes nothing). k and v in qkv are left as they are. HF
// rotate_half over the first 2 * rot_half dims of a head (element i pairs with i + rot_half; the
// rest, Phi-4-mini's last quarter, passes through); each rotated value rounded to T once, as the
// reference (gpu/cuda/reference.py rope, store_kv). cos/sin float32 [max_pos, rot_half].
template <class T>
__device__ __forceinline__ void rope_store_kv_t(T* __restrict__ qkv, const int* __restrict__ positions,
                                                const int* __restrict__ slot_mapping,
                                                const float* __restrict__ cos_table,
                                                const float* __restrict__ sin_table, T* __restrict__ k_cache,
                                                T* __restrict__ v_cache, int num_heads, int num_kv_heads,
                                                int head_dim, int rot_half, int row_stride) {
    const int t = blockIdx.x;
    const int slot = slot_mapping[t];
    T* row = qkv + (size_t)t * row_stride;
    const float* c = cos_table + (size_t)positions[t] * rot_half;
    const float* s = sin_table + (size_t)positions[t] * rot_half;
    for (int i = threadIdx.x; i < num_heads * rot_half; i += blockDim.x) {
        const int head = i / rot_half, j = i - head * rot_half;
        T* x = row + head * head_dim;
        const float x1 = to_float(x[j]), x2 = to_float(x[j + rot_half]);
        x[j] = Elem<T>::from(x1 * c[j] - x2 * s[j]);
        x[j + rot_half] = Elem<T>::from(x2 * c[j] + x1 * s[j]);
    }
    if (slot < 0) return;  // no __syncthreads below: a whole block leaves together
    const int kv = num_kv_heads * head_dim;
    const T* k = row + (size_t)num_heads * head_dim;
    const T* v = k + kv;
    T* k_out = k_cache + (size_t)slot * kv;
    T* v_out = v_cache + (size_t)slot * kv;
    for (int i = threadIdx.x; i < kv; i += blockDim.x) {
        const int d = i % head_dim;
        if (d < rot_half) {
            k_out[i] = Elem<T>::from(to_float(k[i]) * c[d] - to_float(k[i + rot_half]) * s[d]);
        } else if (d < 2 * rot_half) {
            const int j = d - rot_half;
            k_out[i] = Elem<T>::from(to_float(k[i]) * c[j] + to_float(k[i - rot_half]) * s[j]);
        } else {
            k_out[i] = k[i];
        }
        v_out[i] = v[i];
    }
}

// The gated MLPs' activations of the gate, float32 in and out.
struct Silu {
    __device__ __forceinline__ float operator()(float x) const { return x / (1.0f + __expf(-x)); }
};
// Gemma 3's: transformers' gelu_pytorch_tanh, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
struct GeluTanh {
    __device__ __forceinline__ float operator()(float x) const {
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    }
};

// out [T, I] = act(gate) * up from gate_up [T, 2I] (gate first). Grid-stride, pairs of T.
template <class T, class Act>
__device__ __forceinline__ void gated_mul_t(const typename Elem<T>::Pair* __restrict__ gate_up,
                                            typename Elem<T>::Pair* __restrict__ out, int num_tokens,
                                            int inter2) {  // inter2 = I / 2
    const Act act;
    const size_t n = (size_t)num_tokens * inter2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / inter2, j = i - t * inter2;
        const float2 g = to_float2(gate_up[t * 2 * inter2 + j]);
        const float2 u = to_float2(gate_up[t * 2 * inter2 + inter2 + j]);
        out[i] = Elem<T>::pair(act(g.x) * u.x, act(g.y) * u.y);
    }
}

// In place, one block per token: x [T, hidden] = RMSNorm(x) * weight (Gemma 3's norms of the
// attention and MLP outputs, before the residual add). Same launch as add_rms_norm_t.
template <class T>
__device__ __forceinline__ void rms_norm_t(T* __restrict__ x, const T* __restrict__ weight, int hidden,
                                           float eps) {
    __shared__ float scratch[32];
    const size_t row = (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(x[row + i]);
        ss += v * v;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        x[row + i] = Elem<T>::from(to_float(x[row + i]) * r * to_float(weight[i]));
}

// x [rows, n] += bias [n] (Qwen2's QKV bias), in float32, rounded once. Grid-stride.
template <class T>
__device__ __forceinline__ void add_bias_t(T* __restrict__ x, const T* __restrict__ bias, int rows, int n) {
    const size_t total = (size_t)rows * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = Elem<T>::from(to_float(x[i]) + to_float(bias[i % n]));
}

// out [rows, cols] float32 = src [rows, cols] (the logits), exactly. Grid-stride.
template <class T>
__device__ __forceinline__ void to_float32_t(const T* __restrict__ src, float* __restrict__ out, int rows,
                                             int cols) {
    const size_t count = (size_t)rows * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        out[i] = to_float(src[i]);
}

#define FUSED_KERNELS(T, SUFFIX)                                                                          \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm##SUFFIX(                              \
            float* __restrict__ h, const T* __restrict__ delta, const T* __restrict__ weight,            \
            T* __restrict__ out, int hidden, float eps) {                                                \
        add_rms_norm_t<T>(h, delta, weight, out, hidden, eps);                                           \
    }                                                                                                    \
    extern "C" __global__ void qk_norm##SUFFIX(T* __restrict__ qkv, const T* __restrict__ weight,         \
                                               int num_q_heads, int head_dim, int row_stride, float eps) { \
        qk_norm_t<T>(qkv, weight, num_q_heads, head_dim, row_stride, eps);                               \
    }                                                                                                    \
    extern "C" __global__ void rope_store_kv##SUFFIX(                                                    \
            T* __restrict__ qkv, const int* __restrict__ positions, const int* __restrict__ slot_mapping, \
            const float* __restrict__ cos_table, const float* __restrict__ sin_table,                    \
            T* __restrict__ k_cache, T* __restrict__ v_cache, int num_heads, int num_kv_heads,           \
            int head_dim, int rot_half, int row_stride) {                                                \
        rope_store_kv_t<T>(qkv, positions, slot_mapping, cos_table, sin_table, k_cache, v_cache,         \
                           num_heads, num_kv_heads, head_dim, rot_half, row_stride);                     \
    }                                                                                                    \
    extern "C" __global__ void silu_mul##SUFFIX(const Elem<T>::Pair* __restrict__ gate_up,                \
                                                Elem<T>::Pair* __restrict__ out, int num_tokens,          \
                                                int inter2) {                                             \
        gated_mul_t<T, Silu>(gate_up, out, num_tokens, inter2);                                           \
    }                                                                                                    \
    extern "C" __global__ void gelu_tanh_mul##SUFFIX(const Elem<T>::Pair* __restrict__ gate_up,           \
                                                     Elem<T>::Pair* __restrict__ out, int num_tokens,     \
                                                     int inter2) {                                        \
        gated_mul_t<T, GeluTanh>(gate_up, out, num_tokens, inter2);                                       \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm##SUFFIX(T* __restrict__ x,               \
                                                                        const T* __restrict__ weight,    \
                                                                        int hidden, float eps) {         \
        rms_norm_t<T>(x, weight, hidden, eps);                                                            \
    }                                                                                                    \
    extern "C" __global__ void add_bias##SUFFIX(T* __restrict__ x, const T* __restrict__ bias, int rows,  \
                                                int n) {                                                  \
        add_bias_t<T>(x, bias, rows, n);                                                                  \
    }                                                                                                    \
    extern "C" __global__ void to_float32##SUFFIX(const T* __restrict__ src, float* __restrict__ out,     \
                                                  int rows, int cols) {                                   \
        to_float32_t<T>(src, out, rows, cols);                                                            \
    }
FUSED_KERNELS(__half, )
FUSED_KERNELS(__nv_bfloat16, _bf16)
