// Kernels that test the shim itself (tests/test_cuda_host.py): that __syncthreads() and warp
// shuffles synchronize the emulated threads, that shared memory a block did not write reads as
// NaN, and that a barrier some threads never reach is reported instead of hanging.
#include "cuda_host.h"

using cuda_host::launch;

// out[i] = the block's shared value written by thread (i + 1) % n, read after a barrier (or not).
__global__ void neighbour(float* out, int sync) {
    __shared__ float cell[1024];
    const int i = threadIdx.x, n = blockDim.x;
    cell[i] = (float)(blockIdx.x * n + i);
    if (sync) __syncthreads();
    out[blockIdx.x * n + i] = cell[(i + 1) % n];
}

// out[i] = the sum over the warp of lane values, by xor shuffles (each lane's own copy).
__global__ void warp_total(const float* x, float* out) {
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[threadIdx.x] = v;
}

// Threads below `split` (split < 32: part of warp 0) shuffle over the full warp while its other
// lanes wait in __syncthreads(): neither can complete, a hang on a device.
__global__ void divergent_barrier(float* out, int split) {
    float v = 1.0f;
    if ((int)threadIdx.x < split) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" int launch_neighbour(const unsigned* dims, float* out, int sync) {
    return launch(dims, 1024, [=] { neighbour(out, sync); });
}
extern "C" int launch_warp_total(const unsigned* dims, const float* x, float* out) {
    return launch(dims, 1024, [=] { warp_total(x, out); });
}
extern "C" int launch_divergent_barrier(const unsigned* dims, float* out, int split) {
    return launch(dims, 1024, [=] { divergent_barrier(out, split); });
}
