"""Compile checks without a GPU (docs/design.md §8.3): every Numba CUDA kernel to PTX and every CUDA
C kernel through NVRTC, for sm_80 (A100) and sm_90 (H100/H200), then ptxas -v on the PTX: no
spills, registers and shared memory within budget, no accidental float64.

NVRTC, NVVM and ptxas come from the wheels numba-cuda[cu12] pulls in (the `test` extra).
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from numba import cuda, types
from numba.cuda.dispatcher import CUDADispatcher

from ringserve.gpu.cuda import numba_kernels, sampling_kernels, toolchain

pytestmark = pytest.mark.compile

ARCHS = ["sm_80", "sm_90"]
MAX_REGISTERS = 128            # 4 blocks of 128 threads per SM stay resident
MAX_SHARED_BYTES = 48 * 1024   # static shared memory, no opt-in needed

f16_1d, f16_2d, f16_4d = (types.Array(types.float16, n, "C") for n in (1, 2, 4))
f32_1d, f32_2d = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "C")
i32_1d, i32_2d = types.Array(types.int32, 1, "C"), types.Array(types.int32, 2, "C")
u32_2d = types.Array(types.uint32, 2, "C")
u16_2d, u16_4d = types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 4, "C")  # bf16 bits
flag = types.boolean
NUMBA_MODULES = (numba_kernels, sampling_kernels)

# Every kernel with the signatures the runner launches it with (fp16, and bf16 bits in uint16,
# activations and cache).
NUMBA_SIGNATURES = {
    # gather_rows also serves the embedding (a 16-bit table -> fp32 rows: the residual stream)
    "gather_rows_kernel": [(f16_2d, i32_1d, f16_2d, flag), (f32_2d, i32_1d, f32_2d, flag),
                           (f16_2d, i32_1d, f32_2d, flag), (u16_2d, i32_1d, u16_2d, flag),
                           (u16_2d, i32_1d, f32_2d, flag)],
    "argmax_kernel": [(f32_2d, i32_1d), (f16_2d, i32_1d)],
    "paged_attention_kernel": [(f16_2d, f16_4d, f16_4d, i32_1d, i32_1d, i32_1d, i32_2d,
                                types.float32, types.int32, f16_2d, flag),
                               (u16_2d, u16_4d, u16_4d, i32_1d, i32_1d, i32_1d, i32_2d,
                                types.float32, types.int32, u16_2d, flag)],
    # sampling_kernels: float32 logits (the runner's fp32 logits buffer), 1024 threads per row
    "penalties_kernel": [(f32_2d, i32_1d, i32_1d, i32_1d, i32_1d, i32_1d, i32_1d, i32_1d,
                          f32_1d, f32_1d, f32_1d)],
    "sample_kernel": [(f32_2d, u32_2d, f32_1d, i32_1d, f32_1d, f32_1d, f32_1d, f32_2d, i32_1d, i32_1d, f32_1d,
                       i32_1d)],
    "logprobs_kernel": [(f32_2d, i32_1d, i32_2d, f32_2d, i32_1d)],
    "bitmask_kernel": [(f32_2d, i32_2d, i32_1d)],
}

# Each CUDA C source with the -D variants the runner compiles it with (Llama shapes:
# SmolLM2 64/3, Llama-3.2-1B 64/4, Llama-3-8B 128/4, Qwen2 128/7, 70B-style 128/8, 192/2, 256/1).
CUDA_C_VARIANTS = {
    "fused.cu": [{}],
    "quant.cu": [{}],  # every plane kind and row variant is its own extern "C" kernel
    "attention.cu": [dict(HEAD_DIM=d, GQA_GROUP=g)
                     for d, g in ((64, 3), (64, 4), (128, 4), (128, 7), (128, 8), (192, 2), (256, 1))],
}


# Kernels launched with more than 128 threads per block: registers x threads must fit the
# SM's 64K registers, or the launch fails ("too many resources requested").
LAUNCH_THREADS = {"sample_kernel": 1024, "logprobs_kernel": 1024, "penalties_kernel": 256,
                  "bitmask_kernel": 256}
REGISTERS_PER_SM = 65536


def _ptx(name: str, arch: str, defines: tuple = ()) -> str:
    """NVRTC's PTX of a source with -D defines (sorted items), once a process: quant.cu alone
    takes ~10 s a compile, and four tests read the same default build."""
    return _compiled(name, arch, defines)[0]


def _report(name: str, arch: str, defines: tuple = ()) -> dict:
    """ptxas -v's report of that PTX (read, never changed, by the tests)."""
    return _compiled(name, arch, defines)[1]


