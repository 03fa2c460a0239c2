// gpu/cuda/quant.cu on the host: one C entry point per kernel, dims = grid xyz then block xyz.
#include "cuda_host.h"
#include "quant.cu"  // the test's copy of toolchain.source("quant.cu"), found through -iquote

using cuda_host::launch;

// quant.cu's WEIGHT_PARAMS, as the kernels take them
#define HOST_WEIGHT(QT)                                                                                 \
    const QT *q, const void *scale, const void *offset, const float *scale_super,                       \
        const float *offset_super, int scale_bytes, int block, int zero
#define HOST_WEIGHT_ARGS q, scale, offset, scale_super, offset_super, scale_bytes, block, zero

#define HOST_MATVEC_T(KIND, QT, R, T, SUFFIX)                                                           \
    extern "C" int launch_matvec_##KIND##_r##R##SUFFIX(const unsigned* dims, HOST_WEIGHT(QT), const T* x, \
                                                       int ldx, int M, int N, int K, T* out, int ldo) {   \
        return launch(dims, MV_WARPS * 32, [=] {  /* its __launch_bounds__ */                            \
            matvec_##KIND##_r##R##SUFFIX(HOST_WEIGHT_ARGS, x, ldx, M, N, K, out, ldo);                   \
        });                                                                                              \
    }
// fp16 x and out (the plain names) and bf16 (_bf16)
#define HOST_MATVEC(KIND, QT, R) HOST_MATVEC_T(KIND, QT, R, __half, ) HOST_MATVEC_T(KIND, QT, R, __nv_bfloat16, _bf16)
HOST_MATVEC(u4, unsigned char, 1)
HOST_MATVEC(u4, unsigned char, 2)
HOST_MATVEC(u4, unsigned char, 4)
HOST_MATVEC(u4, unsigned char, 8)
HOST_MATVEC(u4, unsigned char, 16)
HOST_MATVEC(u6, unsigned char, 1)
HOST_MATVEC(u6, unsigned char, 2)
HOST_MATVEC(u6, unsigned char, 4)
HOST_MATVEC(u6, unsigned char, 8)
HOST_MATVEC(u6, unsigned char, 16)
HOST_MATVEC(i8, signed char, 1)
HOST_MATVEC(i8, signed char, 2)
HOST_MATVEC(i8, signed char, 4)
HOST_MATVEC(i8, signed char, 8)
HOST_MATVEC(i8, signed char, 16)
HOST_MATVEC(bf16, unsigned short, 1)
HOST_MATVEC(bf16, unsigned short, 2)
HOST_MATVEC(bf16, unsigned short, 4)
HOST_MATVEC(bf16, unsigned short, 8)
HOST_MATVEC(bf16, unsigned short, 16)

#define HOST_DEQUANT(KIND, QT, T, SUFFIX)                                                               \
    extern "C" int launch_dequant_##KIND##_##SUFFIX(const unsigned* dims, HOST_WEIGHT(QT), int K,        \
                                                    const int* ids, int row_begin, int nrows, T* out,    \
                                                    int ldo) {                                           \
        return launch(dims, 256, [=] {                                                                   \
            dequant_##KIND##_##SUFFIX(HOST_WEIGHT_ARGS, K, ids, row_begin, nrows, out, ldo);             \
        });                                                                                              \
    }
HOST_DEQUANT(u4, unsigned char, __half, f16)
HOST_DEQUANT(u4, unsigned char, __nv_bfloat16, bf16)
HOST_DEQUANT(u4, unsigned char, float, f32)
HOST_DEQUANT(u6, unsigned char, __half, f16)
HOST_DEQUANT(u6, unsigned char, __nv_bfloat16, bf16)
HOST_DEQUANT(u6, unsigned char, float, f32)
HOST_DEQUANT(i8, signed char, __half, f16)
HOST_DEQUANT(i8, signed char, __nv_bfloat16, bf16)
HOST_DEQUANT(i8, signed char, float, f32)
HOST_DEQUANT(bf16, unsigned short, __half, f16)
HOST_DEQUANT(bf16, unsigned short, __nv_bfloat16, bf16)
HOST_DEQUANT(bf16, unsigned short, float, f32)

#define HOST_GEMM_T(KIND, QT, T, SUFFIX)                                                                 \
    extern "C" int launch_gemm_##KIND##SUFFIX(const unsigned* dims, HOST_WEIGHT(QT), const T* x, int ldx, \
                                              int M, int N, int K, T* out, int ldo) {                     \
        return launch(dims, GEMM_WARPS * 32, [=] {  /* its __launch_bounds__ */                          \
            gemm_##KIND##SUFFIX(HOST_WEIGHT_ARGS, x, ldx, M, N, K, out, ldo);                            \
        });                                                                                              \
    }                                                                                                    \
    extern "C" int launch_gemm_##KIND##_m128##SUFFIX(const unsigned* dims, HOST_WEIGHT(QT), const T* x,  \
                                                     int ldx, int M, int N, int K, T* out, int ldo) {      \
        return launch(dims, 2 * GEMM_WARPS * 32, [=] {                                                   \
            gemm_##KIND##_m128##SUFFIX(HOST_WEIGHT_ARGS, x, ldx, M, N, K, out, ldo);                     \
        });                                                                                              \
    }
#define HOST_GEMM(KIND, QT) HOST_GEMM_T(KIND, QT, __half, ) HOST_GEMM_T(KIND, QT, __nv_bfloat16, _bf16)
HOST_GEMM(u4, unsigned char)
HOST_GEMM(u6, unsigned char)
HOST_GEMM(i8, signed char)
HOST_GEMM(bf16, unsigned short)
