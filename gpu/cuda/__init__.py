"""The CUDA backend (docs/design.md §5 "cuda"): Numba CUDA kernels for the indexing-heavy steps,
CuPy RawKernels (CUDA C in .cu files beside their launchers) for the fused math, cuBLAS GEMMs
on the runner's own handle through nvmath-python (gpu/cuda/gemm.py), CUDA graphs for decode;
GGUF and AWQ/GPTQ weights kept packed (gpu/cuda/quant_linear.py, quant.cu).
Importing this package needs neither CuPy nor a GPU; only gpu/cuda/runner.py and the launchers
in gpu/cuda/fused.py, gpu/cuda/attention.py and gpu/cuda/quant.py do.
"""
