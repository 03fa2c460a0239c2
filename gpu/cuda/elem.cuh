// The activations' element types, shared by fused.cu and attention.cu (toolchain.source pastes
// this file in place of its #include line, so NVRTC and the host build get one source text):
// fp16 (__half) and bf16 (__nv_bfloat16, bits in uint16 arrays on the Python side). A value to
// float32 (exact) and back (round to nearest even), and a pair of them for 32-bit loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
template <class T> struct Elem;
template <> struct Elem<__half> {
    using Pair = __half2;
    static __device__ __forceinline__ __half from(float x) { return __float2half(x); }
    static __device__ __forceinline__ __half2 pair(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Elem<__nv_bfloat16> {
    using Pair = __nv_bfloat162;
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16(x); }
    static __device__ __forceinline__ __nv_bfloat162 pair(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
