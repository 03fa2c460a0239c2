"""Nothing a CUDA graph points at can be freed (issue 25 item 3), checked without a GPU.

A captured graph keeps raw device addresses: a buffer it reads or writes that goes back to
CuPy's pool (its last array released) may be handed to another array, or to the driver by
free_all_blocks or CuPy's retry after an out-of-memory error, and the next replay writes into
someone else's memory or into unmapped memory (a sticky error: the engine dies).

The real CudaModelRunner (set-up, CudaOps, capture_graphs, the replay path) runs over
tests/cupy_host.py's device stand-in, which records every launch made during a capture (CUDA C
kernels, Numba kernels, cuBLAS GEMMs with the handle's workspace, CuPy's own copies) as the
allocations its operands lie in. After the runner is built: every allocation a captured launch
touches must be reachable from the runner (weights, KV caches, RoPE tables, workspaces, the
graph records), and every graph replays without touching freed memory. The `gpu` test that
does the same on a device (pools emptied and refilled with garbage): tests/test_gpu_graph_memory.py.
"""
from __future__ import annotations

import gc
import importlib
import sys
import types
from dataclasses import replace

import numpy as np
import pytest

from cupy_host import Cublas, Device, IllegalAddress, NumbaCuda, NumbaKernel, span
from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.cuda import numba_kernels as nk
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits
from test_cuda_capture import decode, verify

pytestmark = pytest.mark.sim
# max_model_len 2048 > one 512-key partition, with 132 SMs: every ladder size splits its keys
CACHE = CacheConfig(num_gpu_blocks_override=64)
LIMITS = StepLimits(max_num_seqs=8, max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS, max_model_len=2048)
CUDA = DeviceConfig(device="cuda")


@pytest.fixture
def stand_in(monkeypatch):
    """gpu/cuda/runner.py imported over a `cupy` and an `nvmath.bindings.cublas` of one
    cupy_host.Device, its Numba kernels' dispatchers stood in: (device, runner module)."""
    device = Device()
    cp = device.cupy()
    nvmath, bindings = types.ModuleType("nvmath"), types.ModuleType("nvmath.bindings")
    bindings.cublas = Cublas(device)  # type: ignore[attr-defined]
    nvmath.bindings = bindings  # type: ignore[attr-defined]
    before = set(sys.modules)
    for name, module in (("cupy", cp), ("nvmath", nvmath), ("nvmath.bindings", bindings)):
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("runner", "attention", "fused", "quant"):
        monkeypatch.delitem(sys.modules, f"ringserve.gpu.cuda.{name}", raising=False)
    runner = importlib.import_module("ringserve.gpu.cuda.runner")
    monkeypatch.setattr(runner, "nb_cuda", NumbaCuda(device))
    for name in [n for n in vars(nk) if n.endswith("_kernel")]:
        monkeypatch.setattr(nk, name, NumbaKernel(device, name))
    # NOTE: warm_up samples through gpu/cuda/sampler.py's Numba device arrays (a device's);
    # it runs after the capture and the graphs point at nothing of it
    monkeypatch.setattr(runner.CudaModelRunner, "warm_up", lambda self: None)
    yield device, runner
    for name in set(sys.modules) - before:  # the modules bound to the stand-in go
        if any(value is cp for value in vars(sys.modules[name]).values()):
            del sys.modules[name]


def held_blocks(root, device: Device) -> set[int]:
    """The live allocations reachable from root by references (what root owns)."""
    held: set[int] = set()
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, Device)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            block = device.block_at(*span(obj)) if obj.size else None
            if block is not None:
                held.add(block.id)
        elif isinstance(obj, types.FunctionType):  # its closure, not its module's globals
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
        else:
            todo.extend(gc.get_referents(obj))
    return held


def stray_allocations(runner, device: Device) -> list[str]:
    """What a captured launch touches that the runner does not hold, one line each."""
    held = held_blocks(runner, device)
    stray = {(launch.name, op.block) for graph in device.graphs for launch in graph.launches
             for op in launch.operands if op.block not in held}
    return sorted(f"{name}: a {device.blocks[b].nbytes}-byte allocation made at {device.blocks[b].site}, "
                  f"{'held by something else' if device.blocks[b].alive else 'freed'}" for name, b in stray)


