// The shim's mma_m16n8k16 (bf16: mma_m16n8k16_bf16) on its own (tests/test_cuda_quant_host.py):
// one warp of 32 threads, the first `lanes` of them post the fragments given per lane (a: 4
// words, b: 2, c: 4 floats a lane) and write back their d; the others return first.
#include "cuda_host.h"

extern "C" int mma_warp(int lanes, int bf16, const unsigned* a, const unsigned* b, const float* c, float* d) {
    const unsigned dims[6] = {1, 1, 1, 32, 1, 1};
    return cuda_host::launch(dims, 32, [=] {
        const int lane = threadIdx.x;
        if (lane >= lanes) return;
        unsigned fa[4], fb[2];
        float fc[4];
        for (int i = 0; i < 4; ++i) fa[i] = a[4 * lane + i], fc[i] = c[4 * lane + i];
        for (int i = 0; i < 2; ++i) fb[i] = b[2 * lane + i];
        if (bf16)
            mma_m16n8k16_bf16(fa, fb, fc);
        else
            mma_m16n8k16(fa, fb, fc);
        for (int i = 0; i < 4; ++i) d[4 * lane + i] = fc[i];
    });
}