@functools.cache
def _compiled(name: str, arch: str, defines: tuple) -> tuple[str, dict]:
    ptx = toolchain.nvrtc_ptx(toolchain.source(name), arch, toolchain.options(dict(defines)), name)
    return ptx, toolchain.ptxas_report(ptx, arch)


@pytest.fixture(scope="module")
def compiled_sources() -> None:
    """Every CUDA C variant's compile (_compiled), on as many threads as there are cores: NVRTC
    releases the GIL, and quant.cu's ~10-17 s compiles for two architectures took the 2-core CI
    twice as long one after the other (ptxas is a process of its own)."""
    jobs = [(name, arch, tuple(sorted(d.items())))
            for name, variants in CUDA_C_VARIANTS.items() for d in variants for arch in ARCHS]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for _ in pool.map(lambda job: _compiled(*job), jobs):
            pass


def check_resources(report, where, threads=128):
    assert report, f"{where}: ptxas reported no kernel"
    for k in report.values():
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{where}: {k}"
        assert k.registers <= min(MAX_REGISTERS, REGISTERS_PER_SM // threads), f"{where}: {k}"
        assert k.shared_bytes <= MAX_SHARED_BYTES, f"{where}: {k}"


def _kernel(name):
    return next(getattr(m, name) for m in NUMBA_MODULES if hasattr(m, name))


def test_every_numba_kernel_has_signatures():
    kernels = {name for m in NUMBA_MODULES for name, obj in vars(m).items()
               if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")}
    assert kernels == set(NUMBA_SIGNATURES)


def test_kernels_launched_wide_carry_launch_bounds():
    """A kernel launched with more than 128 threads per block declares at least that many as
    its launch bounds: the PTX's .maxntid caps its registers at 65536 / bound on every
    compiler (ptxas -v here says what this ptxas does; the driver's JIT may choose more)."""
    for name, threads in LAUNCH_THREADS.items():
        bound = _kernel(name).targetoptions.get("launch_bounds")
        assert bound is not None and bound >= threads, f"{name}: launch_bounds {bound}, launched {threads}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(NUMBA_SIGNATURES))
def test_numba_kernel_compiles(name, arch):
    cc = (int(arch[3]), int(arch[4]))
    bounds = _kernel(name).targetoptions.get("launch_bounds")
    for sig in NUMBA_SIGNATURES[name]:
        ptx, _ = cuda.compile_ptx(_kernel(name).py_func, sig, cc=cc, launch_bounds=bounds)
        where = f"{name}{sig} {arch}"
        assert ".f64" not in ptx, f"{where}: float64 in the PTX"
        if bounds is not None:
            assert f".maxntid {bounds}" in ptx, f"{where}: no .maxntid in the PTX"
        check_resources(toolchain.ptxas_report(ptx, arch), where, LAUNCH_THREADS.get(name, 128))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(CUDA_C_VARIANTS))
def test_cuda_c_compiles_with_nvrtc(name, arch, compiled_sources):
    for defines in CUDA_C_VARIANTS[name]:
        items = tuple(sorted(defines.items()))
        where = f"{name} {defines} {arch}"
        assert ".f64" not in _ptx(name, arch, items), f"{where}: float64 in the PTX"
        report = _report(name, arch, items)
        check_resources(report, where)  # both element types' instantiations within budget
        if name != "quant.cu":  # fused.cu, attention.cu: every kernel in fp16 and in bf16 (_bf16)
            fp16 = {k for k in report if not k.endswith("_bf16")}
            assert set(report) == fp16 | {k + "_bf16" for k in fp16}, f"{where}: {sorted(report)}"


def test_fused_cu_defines_every_kernel_in_both_element_types(compiled_sources):
    """gpu/cuda/fused.py gets each kernel by name in fp16 (plain) and bf16 (_bf16); the bf16
    ones read and write bf16 (cvt.rn.bf16.f32: round to nearest even; widening is a shift)."""
    from ringserve.gpu.cuda.launch import FUSED_KERNELS, SUFFIXES
    ptx = _ptx("fused.cu", "sm_80")
    names = {k + s for k in FUSED_KERNELS for s in SUFFIXES.values()}
    assert set(_report("fused.cu", "sm_80")) == names
    bodies = {chunk.split("(", 1)[0].strip(): chunk for chunk in ptx.split(".entry ")[1:]}
    for name in ("add_rms_norm", "rope_store_kv", "silu_mul", "add_bias", "gelu_tanh_mul", "rms_norm"):
        assert ".bf16" in bodies[name + "_bf16"] and ".bf16" not in bodies[name], name


def test_quant_cu_defines_every_kernel_its_launcher_loads(compiled_sources):
    """gpu/cuda/quant.py gets each of quant_linear.KERNELS by name (a matvec per plane kind and
    row tile, a dequant per kind and output dtype): a kind without its kernels fails here, not
    at a GPU's first load."""
    from ringserve.gpu.cuda.quant_linear import KERNELS
    assert set(_report("quant.cu", "sm_90")) == set(KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_gemm_runs_on_tensor_cores(arch, compiled_sources):
    """quant.cu's gemm_* (the tiled large batch) issue mma.sync m16n8k16 with fp32 accumulation
    (the inline PTX behind #ifdef __CUDACC__, which NVRTC defines): 32 a K step of 64 (2 x 4
    tiles a warp, 4 k16 steps), unrolled; the other kernels none."""
    from ringserve.gpu.cuda.quant_linear import PLANE_KINDS
    bodies = {chunk.split("(", 1)[0].strip(): chunk for chunk in _ptx("quant.cu", arch).split(".entry ")[1:]}
    for suffix, t in (("", "f16"), ("_bf16", "bf16")):  # gemm_* fp16, gemm_*_bf16 bf16 fragments
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
        counts = {name: body.count(mma) for name, body in bodies.items()}
        want = {f"gemm_{k}{rows}{suffix}": 32 for k in PLANE_KINDS for rows in ("", "_m128")}
        assert {n: c for n, c in counts.items() if c} == want


def test_nvrtc_reports_errors():
    with pytest.raises(RuntimeError, match="HEAD_DIM"):
        toolchain.nvrtc_ptx(toolchain.source("attention.cu"), "sm_90", toolchain.options())


def test_ptxas_report_sees_spills():
    """The report parser is what the budget checks stand on: force a spill and see it."""
    src = toolchain.source("attention.cu").replace("__launch_bounds__(WARPS * 32, 4)",
                                                   "__launch_bounds__(WARPS * 32, 16)")
    ptx = toolchain.nvrtc_ptx(src, "sm_90", toolchain.options(dict(HEAD_DIM=128, GQA_GROUP=8)))
    k = toolchain.ptxas_report(ptx, "sm_90")["paged_attention"]
    assert k.spill_stores > 0 and k.registers <= 32


def test_nvrtc_writes_only_into_its_own_buffers():
    """NVRTC fills the buffer it is handed. Handed CPython's cached one-byte b" " (b" " * 1, an
    empty log), it turned every b" " of the process into b"\\0": safetensors headers written
    later were padded with NULs and refused. Compiling must leave the interpreter's constants."""
    space = bytes([32])
    toolchain.nvrtc_ptx('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "sm_80")
    assert b" " == space and b" " * 3 == bytes([32, 32, 32])
