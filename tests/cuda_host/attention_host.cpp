// gpu/cuda/attention.cu on the host (compiled with the launcher's -DHEAD_DIM/-DGQA_GROUP): one C
// entry point per kernel and element type (fp16: the plain names, bf16: _bf16), dims = grid xyz
// then block xyz.
#include "cuda_host.h"
#include "attention.cu"  // the test's copy of toolchain.source("attention.cu"), through -iquote

using cuda_host::launch;

#define HOST_ATTENTION(T, SUFFIX)                                                                         \
    extern "C" int launch_paged_attention##SUFFIX(                                                        \
            const unsigned* dims, const T* qkv, int row_stride, const T* k_cache, const T* v_cache,       \
            const int* positions, const int* query_start_loc, const int* seq_lens, const int* block_tables, \
            int max_blocks, int num_reqs, int num_kv_heads, int block_size, float scale, int window,       \
            T* out, float* part_acc, float* part_ml, int* tickets) {                                      \
        return launch(dims, WARPS * 32, [=] { /* its __launch_bounds__ */                                 \
            paged_attention##SUFFIX(qkv, row_stride, k_cache, v_cache, positions, query_start_loc,        \
                                    seq_lens, block_tables, max_blocks, num_reqs, num_kv_heads,           \
                                    block_size, scale, window, out, part_acc, part_ml, tickets);          \
        });                                                                                               \
    }                                                                                                     \
    extern "C" int launch_paged_attention_rope##SUFFIX(                                                   \
            const unsigned* dims, const T* qkv, int row_stride, T* k_cache, T* v_cache,                   \
            const int* positions, const int* query_start_loc, const int* seq_lens, const int* block_tables, \
            int max_blocks, int num_reqs, int num_kv_heads, int block_size, float scale, int window,       \
            T* out, float* part_acc, float* part_ml, int* tickets, const int* slot_mapping,               \
            const float* cos_table, const float* sin_table, int rot_half) {                              \
        return launch(dims, WARPS * 32, [=] {                                                             \
            paged_attention_rope##SUFFIX(qkv, row_stride, k_cache, v_cache, positions, query_start_loc,   \
                                         seq_lens, block_tables, max_blocks, num_reqs, num_kv_heads,      \
                                         block_size, scale, window, out, part_acc, part_ml, tickets,      \
                                         slot_mapping, cos_table, sin_table, rot_half);                  \
        });                                                                                               \
    }
HOST_ATTENTION(__half, )
HOST_ATTENTION(__nv_bfloat16, _bf16)
