"""One command for a GPU machine: a preflight, the `gpu` tests, then a benchmark table.

    python -u -m ringserve.tools.gpu_check --out DIR [--skip-tests] [--skip-preflight] [--budget-s 360]

0. A ~30 s preflight (tools/gpu_preflight.py), each result printed as it comes: the imports
   (without a device too), the .cu kernels compile, one eager step of a tiny model, one
   captured cuBLAS GEMM replayed against numpy.
1. pytest -m gpu over tests/test_gpu_*.py (kernels vs references, graphs == eager, greedy == CPU
   backend, sampling, graphs replaying after CuPy's pools are emptied), in its own session: on
   timeout the whole process group is killed.
2. The device-to-device copy bandwidth (the yardstick), then paged-attention decode bandwidth:
   bytes of K/V one decode step reads, over its time, for the RawKernel and the Numba kernel.
3. Decode-step time at batch 1/16/64/256 for random-weight Llama shapes (~1B, ~8B; weights
   made on the GPU), the engine's step (forward + greedy sampling on the device, token ids
   to the host), eager vs CUDA graphs; transformers (torch) on the same shapes as the peer
   when it is installed. The dtype axis: the same weights served in bfloat16 (--dtype
   bfloat16: bf16 GEMMs, activations and KV cache), graphs, beside fp16, with the ratio of
   their step times (issue 25: bf16 within 5 % of fp16).
4. The quantized table (--table quant or all): the same shapes with weights kept packed
   (gpu/cuda/quant_linear.py; random planes made on the device) in Q4_K_M (llama.cpp's mix of
   Q4_K and Q6_K), Q8_0 and AWQ int4 (group 128), and BF16 on the 1B shape (a bfloat16
   checkpoint: the bytes of fp16, read by quant.cu), decode at batch 1/16/64/256, graphs and
   eager (one runner each: eager is its graphs set aside), tokens/s, % of the weight-streaming
   bound for the bytes a step actually reads, and the ratio to the fp16 rows (ours, graphs).
   `--table quant` runs the fp16 rows it compares with and skips attention and transformers.
   First in it, the quantized linear alone (8B MLP up and down, Q4_K, Q6_K, Q8_0 and AWQ, batch
   1/16/64/256): the mat-vec, the tiled GEMM and dequantize + cuBLAS, us, GB/s of the quant
   bytes, % of the d2d copy, TFLOP/s, the fastest per batch and the crossover table they imply
   (QuantLinear's MATVEC_MAX_ROWS and LARGE_BATCH).
The whole run fits --budget-s (6 minutes) by construction: every phase is timed and has its
own time limit (SIGALRM, never past the budget's deadline), a phase starts only if its
estimate fits in what is left (else it is skipped with a message, and the JSON says so), and
the loops inside a phase stop at the deadline. It always leaves a result: DIR/gpu_check.json
and DIR/gpu_check.txt (the tables) are written after every phase, so a run killed from outside
still has everything up to its last phase. Without a CUDA device it runs the import checks,
writes them, says so and exits 1.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits

SHAPES = {  # Llama-3.2-1B and Llama-3-8B
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}
BATCHES = (1, 16, 64, 256)
CONTEXT = 512  # tokens in the cache per request during the decode benchmark


def cuda_device_name() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        return None


def software_versions() -> dict[str, str]:
    """What the figures were measured with (CuPy wheel, Numba, CUDA runtime and driver, torch)."""
    import importlib.metadata as md

    import cupy
    rt = cupy.cuda.runtime
    out = {"cupy": cupy.__version__, "cuda_runtime": str(rt.runtimeGetVersion()),
           "cuda_driver": str(rt.driverGetVersion())}
    for dist in ("numpy", "numba", "numba-cuda", "torch", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def config_for(shape: dict):
    from ringserve.gpu.loader.config import ModelConfig
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return ModelConfig.from_dict(dict(shape, architectures=["LlamaForCausalLM"], head_dim=head_dim,
                                      rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=4096,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))


def random_weights(c, seed=0) -> dict:
    import cupy as cp
    rng = cp.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32) * 0.02).astype(cp.float16)

    out = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size), "lm_head.weight":
           w(c.vocab_size, c.hidden_size), "model.norm.weight": cp.ones(c.hidden_size, cp.float16)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": cp.ones(c.hidden_size, cp.float16),
                    p + "post_attention_layernorm.weight": cp.ones(c.hidden_size, cp.float16),
                    p + "self_attn.q_proj.weight": w(c.q_size, c.hidden_size),
                    p + "self_attn.k_proj.weight": w(c.kv_size, c.hidden_size),
                    p + "self_attn.v_proj.weight": w(c.kv_size, c.hidden_size),
                    p + "self_attn.o_proj.weight": w(c.hidden_size, c.q_size),
                    p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
                    p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
                    p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size)})
    return out


QUANT_FORMATS = ("Q4_K_M", "Q8_0", "AWQ", "BF16")
FOUR_BIT = ("Q4_K_M", "AWQ")
# Formats run on some shapes only: BF16 streams fp16's bytes, so its ratio to fp16 is the
# point and the 1B says it (the 8B's 16 GB runner would not fit the 6 minutes).
FORMAT_MODELS = {"BF16": ("1B",)}
# (kind, weights per scale, has an offset, quant range, scale form) of each type's planes as
# the CUDA store uploads them (gpu/loader/quant.py; QuantStore; Q6_K's quants the u6 plane):
# "super", int8 factors of float32 super planes (K-quants); "f16", exact halves (legacy types);
# "f32" (AWQ: its offsets are no halves); and the scale that gives weights of about 0.02 from
# random quants of that range
_PLANES = {"Q4_K": ("u4", 32, True, 16, "super"), "Q6_K": ("u6", 16, False, 64, "super"),
           "Q8_0": ("i8", 32, False, 256, "f16"), "AWQ": ("u4", 128, True, 16, "f32")}


def random_planes(xp, rng, qtype: str, rows: int, cols: int):
    """A QuantWeight of random planes of `qtype` made by xp's Generator rng (cupy: on the
    device), in the form QuantStore uploads (so nbytes is what a step reads)."""
    from ringserve.gpu.loader.quant import QK_K, QuantWeight
    if qtype == "BF16":  # bfloat16 bits of N(0, 0.02) (truncated: random is random)
        bits = (rng.standard_normal((rows, cols), dtype=xp.float32) * 0.02).view(xp.uint32) >> 16
        return QuantWeight(qtype, (rows, cols), "bf16", bits.astype(xp.uint16))
    kind, block, has_offset, levels, form = _PLANES[qtype]
    width = {"u4": cols // 2, "u6": cols // 4 * 3}.get(kind, cols)  # u6: nibbles, then 2-bit highs
    q = rng.integers(0, 256, size=(rows, width), dtype=xp.int32).astype(xp.uint8)
    if kind == "i8":
        q = q.view(xp.int8)
    s = 0.04 / levels
    if form == "super":  # factors 32..63 of supers about s / 48: scales about s, as llama.cpp's
        factors = rng.integers(32, 64, size=(rows, cols // block), dtype=xp.int32).astype(xp.int8)
        d = (rng.random((rows, cols // QK_K), dtype=xp.float32) * s + s / 2) / 48
        if not has_offset:
            return QuantWeight(qtype, (rows, cols), kind, q, factors, None, block, d)
        minus = (-(levels // 2) * d).astype(xp.float32)  # offset = factor * -(levels / 2) d: centred
        return QuantWeight(qtype, (rows, cols), kind, q, factors, factors.copy(), block, d, minus)
    scale = (rng.random((rows, cols // block), dtype=xp.float32) * s + s / 2).astype(xp.float32)
    # AWQ's zero points vary (0..15), so its offsets -z s stay a plane (all 8 would be GPTQ's form)
    zeros = rng.integers(0, levels, size=scale.shape, dtype=xp.int32).astype(xp.float32)
    offset = (-zeros * scale).astype(xp.float32) if has_offset else None
    if form == "f16":
        scale, offset = scale.astype(xp.float16), None if offset is None else offset.astype(xp.float16)
    return QuantWeight(qtype, (rows, cols), kind, q, scale, offset, block)


def quant_type(fmt: str, name: str, layer: int, num_layers: int) -> str:
    """The type a linear has in `fmt` (Q4_K_M: llama.cpp's, tools/random_gguf.py tensor_type)."""
    from ringserve.tools.random_gguf import _more_bits
    if fmt != "Q4_K_M":
        return fmt
    if name == "lm_head":
        return "Q6_K"
    more = name in ("self_attn.v_proj", "mlp.down_proj") and _more_bits(layer, num_layers)
    return "Q6_K" if more else "Q4_K"


def random_quant_weights(c, fmt: str, xp, seed: int = 0) -> dict:
    """HF names -> weights of `fmt`, made by xp (cupy: on the device): linears (and the GGUF
    formats' embedding and lm_head) as QuantWeight planes, norms fp16 ones; AWQ keeps the
    embedding and lm_head fp16."""
    rng = xp.random.default_rng(seed)

    def fp16(*shape):
        return (rng.standard_normal(shape, dtype=xp.float32) * 0.02).astype(xp.float16)

    def linear(name: str, layer: int, rows: int, cols: int):
        return random_planes(xp, rng, quant_type(fmt, name, layer, c.num_hidden_layers), rows, cols)

    shapes = {"self_attn.q_proj": (c.q_size, c.hidden_size), "self_attn.k_proj": (c.kv_size, c.hidden_size),
              "self_attn.v_proj": (c.kv_size, c.hidden_size), "self_attn.o_proj": (c.hidden_size, c.q_size),
              "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
              "mlp.up_proj": (c.intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    table = (c.vocab_size, c.hidden_size)
    gguf = fmt != "AWQ"
    out = {"model.embed_tokens.weight": linear("embed", 0, *table) if gguf else fp16(*table),
           "model.norm.weight": xp.ones(c.hidden_size, xp.float16)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = linear("lm_head", 0, *table) if gguf else fp16(*table)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = xp.ones(c.hidden_size, xp.float16)
        out[p + "post_attention_layernorm.weight"] = xp.ones(c.hidden_size, xp.float16)
        for name, shape in shapes.items():
            out[p + name + ".weight"] = linear(name, i, *shape)
    return out


def streamed_bytes(weights) -> int:
    """Bytes one decode step reads: every linear and norm once, the lm_head once; of an untied
    embedding table only B rows (left out)."""
    from ringserve.gpu.models.ops import storage
    seen: set[int] = set()
    total = 0
    for w in (weights.lm_head, weights.final_norm,  # NOTE: a tied lm_head is the table: read whole
              *(getattr(layer, f) for layer in weights.layers
                for f in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"))):
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            total += sum(n for _, n in storage(w))
    return total


def decode_batch(B: int, block_size: int, context: int = CONTEXT):
    """B decodes, each with `context` tokens in the cache (its own blocks) and one new."""
    import numpy as np

    from ringserve.gpu.batch import Batch
    nb = -(-(context + 1) // block_size)
    tables = np.arange(B * nb, dtype=np.int32).reshape(B, nb)
    pos = np.full(B, context, np.int32)
    return Batch(np.ones(B, np.int32), pos, tables[:, context // block_size] * block_size
                 + context % block_size, np.arange(B + 1, dtype=np.int32),
                 np.full(B, context + 1, np.int32), tables)


def census_fields(runner, B: int, dtype: str) -> dict:
    """The launch census of the step a graph of B requests replays (tools/step_census.py, from
    the runner's launch plan): launches per layer and the bytes it must move, for the floor."""
    from ringserve.gpu.cuda.census import census_for
    census = census_for(runner.config, batch=B, context=CONTEXT + 1, dtype=dtype,
                        max_model_len=runner.max_model_len, num_sms=runner.num_sms)
    return dict(launches_per_layer=census.per_layer, step_bytes=census.total().total)


def floor_pct(row: dict, copy_GBps: float | None) -> float:
    """A step's share of its census floor: every byte the census lists moved once at the
    measured copy bandwidth, over the step's time, in %."""
    if "step_bytes" not in row or not copy_GBps:
        return float("nan")
    return row["step_bytes"] / (copy_GBps * 1e9) * 1e3 / row["step_ms"] * 100


def time_steps(fn, n=20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


class PhaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """PhaseTimeout raised in the main thread after `seconds` (at the next Python bytecode: a
    kernel or a sync in C finishes first). Not nested; main thread only (SIGALRM)."""
    def on_alarm(signum, frame):
        raise PhaseTimeout(f"past its {seconds:.0f} s limit")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Budget:
    """The run's deadline: phases are timed, each runs under its own time limit (never past
    the deadline), a phase whose estimate does not fit in what is left is skipped with a
    message instead of run, and after each phase `after()` runs (gpu_check writes its
    result files there)."""

    def __init__(self, seconds: float, clock=time.monotonic, after: Callable[[], None] = lambda: None):
        self.clock = clock
        self.deadline = clock() + seconds
        self.after = after
        self.phases: dict[str, float] = {}   # name -> seconds it took
        self.skipped: list[str] = []
        self.errors: dict[str, str] = {}     # name -> the exception that ended it

    def left(self) -> float:
        return self.deadline - self.clock()

    def run(self, name: str, estimate_s: float, fn, limit_s: float | None = None):
        """fn() if estimate_s fits in what is left (its result), else None and a message; a
        phase that raises or passes min(limit_s, what is left) is reported (traceback,
        .errors) and gives None."""
        left = self.left()
        if left < estimate_s:
            msg = f"{name}: skipped ({left:.0f} s left of the budget, it needs ~{estimate_s:.0f} s)"
            self.skipped.append(msg)
            print(f"gpu_check: {msg}", file=sys.stderr, flush=True)
            self.after()
            return None
        print(f"gpu_check: {name} ({left:.0f} s left)", flush=True)
        t = self.clock()
        try:
            with time_limit(min(limit_s if limit_s is not None else left, left)):
                return fn()
        except Exception as e:  # one broken phase must not cost the others' figures
            traceback.print_exc()
            self.errors[name] = f"{type(e).__name__}: {e}"
            print(f"gpu_check: {name} failed: {self.errors[name]}", file=sys.stderr, flush=True)
            return None
        finally:
            self.phases[name] = self.clock() - t
            self.after()


def gpu_time(fn, stream, n=20, graph=False) -> float:
    """Seconds per call of fn (which enqueues work on stream), by CUDA events. graph: the n
    calls are captured into one CUDA graph first, so that host launch gaps (~5-50 us, more
    than a short kernel) are not counted."""
    import cupy as cp
    fn()
    launch, reps = (lambda: [fn() for _ in range(n)]), n
    if graph:
        stream.synchronize()
        stream.begin_capture()
        launch()
        g = stream.end_capture()
        launch, reps = (lambda: [g.launch(stream) for _ in range(3)]), 3 * n
        launch()  # the first replay uploads the graph
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    launch()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def free_device_memory() -> None:
    """Everything no longer referenced goes back to the driver: cycles collected first (a
    runner's bound methods and closures hold its arrays), the device idle, then both of CuPy's
    pools emptied. Between cases and phases, so that each measures from an empty pool."""
    import gc

    import cupy as cp
    gc.collect()
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting the read and the write."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # NOTE: made and filled on the stream that copies them (no null-stream race)
        a = cp.ones(1 << 30, cp.uint8)
        b = cp.empty_like(a)
    try:
        return 2 * a.nbytes / gpu_time(lambda: cp.cuda.runtime.memcpyAsync(
            b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr), stream, 10)
    finally:
        a = b = None  # the closure's cells too
        free_device_memory()


ATTN_SHAPE = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)  # Llama-3-8B
ATTN_CASES = [(B, ctx) for ctx in (1024, 8192) for B in (1, 16, 64, 256)]


def bench_attention(rows, copy_bps, deadline) -> None:
    """One decode step of paged attention (one layer): K/V bytes read over its time, for the
    RawKernel (with the runner's split-K choice) and the Numba kernel; the block tables point
    at shuffled blocks, as a long-running pool's do. Each case's arrays live in
    attention_case alone and are freed (free_device_memory) before the next is made."""
    import cupy as cp

    from ringserve.gpu.cuda.attention import PagedAttention
    H, KVH, D = (ATTN_SHAPE[k] for k in ("num_heads", "num_kv_heads", "head_dim"))
    attn = PagedAttention(D, H // KVH)
    num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    stream = cp.cuda.Stream(non_blocking=True)
    for B, ctx in ATTN_CASES:
        if time.monotonic() > deadline:
            print("gpu_check: attention benchmark stopped at the deadline", file=sys.stderr)
            return
        try:
            rows.extend(attention_case(attn, B, ctx, num_sms, copy_bps, stream))
        finally:
            free_device_memory()


def attention_case(attn, B: int, ctx: int, num_sms: int, copy_bps: float, stream) -> list[dict]:
    """One (batch, context) case of bench_attention: every array is made and filled on the
    stream that then reads it (CuPy's `with stream`), so the kernels never see a block table
    or K/V still being written on another stream (issue 25: an illegal address at B=16,
    context 8192, when they were made on the legacy default stream)."""
    import cupy as cp
    from numba import cuda as nb_cuda

    from ringserve.gpu.cuda import plan
    H, KVH, D, BS = (ATTN_SHAPE[k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size"))
    per_req = -(-ctx // BS)
    splits = plan.attention_splits(num_tokens=B, num_kv_heads=KVH, max_seq_len=ctx, num_sms=num_sms)
    with stream:
        k = cp.full((B * per_req, BS, KVH, D), 0.01, cp.float16)
        v = cp.full_like(k, 0.02)
        tables = cp.random.permutation(B * per_req).astype(cp.int32).reshape(B, per_req)
        qkv = cp.full((B, (H + 2 * KVH) * D), 0.1, cp.float16)
        positions = cp.full(B, ctx - 1, cp.int32)
        qsl = cp.arange(B + 1, dtype=cp.int32)
        seq_lens = cp.full(B, ctx, cp.int32)
        out = cp.empty((B, H * D), cp.float16)
        ws = attn.workspace(B, H, splits)
    kv_bytes = 2 * B * ctx * KVH * D * 2   # K and V, fp16
    kernels = _attention_kernels(attn, (qkv, k, v, positions, qsl, seq_lens, tables), D ** -0.5, out,
                                 stream, nb_cuda.external_stream(stream.ptr),
                                 splits=splits, workspace=ws)
    rows = []
    for name, fn in kernels.items():
        dt = gpu_time(fn, stream, 10, graph=True)
        rows.append(dict(kernel=name, batch=B, context=ctx, splits=splits if name == "rawkernel" else 1,
                         us=dt * 1e6, GBps=kv_bytes / dt / 1e9, pct_copy=kv_bytes / dt / copy_bps * 100))
    stream.synchronize()
    return rows


def _attention_kernels(attn, args, scale, out, stream, nb_stream, **raw_kwargs) -> dict:
    """The two attention backends as calls on one step's arrays (as gpu/cuda/runner.py makes them)."""
    from numba import cuda as nb_cuda

    from ringserve.gpu.cuda import numba_kernels as nk

    def numba() -> None:
        q, k, v, positions, qsl, seq_lens, tables = (nb_cuda.as_cuda_array(a, sync=False) for a in args)
        nk.paged_attention(q, k, v, positions, qsl, seq_lens, tables, scale,
                           nb_cuda.as_cuda_array(out, sync=False), stream=nb_stream)
    return {"rawkernel": lambda: attn(*args, scale, out, stream, **raw_kwargs), "numba": numba}


def greedy_metadata(B: int):
    import numpy as np

    from ringserve.gpu.sampling.sampler import SamplingMetadata
    return SamplingMetadata(np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32),
                            np.zeros(B, np.float32), [None] * B)


def bench_ours(name, shape, rows, deadline, dtype: str = "float16") -> None:
    """Decode steps of a random-weight `shape` served in `dtype`: float16 eager and graphs;
    bfloat16 graphs only (its rows sit beside fp16's: the eager ratio is fp16's)."""
    import cupy as cp
    import numpy as np

    from ringserve.gpu.cuda.runner import CudaModelRunner
    c = config_for(shape)
    w = random_weights(c)  # fp16 on the device; a bf16 runner rounds them to bf16 there
    # NOTE: made on the legacy default stream, which the runner's non-blocking stream does not
    # wait for, and the runner reads them at once (LlamaWeights.fuse): finished first
    cp.cuda.Device().synchronize()
    weight_bytes = sum(int(x.nbytes) for x in w.values())  # the same 2 bytes a weight in bf16
    nb_needed = max(BATCHES) * (-(-(CONTEXT + 1) // 16))
    r = None
    try:
        for eager in ((True, False) if dtype == "float16" else (False,)):
            if time.monotonic() > deadline:
                return
            r = None  # the previous runner's memory goes before the next one is built
            free_device_memory()
            r = CudaModelRunner(c, w, DeviceConfig(device="cuda", enforce_eager=eager, dtype=dtype),
                                CacheConfig(num_gpu_blocks_override=nb_needed),
                                StepLimits(max_num_seqs=max(BATCHES), max_model_len=2048,
                                           max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS))
            for B in BATCHES:
                if time.monotonic() > deadline:
                    print(f"gpu_check: {name} benchmark stopped at the deadline", file=sys.stderr)
                    break
                b, rows_, meta = decode_batch(B, 16), np.arange(B), greedy_metadata(B)
                # What the engine runs per step: the forward and sampling on the device, B token
                # ids back to the host (execute() would copy B x V float32 logits instead).
                dt = time_steps(partial(_decode_step, r, b, rows_, meta))
                # replayed: False where this size's capture failed and the step ran eager
                rows.append(dict(model=name, impl="ringserve " + ("eager" if eager else "graphs"),
                                 dtype=dtype, batch=B, step_ms=dt * 1e3, tok_s=B / dt,
                                 weight_bytes=weight_bytes,
                                 replayed=not eager and r.graphs.pick(b) is not None,
                                 **({} if eager else census_fields(r, B, dtype))))
    finally:  # the next phase (torch: its own pool) gets the memory, whatever happened here
        r = None
        w.clear()
        free_device_memory()


def _decode_step(runner, batch, rows, meta) -> None:
    runner.submit(batch, rows, meta).result()


def bench_quant(name, shape, rows, deadline) -> None:
    """Each format of QUANT_FORMATS on one runner with graphs: graphs at each batch, then eager
    (the runner's graph table set aside: every step then runs eagerly, as with --enforce-eager,
    without building and capturing a second runner)."""
    import cupy as cp
    import numpy as np

    from ringserve.gpu.cuda import plan
    from ringserve.gpu.cuda.runner import CudaModelRunner
    c = config_for(shape)
    nb_needed = max(BATCHES) * (-(-(CONTEXT + 1) // 16))
    for fmt in QUANT_FORMATS:
        if time.monotonic() > deadline:
            return
        if name not in FORMAT_MODELS.get(fmt, (name,)):
            continue
        r = w = None
        try:
            free_device_memory()
            w = random_quant_weights(c, fmt, cp)
            cp.cuda.Device().synchronize()  # NOTE: as in bench_ours: finished before the runner reads them
            r = CudaModelRunner(c, w, DeviceConfig(device="cuda"),
                                CacheConfig(num_gpu_blocks_override=nb_needed),
                                StepLimits(max_num_seqs=max(BATCHES), max_model_len=2048,
                                           max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS))
            w = None  # the runner holds the planes (stacked: the per-tensor ones can go)
            read = streamed_bytes(r.weights)
            graphs = r.graphs
            for mode in ("graphs", "eager"):
                r.graphs = graphs if mode == "graphs" else plan.GraphTable([])
                for B in BATCHES:
                    if time.monotonic() > deadline:
                        print(f"gpu_check: quant {name} stopped at the deadline", file=sys.stderr)
                        return
                    b, rows_, meta = decode_batch(B, 16), np.arange(B), greedy_metadata(B)
                    dt = time_steps(partial(_decode_step, r, b, rows_, meta))
                    rows.append(dict(model=name, format=fmt, impl=mode, batch=B, step_ms=dt * 1e3,
                                     tok_s=B / dt, weight_bytes=read,
                                     replayed=mode == "eager" or r.graphs.pick(b) is not None))
        finally:
            r = w = None
            graphs = plan.GraphTable([])  # the old table (and the runner its closures hold) goes too
            free_device_memory()


# The quantized linear alone (the crossover table, gpu/cuda/quant_linear.py MATVEC_MAX_ROWS and
# LARGE_BATCH): the 8B's MLP up (gate and up are each this shape) and down, out_features x
# in_features, in the types a Q4_K_M (Q4_K, its Q6_K down parts), a Q8_0 and an AWQ model hold.
LINEAR_SHAPES = {"8B up": (14336, 4096), "8B down": (4096, 14336)}
LINEAR_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "AWQ")
LINEAR_BATCHES = (1, 16, 64, 256)
MATVEC_TIMED_ROWS = 64  # the mat-vec is timed up to here (tiles of 16 above 16 rows)


def bench_quant_linear(rows, deadline) -> None:
    """QuantLinear alone on cupy arrays, each way it can run a batch: the mat-vec (up to
    MATVEC_TIMED_ROWS rows), the tiled GEMM (gemm_*: dequantized into shared memory, tensor
    cores) and dequantize + cuBLAS (the workspace chunks; from 16 rows); each timed as 20 calls
    captured in a graph (gpu_time), as a decode step's graph replays them. GB/s: the weight's
    quant bytes (planes as stored) over the time (%copy: of the d2d copy's); TFLOP/s: 2 M N K
    over the time. print_quant_linear_table prints the crossover table these rows imply.
    NOTE: the calls cycle through copies of the weight that together hold at least twice the
    L2 cache (a Q4_K 14336 x 4096 weight is 44 MB, an H100/H200's L2 50 MB): in a model each
    layer's weight comes from HBM, and so it must here, or GB/s would exceed the HBM's."""
    import cupy as cp
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda.gemm import WORKSPACE_BYTES, CublasGemm
    from ringserve.gpu.cuda.quant import QuantKernels
    from ringserve.gpu.cuda.quant_linear import WORKSPACE_ELEMENTS, QuantLinear
    stream = cp.cuda.Stream(non_blocking=True)
    l2_bytes = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    with stream:  # NOTE: every array made and filled on the stream that reads it
        gemm_workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, gemm_workspace.data.ptr, WORKSPACE_BYTES, lambda a: a.data.ptr)
        linear = QuantLinear(QuantKernels(stream).call, gemm, cp.empty(WORKSPACE_ELEMENTS, cp.float16))
        rng = cp.random.default_rng(0)
        try:
            for name, (N, K) in LINEAR_SHAPES.items():
                for fmt in LINEAR_FORMATS:
                    if not _quant_linear_case(rows, linear, rng, name, fmt, N, K, l2_bytes, stream, deadline):
                        return
        finally:
            gemm.close()
            del linear, gemm_workspace
            free_device_memory()


def _quant_linear_case(rows, linear, rng, name, fmt, N, K, l2_bytes, stream, deadline) -> bool:
    """bench_quant_linear's rows of one linear shape and format (called inside `with stream`);
    False at the deadline. Its weights go when it returns."""
    import cupy as cp

    first = random_planes(cp, rng, fmt, N, K)
    weights = [first] + [random_planes(cp, rng, fmt, N, K)
                         for _ in range(-(-2 * l2_bytes // first.nbytes) - 1)]
    for B in LINEAR_BATCHES:
        if time.monotonic() > deadline:
            print("gpu_check: quant linear stopped at the deadline", file=sys.stderr)
            return False
        x = (rng.standard_normal((B, K), dtype=cp.float32)).astype(cp.float16)
        out = cp.empty((B, N), cp.float16)
        impls = {"matvec": linear.matvec} if B <= MATVEC_TIMED_ROWS else {}
        impls["tiled"] = linear.tiled
        if B > 1:  # NOTE: a whole weight dequantized for one row: never a contender
            impls["dequant"] = linear.dequant_gemm
        for impl, fn in impls.items():
            cycle = itertools.cycle(weights)

            def one(fn=fn, x=x, out=out, cycle=cycle) -> None:  # bound now
                fn(x, next(cycle), out)
            dt = gpu_time(one, stream, 20, graph=True)
            rows.append(dict(linear=name, format=fmt, batch=B, impl=impl, N=N, K=K,
                             us=dt * 1e6, GBps=first.nbytes / dt / 1e9,
                             TFLOPs=2 * B * N * K / dt / 1e12))
    stream.synchronize()
    return True


def bench_transformers(name, shape, rows, deadline) -> None:
    """The peer: transformers' Llama, built directly on the GPU in fp16 (an 8B model built in
    float32 on the host first takes 32 GB and minutes), asked for the last position's logits
    only (logits_to_keep=1: the full logits of 256 x 512 tokens of a 128k vocabulary are 34 GB)."""
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers/torch not installed: no peer row", file=sys.stderr)
        return
    cfg = LlamaConfig(**shape, max_position_embeddings=4096)
    model: Any = None
    cache = out = None
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(default_dtype)
        for B in BATCHES:
            if time.monotonic() > deadline:
                break
            ids = torch.ones((B, CONTEXT), dtype=torch.long, device="cuda")
            with torch.no_grad():
                out = model(ids, use_cache=True, logits_to_keep=1)
                cache, out = out.past_key_values, None
                step = torch.ones((B, 1), dtype=torch.long, device="cuda")

                def one(step=step, cache=cache) -> None:  # bound now: called only in this iteration
                    model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    if isinstance(cache, DynamicCache):
                        cache.crop(CONTEXT)
                dt = time_steps(one, 10)
                cache = None
            rows.append(dict(model=name, impl="transformers", batch=B, step_ms=dt * 1e3, tok_s=B / dt))
    finally:
        torch.set_default_dtype(default_dtype)
        model = cache = out = None
        torch.cuda.empty_cache()


# Seconds each phase is expected to take at most on an A100/H100-class GPU (weights made on
# the device, 36 graphs captured per runner); a phase starts only when its estimate fits, and
# is stopped at LIMIT_FACTOR times it (or at the deadline, whichever comes first).
# "quant linear" took its 30 s from "quant 8B" (100 before), the last phase of --table quant:
# its loops stop at the deadline, so a short estimate costs at most its last rows.
ESTIMATES = {"copy": 5, "attention": 30, "ours 1B": 60, "transformers 1B": 45, "ours 8B": 100,
             "transformers 8B": 70, "quant linear": 30, "quant 1B": 65,  # quant 1B: BF16 too
             "quant 8B": 70, "bf16 1B": 35, "bf16 8B": 60}  # bf16: graphs only
# The phases of each --table: "quant" keeps the fp16 rows it is compared with (ours) and drops
# attention, transformers and bf16, so that it fits 6 minutes with --skip-tests; "fp16" (the
# decode table) has the bf16 rows beside fp16's.
TABLES = {"fp16": ("copy", "attention", "ours", "bf16", "transformers"),
          "quant": ("copy", "ours", "quant"),
          "all": ("copy", "attention", "ours", "bf16", "transformers", "quant")}
BF16_TARGET = 1.05  # issue 25: a bf16 decode step within 5 % of the same model's in fp16
LIMIT_FACTOR = 2.0
PREFLIGHT_S = 30
TESTS_TIMEOUT_S = 240  # NVRTC and Numba compile every kernel on first use, in each process


def weight_bound_pct(row: dict, copy_GBps: float | None) -> float:
    """A step's share of the weight-streaming bound: the time to read the weights once at the
    measured copy bandwidth, over the step's time, in %."""
    if "weight_bytes" not in row or not copy_GBps:
        return float("nan")
    return row["weight_bytes"] / (copy_GBps * 1e9) * 1e3 / row["step_ms"] * 100


def ratios(result: dict) -> list[dict]:
    """Per model and batch: graphs over eager and over transformers (tokens/s, same run), the
    graphs' % of the weight-streaming bound, and the targets of docs/deploy.md where they apply."""
    by = {(r["model"], r["batch"], r["impl"], r.get("dtype", "float16")): r for r in result["rows"]}
    out = []
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in result["rows"]):
        graphs = by.get((model, batch, "ringserve graphs", "float16"))
        if graphs is None:
            continue
        eager = by.get((model, batch, "ringserve eager", "float16"))
        peer = by.get((model, batch, "transformers", "float16"))
        bf16 = by.get((model, batch, "ringserve graphs", "bfloat16"))
        row = dict(model=model, batch=batch,
                   graphs_vs_eager=graphs["tok_s"] / eager["tok_s"] if eager else float("nan"),
                   vs_transformers=graphs["tok_s"] / peer["tok_s"] if peer else float("nan"),
                   pct_bound=weight_bound_pct(graphs, result.get("copy_GBps")),
                   bf16_step=bf16["step_ms"] / graphs["step_ms"] if bf16 else float("nan"))
        targets = []
        if bf16:
            targets.append((f"bf16 step <= {BF16_TARGET}x fp16", row["bf16_step"] <= BF16_TARGET))
        if model == "1B" and batch == 1:
            targets += [("%bound >= 60", row["pct_bound"] >= 60),
                        ("graphs >= 2x eager", row["graphs_vs_eager"] >= 2)]
        if batch == 64:
            targets.append(("tok/s >= 3x transformers", row["vs_transformers"] >= 3))
        row["targets"] = targets
        out.append(row)
    return out


def quant_ratios(result: dict) -> list[dict]:
    """Per model, format and batch: graphs tok/s, % of the bound for the bytes read, the ratio
    to our fp16 graphs row of the same model and batch, and the issue-16 targets at batch 1
    (>= 60 % of the bound; 4-bit >= 2.5x fp16)."""
    fp16 = {(r["model"], r["batch"]): r for r in result["rows"]
            if r["impl"] == "ringserve graphs" and r.get("dtype", "float16") == "float16"}
    by = {(r["model"], r["format"], r["batch"], r["impl"]): r for r in result.get("quant", [])}
    out = []
    for model, fmt, batch in dict.fromkeys((r["model"], r["format"], r["batch"])
                                           for r in result.get("quant", [])):
        graphs, eager = by.get((model, fmt, batch, "graphs")), by.get((model, fmt, batch, "eager"))
        base = fp16.get((model, batch))
        row = dict(model=model, format=fmt, batch=batch,
                   graphs_tok_s=graphs["tok_s"] if graphs else float("nan"),
                   eager_tok_s=eager["tok_s"] if eager else float("nan"),
                   pct_bound=weight_bound_pct(graphs, result.get("copy_GBps")) if graphs else float("nan"),
                   vs_fp16=graphs["tok_s"] / base["tok_s"] if graphs and base else float("nan"))
        targets = []
        if batch == 1:
            targets.append(("%bound >= 60", row["pct_bound"] >= 60))
            if fmt in FOUR_BIT:
                targets.append(("4-bit >= 2.5x fp16", row["vs_fp16"] >= 2.5))
        row["targets"] = targets
        out.append(row)
    return out


def linear_winners(rows: list[dict]) -> dict[tuple, str]:
    """(linear, format, batch) -> the fastest impl of the quant linear rows."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["linear"], r["format"], r["batch"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return {k: r["impl"] for k, r in best.items()}


def crossover(rows: list[dict]) -> tuple[int, str]:
    """The crossover table the linear rows imply, quant_linear's (MATVEC_MAX_ROWS, LARGE_BATCH):
    the largest batch up to which the mat-vec is the fastest in most shapes and formats at
    every batch timed, and the kernel fastest most often above it."""
    winners = linear_winners(rows)
    max_rows, matvec_holds, above = 0, True, {"tiled": 0, "dequant": 0}
    for b in sorted({batch for _, _, batch in winners}):
        won = [impl for (_, _, batch), impl in winners.items() if batch == b]
        matvec_holds = matvec_holds and won.count("matvec") * 2 > len(won)
        if matvec_holds:
            max_rows = b
        for impl in won if not matvec_holds else ():
            above[impl] = above.get(impl, 0) + 1
    return max_rows, max(above, key=lambda k: above[k])


def print_quant_linear_table(result) -> None:
    rows = result.get("quant_linear") or []
    if not rows:
        return
    winners = linear_winners(rows)
    copy = result.get("copy_GBps")
    print("\nquantized linear alone (graphs of 20 calls; GB/s: the quant bytes, %copy: of the d2d "
          "copy's; * fastest of its batch)")
    print(f"{'linear':8} {'format':6} {'batch':>5} {'impl':8} {'us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8}")
    for r in rows:
        mark = " *" if winners[(r["linear"], r["format"], r["batch"])] == r["impl"] else ""
        pct = r["GBps"] / copy * 100 if copy else float("nan")
        print(f"{r['linear']:8} {r['format']:6} {r['batch']:>5} {r['impl']:8} {r['us']:>9.1f} "
              f"{r['GBps']:>7.0f} {pct:>6.1f} {r['TFLOPs']:>8.1f}{mark}")
    per_batch: dict[int, dict[str, int]] = {}
    for (_, _, batch), impl in winners.items():
        counts = per_batch.setdefault(batch, {})
        counts[impl] = counts.get(impl, 0) + 1
    print("fastest per batch (of the shapes and formats): " + "; ".join(
        f"{batch}: " + ", ".join(f"{impl} {n}/{sum(c.values())}"
                                 for impl, n in sorted(c.items(), key=lambda kv: -kv[1]))
        for batch, c in per_batch.items()))
    max_rows, large = crossover(rows)
    print(f"crossover these rows imply (gpu/cuda/quant_linear.py): MATVEC_MAX_ROWS = {max_rows} "
          f"(of the batches timed), LARGE_BATCH = {large!r}")


def print_quant_table(result) -> None:
    rows = quant_ratios(result)
    if not rows:
        return
    print("\nquantized weights, decode (graphs; eager beside it; %bound: the bytes a step reads)")
    print(f"{'model':6} {'format':7} {'batch':>5} {'graphs tok/s':>12} {'eager tok/s':>11} {'%bound':>7} "
          f"{'vs fp16':>8}  targets")
    for r in rows:
        met = ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in r["targets"])
        print(f"{r['model']:6} {r['format']:7} {r['batch']:>5} {r['graphs_tok_s']:>12.0f} "
              f"{r['eager_tok_s']:>11.0f} {r['pct_bound']:>7.1f} {r['vs_fp16']:>7.2f}x  {met}")


def print_tables(result) -> None:
    print(f"{result['device']}  {result['date']}  tests: {result['tests']}  "
          f"d2d copy: {result['copy_GBps']:.0f} GB/s" if result.get("copy_GBps") else
          f"{result['device']}  tests: {result['tests']}")
    if result.get("versions"):
        print(", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    failed = [p for p in result.get("preflight", []) if not p["ok"]]
    if result.get("preflight"):
        print(f"preflight: {len(result['preflight']) - len(failed)}/{len(result['preflight'])} ok"
              + "".join(f"\n  {'FAIL' if p['required'] else 'missing'} {p['check']}: {p['detail']}"
                        for p in failed))
    if result["attention"]:
        print(f"\npaged attention, one decode step of one layer (H {ATTN_SHAPE['num_heads']}, "
              f"KVH {ATTN_SHAPE['num_kv_heads']}, D {ATTN_SHAPE['head_dim']}, fp16 K/V)")
        print(f"{'kernel':10} {'batch':>5} {'context':>7} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6}")
        for r in result["attention"]:
            print(f"{r['kernel']:10} {r['batch']:>5} {r['context']:>7} {r['splits']:>6} "
                  f"{r['us']:>9.1f} {r['GBps']:>7.0f} {r['pct_copy']:>6.1f}")
    if result["rows"]:
        print(f"\n{'model':6} {'impl':20} {'dtype':8} {'batch':>5} {'step ms':>9} {'tok/s':>10} "
              f"{'%bound':>7} {'launch/layer':>12} {'census GB':>9} {'%floor':>7}")
        for r in result["rows"]:
            census = (f" {r['launches_per_layer']:>12} {r['step_bytes'] / 1e9:>9.3f} "
                      f"{floor_pct(r, result.get('copy_GBps')):>7.1f}" if "step_bytes" in r else "")
            print(f"{r['model']:6} {r['impl']:20} {r.get('dtype', 'float16'):8} {r['batch']:>5} "
                  f"{r['step_ms']:>9.3f} "
                  f"{r['tok_s']:>10.0f} {weight_bound_pct(r, result.get('copy_GBps')):>7.1f}{census}"
                  + ("  (no graph: ran eager)" if r.get("replayed") is False and "graphs" in r["impl"]
                     else ""))
        print(f"\n{'model':6} {'batch':>5} {'graphs/eager':>12} {'vs transformers':>15} "
              f"{'%bound':>7} {'bf16/fp16 step':>14}  targets")
        for r in ratios(result):
            met = ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in r["targets"])
            print(f"{r['model']:6} {r['batch']:>5} {r['graphs_vs_eager']:>11.2f}x "
                  f"{r['vs_transformers']:>14.2f}x {r['pct_bound']:>7.1f} {r['bf16_step']:>13.3f}x  {met}")
    print_quant_linear_table(result)
    print_quant_table(result)
    for msg in result["skipped"]:
        print(f"skipped: {msg}")
    for name, error in result["errors"].items():
        print(f"failed: {name}: {error}")
    print("phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["phases"].items()))


def run_in_session(cmd: list[str], timeout: float) -> int | None:
    """cmd's exit status, or None when it ran past timeout: then its whole process group is
    killed (pytest's engine subprocesses and compile workers too), not just cmd."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None
    finally:
        if proc.poll() is None:  # interrupted (PhaseTimeout, Ctrl-C): nothing left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_tests(budget: Budget) -> str:
    tests = sorted((Path(__file__).resolve().parent.parent / "tests").glob("test_gpu_*.py"))
    timeout = max(1.0, min(TESTS_TIMEOUT_S, budget.left() - sum(ESTIMATES.values()) / 2))
    rc = run_in_session([sys.executable, "-u", "-m", "pytest", "-q", "-m", "gpu", *map(str, tests)], timeout)
    if rc is None:
        return f"timed out after {timeout:.0f} s"
    return "passed" if rc == 0 else f"failed (rc {rc})"


def write_result(out: Path, result: dict) -> None:
    """DIR/gpu_check.json and DIR/gpu_check.txt (the tables) as they stand now."""
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_tables(result)
    (out / "gpu_check.txt").write_text(text.getvalue())


def run_phases(budget: Budget, result: dict, kinds: tuple[str, ...]) -> None:
    """The benchmark phases of one --table, in order (a kind not in `kinds` is left out)."""
    def phase(name: str, fn):
        if name.split()[0] in kinds:
            budget.run(name, ESTIMATES[name], fn, limit_s=ESTIMATES[name] * LIMIT_FACTOR)
    phase("copy", lambda: result.update(copy_GBps=copy_bandwidth() / 1e9))
    if result.get("copy_GBps"):
        copy = result["copy_GBps"] * 1e9
        phase("attention", lambda: bench_attention(result["attention"], copy, budget.deadline))
    phase("quant linear", partial(bench_quant_linear, result.setdefault("quant_linear", []), budget.deadline))
    for name, shape in SHAPES.items():
        phase(f"ours {name}", partial(bench_ours, name, shape, result["rows"], budget.deadline))
        phase(f"bf16 {name}", partial(bench_ours, name, shape, result["rows"], budget.deadline, "bfloat16"))
        phase(f"quant {name}", partial(bench_quant, name, shape, result["quant"], budget.deadline))
        phase(f"transformers {name}",
              partial(bench_transformers, name, shape, result["rows"], budget.deadline))


def main(argv=None) -> int:
    for stream in (sys.stdout, sys.stderr):  # unbuffered in effect, whoever started us
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="folder for gpu_check.json and gpu_check.txt, rewritten after every phase")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-preflight", action="store_true",
                    help="the preflight's imports only, not its device checks (run before, alone: "
                         "tools/device_run.py)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="the whole run, tests included")
    ap.add_argument("--table", choices=sorted(TABLES), default="fp16",
                    help="the benchmark tables: fp16 (attention, ours in fp16 and bf16 vs "
                         "transformers), quant (packed weights vs ours in fp16), or all (past 6 "
                         "minutes: phases that do not fit are skipped)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = cuda_device_name()
    result: dict = dict(device=device or "no CUDA device", date=time.strftime("%Y-%m-%d"),
                        preflight=[], tests=None, copy_GBps=None, attention=[], rows=[], quant=[],
                        quant_linear=[])
    budget = Budget(args.budget_s, after=lambda: write_result(args.out, result))
    result.update(skipped=budget.skipped, phases=budget.phases, errors=budget.errors)
    from ringserve.tools import gpu_preflight
    preflight_ok = budget.run("preflight", 1,
                              lambda: gpu_preflight.run(result["preflight"],
                                                        device is not None and not args.skip_preflight),
                              limit_s=PREFLIGHT_S * LIMIT_FACTOR)
    if device is None:
        print("gpu_check: no CUDA device (CuPy sees none); the imports above are all it checks "
              "here. Run it on a machine with an NVIDIA GPU and `pip install -e .[cuda]`.",
              file=sys.stderr)
        return 1
    result["versions"] = software_versions()
    if not preflight_ok:
        print("gpu_check: the preflight failed (above); the phases run all the same", file=sys.stderr)
    if not args.skip_tests:
        result["tests"] = budget.run("tests", 30, lambda: run_tests(budget)) or "skipped"

    run_phases(budget, result, TABLES[args.table])
    print_tables(result)
    write_result(args.out, result)
    passed = result["tests"] in (None, "passed") and not result["errors"]
    return 0 if passed and preflight_ok else 1


if __name__ == "__main__":
    sys.exit(main())
