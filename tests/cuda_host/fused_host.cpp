// gpu/cuda/fused.cu on the host: one C entry point per kernel and element type (fp16: the plain
// names, bf16: _bf16), dims = grid xyz then block xyz.
#include "cuda_host.h"
#include "fused.cu"  // the test's copy of toolchain.source("fused.cu"), found through -iquote

using cuda_host::launch;

#define HOST_FUSED(T, SUFFIX)                                                                             \
    extern "C" int launch_add_rms_norm##SUFFIX(const unsigned* dims, float* h, const T* delta,            \
                                               const T* weight, T* out, int hidden, float eps) {          \
        /* 1024: its __launch_bounds__ */                                                                 \
        return launch(dims, 1024, [=] { add_rms_norm##SUFFIX(h, delta, weight, out, hidden, eps); });    \
    }                                                                                                     \
    extern "C" int launch_qk_norm##SUFFIX(const unsigned* dims, T* qkv, const T* weight, int num_q_heads,  \
                                          int head_dim, int row_stride, float eps) {                      \
        return launch(dims, 1024, [=] {                                                                   \
            qk_norm##SUFFIX(qkv, weight, num_q_heads, head_dim, row_stride, eps);                         \
        });                                                                                               \
    }                                                                                                     \
    extern "C" int launch_rope_store_kv##SUFFIX(const unsigned* dims, T* qkv, const int* positions,       \
                                                const int* slot_mapping, const float* cos_table,          \
                                                const float* sin_table, T* k_cache, T* v_cache,           \
                                                int num_heads, int num_kv_heads, int head_dim,            \
                                                int rot_half, int row_stride) {                           \
        return launch(dims, 1024, [=] {                                                                   \
            rope_store_kv##SUFFIX(qkv, positions, slot_mapping, cos_table, sin_table, k_cache, v_cache,   \
                                  num_heads, num_kv_heads, head_dim, rot_half, row_stride);               \
        });                                                                                               \
    }                                                                                                     \
    extern "C" int launch_silu_mul##SUFFIX(const unsigned* dims, const Elem<T>::Pair* gate_up,            \
                                           Elem<T>::Pair* out, int num_tokens, int inter2) {              \
        return launch(dims, 1024, [=] { silu_mul##SUFFIX(gate_up, out, num_tokens, inter2); });           \
    }                                                                                                     \
    extern "C" int launch_gelu_tanh_mul##SUFFIX(const unsigned* dims, const Elem<T>::Pair* gate_up,       \
                                                Elem<T>::Pair* out, int num_tokens, int inter2) {         \
        return launch(dims, 1024, [=] { gelu_tanh_mul##SUFFIX(gate_up, out, num_tokens, inter2); });      \
    }                                                                                                     \
    extern "C" int launch_rms_norm##SUFFIX(const unsigned* dims, T* x, const T* weight, int hidden,       \
                                           float eps) {                                                   \
        return launch(dims, 1024, [=] { rms_norm##SUFFIX(x, weight, hidden, eps); });                     \
    }                                                                                                     \
    extern "C" int launch_add_bias##SUFFIX(const unsigned* dims, T* x, const T* bias, int rows, int n) {  \
        return launch(dims, 1024, [=] { add_bias##SUFFIX(x, bias, rows, n); });                           \
    }                                                                                                     \
    extern "C" int launch_to_float32##SUFFIX(const unsigned* dims, const T* src, float* out, int rows,    \
                                             int cols) {                                                  \
        return launch(dims, 1024, [=] { to_float32##SUFFIX(src, out, rows, cols); });                     \
    }
HOST_FUSED(__half, )
HOST_FUSED(__nv_bfloat16, _bf16)
