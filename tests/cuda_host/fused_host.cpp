// gpu/cuda/fused.cu on the host: one C entry point per kernel, dims = grid xyz then block xyz.
#include "cuda_host.h"
#include "fused.cu"  // the test's copy of toolchain.source("fused.cu"), found through -iquote

using cuda_host::launch;

extern "C" int launch_add_rms_norm(const unsigned* dims, float* h, const __half* delta,
                                   const __half* weight, __half* out, int hidden, float eps) {
    return launch(dims, 1024, [=] { add_rms_norm(h, delta, weight, out, hidden, eps); });  // its __launch_bounds__
}

extern "C" int launch_rope(const unsigned* dims, __half* qkv, const int* positions, const float* cos_table,
                           const float* sin_table, int num_rot_heads, int head_dim, int row_stride) {
    return launch(dims, 1024, [=] { rope(qkv, positions, cos_table, sin_table, num_rot_heads, head_dim, row_stride); });
}

extern "C" int launch_silu_mul(const unsigned* dims, const __half2* gate_up, __half2* out, int num_tokens,
                               int inter2) {
    return launch(dims, 1024, [=] { silu_mul(gate_up, out, num_tokens, inter2); });
}