def build(stand_in, model_dir, settings: DeviceConfig = CUDA, limits: StepLimits = LIMITS):
    device, runner_module = stand_in
    runner = runner_module.CudaModelRunner.from_dir(model_dir, settings, CACHE, limits)
    assert sorted(runner.graphs.graphs) == runner.graphs.sizes, runner.capture_failures
    assert sorted(runner.verify_graphs.graphs) == runner.verify_graphs.sizes, runner.verify_capture_failures
    assert len(device.graphs) == len(runner.graphs.sizes) + len(runner.verify_graphs.sizes)
    gc.collect()  # whatever only the capture's frames held is freed now
    return runner


@pytest.mark.parametrize("backend", ["rawkernel", "numba"])
def test_every_allocation_a_captured_graph_touches_is_held_by_the_runner(stand_in, tiny_cuda_models, backend):
    device, _ = stand_in
    runner = build(stand_in, tiny_cuda_models("tied-g3"), replace(CUDA, attention_backend=backend))
    names = {launch.name for graph in device.graphs for launch in graph.launches}
    # each kind of operand is in the graphs: weights, caches, RoPE tables, step buffers, the
    # cuBLAS workspace; the split-K attention's workspace (partials, tickets) with the RawKernel
    assert {"cublas gemm_ex", "add_rms_norm", "silu_mul", "numba gather_rows_kernel",
            "to_float32"} <= names, names
    # a decode graph: RoPE and the K/V write inside the RawKernel's launch; before the Numba kernel
    assert ("paged_attention_rope" in names) == ("rope_store_kv" not in names) == (backend == "rawkernel")
    stray = stray_allocations(runner, device)
    assert not stray, "\n".join(stray)
    for n in (1, 3, 5, 8):  # every graph replays through the runner's own path
        logits, _ = runner._launch(decode(n))
        assert logits.shape == (n, runner.config.vocab_size)


def test_speculative_decodings_verify_graphs_are_held_and_replay(stand_in, tiny_cuda_models):
    """Speculative decoding (K = 3, verify steps of up to 4 requests): the runner captures
    verify graphs [1, 2, 4] beside the decode ladder over views of the same shared buffers
    (16 tokens and rows, 5 request slots at most), everything they touch held by the runner;
    verify steps replay them through the runner's own path (the graph's buffers, 1 + k rows of
    logits a request), a step of more tokens than the ladder holds runs eager."""
    device, _ = stand_in
    runner = build(stand_in, tiny_cuda_models("tied-g3"),
                   limits=replace(LIMITS, num_speculative_tokens=3, max_num_verify_seqs=4))
    assert runner.verify_graphs.sizes == [1, 2, 4] and runner.verify_graphs.query_len == 4
    assert len(device.graphs) == 4 + 3
    stray = stray_allocations(runner, device)
    assert not stray, "\n".join(stray)
    for drafts, size in (([3], 1), ([3, 0], 2), ([3, 1, 0, 2], 4)):
        logits, buf = runner._launch(verify(drafts))
        assert logits.shape == (sum(drafts) + len(drafts), runner.config.vocab_size)
        assert buf is runner.verify_graphs.graphs[size].buffers
    logits, buf = runner._launch(verify([3] * 5))  # 5 requests: eager
    assert logits.shape == (20, runner.config.vocab_size)
    assert all(buf is not g.buffers for g in runner.verify_graphs.graphs.values())
    logits, buf = runner._launch(decode(3))  # a decode step still replays its decode graph
    assert buf is runner.graphs.graphs[4].buffers and logits.shape == (3, runner.config.vocab_size)


def test_a_packed_models_graphs_hold_every_allocation_they_touch(stand_in, tmp_path, monkeypatch):
    """A tiny Q4_K_M GGUF with graphs up to 72 rows: the packed parts through quant.cu's
    crossover table (the mat-vec, above MATVEC_MAX_ROWS the tiled GEMM: no workspace, no cuBLAS
    for them), every allocation a graph touches held by the runner."""
    from test_cuda_forward_host import tiny_gguf

    device, _ = stand_in
    runner = build(stand_in, tiny_gguf(tmp_path, "q4_k_m", monkeypatch),
                   limits=replace(LIMITS, max_num_seqs=72))
    names = {launch.name for graph in device.graphs for launch in graph.launches}
    assert {"gemm_u4", "gemm_u6", "matvec_u4_r1"} <= names and "dequant_u4_f16" not in names, names
    stray = stray_allocations(runner, device)
    assert not stray, "\n".join(stray)
    logits, _ = runner._launch(decode(70))
    assert logits.shape == (70, runner.config.vocab_size)


