// The Llama layer's fused elementwise kernels (launchers: gpu/cuda/fused.py).
// fp16 in and out, float32 math. Compiled at run time by NVRTC (through CuPy), which defines
// no INFINITY and no libc: only cuda_fp16.h is included.
#include <cuda_fp16.h>

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
// null delta is the first layer's plain norm), then out = RMSNorm(h) * weight in fp16.
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm(
        float* __restrict__ h, const __half* __restrict__ delta, const __half* __restrict__ weight,
        __half* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    const size_t row = (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float x = h[row + i];
        if (delta != nullptr) {
            x += __half2float(delta[row + i]);
            h[row + i] = x;
        }
        ss += x * x;
    }
    const float r = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = __float2half(h[row + i] * r * __half2float(weight[i]));
}

// RoPE in place on the q and k heads of qkv [T, row_stride] (HF rotate_half: element i pairs
// with i + head_dim/2). cos/sin tables float32 [max_pos, head_dim/2], indexed by position.
// grid (T), one thread per (head, pair).
extern "C" __global__ void rope(
        __half* __restrict__ qkv, const int* __restrict__ positions,
        const float* __restrict__ cos_table, const float* __restrict__ sin_table,
        int num_rot_heads, int head_dim, int row_stride) {
    const int t = blockIdx.x, half_dim = head_dim >> 1;
    const int p = positions[t];
    __half* row = qkv + (size_t)t * row_stride;
    for (int i = threadIdx.x; i < num_rot_heads * half_dim; i += blockDim.x) {
        const int head = i / half_dim, j = i - head * half_dim;
        const float c = cos_table[(size_t)p * half_dim + j], s = sin_table[(size_t)p * half_dim + j];
        __half* x = row + head * head_dim;
        const float x1 = __half2float(x[j]), x2 = __half2float(x[j + half_dim]);
        x[j] = __float2half(x1 * c - x2 * s);
        x[j + half_dim] = __float2half(x2 * c + x1 * s);
    }
}

// out [T, I] = silu(gate) * up from gate_up [T, 2I] (gate first). Grid-stride, half2 pairs.
extern "C" __global__ void silu_mul(const __half2* __restrict__ gate_up, __half2* __restrict__ out,
                                    int num_tokens, int inter2) {  // inter2 = I / 2
    const size_t n = (size_t)num_tokens * inter2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / inter2, j = i - t * inter2;
        const float2 g = __half22float2(gate_up[t * 2 * inter2 + j]);
        const float2 u = __half22float2(gate_up[t * 2 * inter2 + inter2 + j]);
        out[i] = __floats2half2_rn(g.x / (1.0f + __expf(-g.x)) * u.x, g.y / (1.0f + __expf(-g.y)) * u.y);
    }
}
