"""The CPU backend: gpu/models/' definitions over numpy and Numba kernels (docs/design.md §5).

runner.py (``CpuModelRunner``) owns the weights and the paged KV cache and runs a step;
ops.py is the backend's ``ModelOps``, weight store and step buffers. The kernels: linear.py
(float weights), packed.py (how a packed fused linear is held) with quant_kernels.py (packed
weights, float32 math) and int8_kernels.py (int8 activations, AVX-512 VNNI), kernels.py
(RMSNorm, RoPE with the K/V write, SiLU-mul), attention.py (paged attention); kv_dtypes.py is
the KV cache's storage types and memory.py huge-page memory for weights and the KV pool."""
