// gpu/cuda/attention.cu on the host (compiled with the launcher's -DHEAD_DIM/-DGQA_GROUP): one C
// entry point per kernel, dims = grid xyz then block xyz.
#include "cuda_host.h"
#include "attention.cu"  // the test's copy of toolchain.source("attention.cu"), through -iquote

using cuda_host::launch;

extern "C" int launch_paged_attention(
        const unsigned* dims, const __half* qkv, int row_stride, const __half* k_cache, const __half* v_cache,
        const int* positions, const int* query_start_loc, const int* seq_lens, const int* block_tables,
        int max_blocks, int num_reqs, int num_kv_heads, int block_size, float scale, int partition_size,
        __half* out, float* part_acc, float* part_ml) {
    return launch(dims, WARPS * 32, [=] {  // its __launch_bounds__
        paged_attention(qkv, row_stride, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                        max_blocks, num_reqs, num_kv_heads, block_size, scale, partition_size, out, part_acc,
                        part_ml);
    });
}

extern "C" int launch_attention_reduce(const unsigned* dims, const float* part_acc, const float* part_ml,
                                       int splits, __half* out) {
    return launch(dims, 1024, [=] { attention_reduce(part_acc, part_ml, splits, out); });
}