def test_the_check_sees_a_workspace_the_runner_let_go(stand_in, tiny_cuda_models):
    """The bug this file is for: the split-K workspace dropped after capture (as when
    capture_graphs held it in a local) is reported, and the replay touches freed memory."""
    device, _ = stand_in
    runner = build(stand_in, tiny_cuda_models("tied-g3"))
    for captured in runner.graphs.graphs.values():
        captured.attention.workspace = (None, None, None)
    gc.collect()
    stray = stray_allocations(runner, device)
    assert stray and all("attention.py" in line and line.endswith("freed") for line in stray), stray
    with pytest.raises(IllegalAddress, match=r"paged_attention_rope touches .*attention\.py.*, freed since"):
        runner._launch(decode(1))


def test_a_draft_model_shares_the_targets_stream_and_pool_and_replays_its_decode_graphs(stand_in,
                                                                                       tiny_cuda_models):
    """Speculative decoding with a draft model (engine/core.py _make_runners): the draft built
    first with its pool deferred (its graphs' step buffers allocated, nothing captured), then
    the target with mirror=the draft: one stream, the draft's pool as many blocks as the
    target's, its decode ladder and its catch-up ladder (query length 2) captured over it,
    everything both runners' graphs touch held; the draft's one-token steps replay its decode
    graphs, its catch-up its graphs of query length 2."""
    device, runner_module = stand_in
    limits = replace(LIMITS, num_speculative_tokens=3, max_num_verify_seqs=4)
    draft = runner_module.CudaModelRunner.from_dir(   # engine/draft_proposer.py draft_limits
        tiny_cuda_models("untied-g2"), CUDA, CACHE, replace(limits, num_speculative_tokens=1),
        defer_kv_cache=True)
    assert draft.num_blocks == 0 and draft.kv_caches == [] and not device.graphs
    assert draft._graph_buffers is not None   # allocated before the target's profile
    target = runner_module.CudaModelRunner.from_dir(tiny_cuda_models("tied-g3"), CUDA, CACHE, limits,
                                                    mirror=draft)
    assert target.stream is draft.stream
    assert draft.num_blocks == target.num_blocks == CACHE.num_gpu_blocks_override
    assert len(draft.kv_caches) == draft.config.num_hidden_layers and draft._graph_buffers is None
    assert sorted(draft.graphs.graphs) == draft.graphs.sizes
    assert draft.verify_graphs.query_len == 2 and sorted(draft.verify_graphs.graphs) == [1, 2, 4]
    assert len(device.graphs) == sum(len(r.graphs.sizes) + len(r.verify_graphs.sizes)
                                     for r in (draft, target))
    gc.collect()
    held = held_blocks(target, device) | held_blocks(draft, device)
    stray = {(launch.name, op.block) for graph in device.graphs for launch in graph.launches
             for op in launch.operands if op.block not in held}
    assert not stray, stray
    for n, size in ((1, 1), (3, 4)):
        logits, buf = draft._launch(decode(n))
        assert buf is draft.graphs.graphs[size].buffers and logits.shape == (n, draft.config.vocab_size)
    # the catch-up (a request one token behind: two tokens) replays a graph of query length 2,
    # logits at the speculating requests' rows only
    replayed = []
    for size, captured in draft.verify_graphs.graphs.items():
        captured.launch = lambda stream, _s=size, _launch=captured.launch: (replayed.append(_s),
                                                                            _launch(stream))
    assert draft.execute(verify([1, 0, 1]), np.array([1, 4])).shape == (2, draft.config.vocab_size)
    assert draft.execute(decode(3), np.array([0, 2])).shape == (2, draft.config.vocab_size)
    assert replayed == [4]
