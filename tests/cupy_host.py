"""A host stand-in of the parts of CuPy (and of the Numba and cuBLAS launches) that the CUDA
runner's set-up and graph capture use, for CI without a GPU (tests/test_cuda_graph_memory.py).

A CUDA graph keeps raw device addresses, not references to arrays, so this stand-in models
what matters for them: which allocation each address lies in, and when that allocation is
handed back.

- Memory: an array is host memory viewed as DeviceArray (a numpy subclass with CuPy's
  .data.ptr, .set and .get). Each allocation is a Block, freed when its last array goes, as
  CuPy's MemoryPool gets a block back when the last array on it is released (and
  free_all_blocks, or CuPy's retry after an out-of-memory error, hands it to the driver).
- Streams: begin_capture / end_capture / is_capturing; `with stream:` makes one current;
  synchronizing during a capture raises, as CUDA does.
- Launches: RawModule kernels, Numba kernels (Numba's dispatchers stood in: NumbaKernel),
  cuBLAS's gemm_ex (HostCublas), CuPy's own element-wise ops on the current stream, and
  memcpy2DAsync are recorded as a Launch: its name and, for each device operand, the Block it
  lies in and the bytes it spans, as addresses (ints), holding no reference, as a graph does.
  An operand outside every live Block, or a host array given as a device operand, raises at
  once (on a GPU: an illegal address, or a pointer into someone else's memory).
- Graphs: end_capture returns a Graph of the launches made while capturing; Graph.launch (a
  replay) raises if any of them touches a Block freed since.
Kernels compute nothing: the tests that use this check memory; the kernels' numbers are
tests/test_cuda_forward_host.py's and the `gpu` tests'.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import traceback
import types
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from cublas_host import HostCublas


class IllegalAddress(AssertionError):
    """What the device reports when a launch reads or writes memory that is not (or no longer)
    an allocation: cudaErrorIllegalAddress, sticky, the end of the process on a GPU."""


@dataclass
class Block:
    """One device allocation."""
    id: int
    start: int
    nbytes: int
    site: str       # where it was allocated (the first frame outside numpy and this file)
    alive: bool = True

    def holds(self, lo: int, hi: int) -> bool:
        return self.start <= lo and hi <= self.start + self.nbytes


@dataclass(frozen=True)
class Operand:
    block: int      # Block.id
    start: int
    nbytes: int


@dataclass(frozen=True)
class Launch:
    name: str
    operands: tuple[Operand, ...]


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "numpy" not in frame.filename and not frame.filename.endswith("cupy_host.py"):
            return f"{'/'.join(frame.filename.split('/')[-3:])}:{frame.lineno} ({frame.line})"
    return "?"


def span(a: np.ndarray) -> tuple[int, int]:
    """[lo, hi): the bytes a (strided) array's elements occupy."""
    lo = hi = a.ctypes.data
    for n, stride in zip(a.shape, a.strides, strict=True):
        lo += min(0, stride * (n - 1))
        hi += max(0, stride * (n - 1))
    return lo, hi + a.itemsize


class _Ptr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A "device" array: CuPy's .data.ptr, .set(), .get(); CuPy's own element-wise ops on it
    (`x += bias`, `out[...] = src`) are launches on the current stream."""
    device: Device  # the one Device of the current test (Device.install sets it)

    @property  # type: ignore[override]  # CuPy's .data is a MemoryPointer: .ptr, its address
    def data(self) -> _Ptr:
        return _Ptr(self.ctypes.data)

    def __array_finalize__(self, obj) -> None:
        if self.base is None:  # new memory (astype, copy): a CuPy allocation
            self.device.register(self)

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        self.device.launch("cupy set (host to device)", stream, (self,))
        np.ndarray.__setitem__(self, Ellipsis, host)

    def get(self, stream: Any = None) -> np.ndarray:
        self.device.launch("cupy get (device to host)", stream, (self,))
        return np.array(self.view(np.ndarray))

    def __setitem__(self, key, value) -> None:
        self.device.launch("cupy copy", None, (self[key], value))
        np.ndarray.__setitem__(self, key, value)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out", ())
        self.device.launch(f"cupy {ufunc.__name__}", None, (*inputs, *out))
        plain = tuple(a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in inputs)
        if out:
            kwargs["out"] = tuple(a.view(np.ndarray) for a in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        return self.device.adopt(result)


class Stream:
    def __init__(self, device: Device, non_blocking: bool = False):
        self.device = device
        self.ptr = next(device.addresses)
        self.capture: list[Launch] | None = None
        device.streams[self.ptr] = self

    def __enter__(self) -> Stream:
        self.device.current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.device.current.pop()

    def begin_capture(self) -> None:
        assert self.capture is None, "begin_capture on a capturing stream"
        self.capture = []

    def end_capture(self) -> Graph:
        assert self.capture is not None, "end_capture without a capture"
        launches, self.capture = self.capture, None
        graph = Graph(self.device, tuple(launches))
        self.device.graphs.append(graph)
        return graph

    def is_capturing(self) -> bool:
        return self.capture is not None

    def synchronize(self) -> None:
        if self.capture is not None:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: synchronize during a capture")


class Graph:
    """A captured graph: its launches' addresses, nothing else."""

    def __init__(self, device: Device, launches: tuple[Launch, ...]):
        self.device, self.launches = device, launches

    def launch(self, stream: Stream) -> None:
        for launch in self.launches:
            for op in launch.operands:
                block = self.device.blocks[op.block]
                if not block.alive:
                    raise IllegalAddress(
                        f"graph replay: {launch.name} touches {op.nbytes} bytes at {op.start:#x} of "
                        f"a {block.nbytes}-byte allocation made at {block.site}, freed since")
        self.device.launch("graph launch", stream, ())


class Event:
    def __init__(self, device: Device, **_):
        self.device = device

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class RawKernel:
    def __init__(self, device: Device, name: str):
        self.device, self.name = device, name

    def __call__(self, grid, block, args, stream: Any = None, shared_mem: int = 0) -> None:
        self.device.launch(self.name, stream, args)


class RawModule:
    def __init__(self, device: Device, code: str, options: tuple = (), backend: str = "nvrtc"):
        self.device, self.code = device, code

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self.device, name)


class NumbaKernel:
    """A Numba CUDA dispatcher: kernel[grid, block, stream](*args) records one launch."""

    def __init__(self, device: Device, name: str):
        self.device, self.name = device, name

    def __getitem__(self, config):
        grid, block, stream = config
        return lambda *args: self.device.launch(f"numba {self.name}", stream, args)


class NumbaCuda:
    """numba.cuda as gpu/cuda/runner.py uses it: a CuPy array as a Numba one (itself here), a
    CuPy stream as a Numba stream (itself here)."""

    def __init__(self, device: Device):
        self.device = device

    def as_cuda_array(self, a: Any, sync: bool = True) -> Any:
        assert isinstance(a, DeviceArray), f"as_cuda_array of {type(a).__name__}"
        return a

    def external_stream(self, ptr: int) -> Stream:
        return self.device.streams[ptr]

    def event(self) -> Event:
        return Event(self.device)


class Cublas(HostCublas):
    """nvmath's cuBLAS binding: gemm_ex records a launch of its A, B, C and the handle's
    workspace on the handle's stream (the GEMM itself: tests/test_cuda_gemm_host.py)."""

    def __init__(self, device: Device):
        super().__init__()
        self.device = device

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta,
                c, ctype, ldc, compute_type, algo) -> None:
        state = self.handles[handle]
        assert state["stream"] and state["workspace"], f"gemm_ex without stream or workspace: {state}"
        self.calls.append(None)  # type: ignore[arg-type]  # counted, not kept

        def matrix(ptr: int, rows: int, cols: int, ld: int) -> tuple[int, int]:
            return ptr, ptr + ((cols - 1) * ld + rows) * 2  # column-major, 2-byte elements

        A = matrix(a, *((m, k) if transa == self.Operation.N else (k, m)), lda)
        B = matrix(b, *((k, n) if transb == self.Operation.N else (n, k)), ldb)
        ws, ws_bytes = state["workspace"]
        self.device.launch_spans("cublas gemm_ex", self.device.streams[state["stream"]],
                                 (A, B, matrix(c, m, n, ldc), (ws, ws + ws_bytes)))


class Device:
    """The one GPU of a test: its allocations, streams, launches and captured graphs."""

    def __init__(self, num_sms: int = 132):
        self.num_sms = num_sms
        self.blocks: dict[int, Block] = {}
        self.ids = itertools.count(1)
        self.addresses = itertools.count(0x7F00_0000_0000, 0x100)  # stream handles
        self.streams: dict[int, Stream] = {}
        self.current = [Stream(self)]   # the legacy default stream at the bottom
        self.allocator: Any = None      # cupy.cuda.using_allocator's, while in force
        self.graphs: list[Graph] = []
        self.launches = 0

    # memory
    def register(self, a: np.ndarray) -> None:
        """a owns new memory: a Block until its last array goes."""
        if self.allocator is not None:
            self.allocator(a.nbytes)  # capture.refuse_allocation raises
        lo, hi = span(a)
        block = Block(next(self.ids), lo, max(1, hi - lo), _site())
        self.blocks[block.id] = block
        weakref.finalize(a, self._free, block.id)

    def _free(self, block_id: int) -> None:
        self.blocks[block_id].alive = False

    def alloc(self, shape, dtype) -> DeviceArray:
        if self.allocator is not None:
            self.allocator(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        host = np.zeros(shape, dtype)
        self.register(host)
        return host.view(DeviceArray)

    def adopt(self, host: np.ndarray) -> DeviceArray:
        """A copy of host in new device memory."""
        out = self.alloc(host.shape, host.dtype)
        np.copyto(out.view(np.ndarray), host)
        return out

    def block_at(self, lo: int, hi: int) -> Block | None:
        return next((b for b in self.blocks.values() if b.alive and b.holds(lo, hi)), None)

    # launches
    def launch(self, name: str, stream: Any, args) -> None:
        spans = []
        for a in args:
            if isinstance(a, DeviceArray):
                if a.size:
                    spans.append(span(a))
            elif isinstance(a, np.ndarray):
                if name.startswith("cupy"):  # a host operand of CuPy's own op: CuPy copies it
                    continue
                raise IllegalAddress(f"{name}: a host numpy array {a.shape} {a.dtype} as a device operand")
        self.launch_spans(name, stream, spans)

    def launch_spans(self, name: str, stream: Any, spans) -> None:
        stream = stream if stream is not None else self.current[-1]
        operands = []
        for lo, hi in spans:
            block = self.block_at(lo, hi)
            if block is None:
                raise IllegalAddress(f"{name}: {hi - lo} bytes at {lo:#x} lie in no live allocation")
            operands.append(Operand(block.id, lo, hi - lo))
        self.launches += 1
        if stream.capture is not None:
            stream.capture.append(Launch(name, tuple(operands)))

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                 kind: int, stream: int) -> None:
        self.launch_spans("cudaMemcpy2DAsync", self.streams[stream],
                          [(dst, dst + (height - 1) * dpitch + width)])
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    @contextlib.contextmanager
    def using_allocator(self, allocator):
        prev, self.allocator = self.allocator, allocator
        try:
            yield
        finally:
            self.allocator = prev

    # the `cupy` module over this device
    def cupy(self) -> types.ModuleType:
        DeviceArray.device = self
        cp = types.ModuleType("cupy")
        cp.__doc__ = "tests/cupy_host.py's stand-in of CuPy"
        for name in ("float16", "float32", "int32", "int64", "uint8", "uint16"):
            setattr(cp, name, getattr(np, name))
        cp.ndarray = DeviceArray
        cp.empty = lambda shape, dtype=np.float32: self.alloc(shape, dtype)
        cp.zeros = cp.empty  # alloc zero-fills
        cp.full = lambda shape, value, dtype=None: self._filled(shape, value, dtype)
        cp.asarray = lambda a, dtype=None: a if isinstance(a, DeviceArray) and dtype in (None, a.dtype) \
            else self.adopt(np.asarray(a, dtype))
        cp.ascontiguousarray = lambda a: a if isinstance(a, DeviceArray) and a.flags.c_contiguous \
            else self.adopt(np.ascontiguousarray(a))
        cp.concatenate = lambda arrays, axis=0: self.adopt(np.concatenate(
            [a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in arrays], axis))
        cp.RawModule = lambda code, options=(), backend="nvrtc", **_: RawModule(self, code, options, backend)
        runtime = types.SimpleNamespace(memcpy2DAsync=self.memcpy2d, memcpyHostToDevice=1,
                                        getDeviceCount=lambda: 1)
        cp.cuda = types.SimpleNamespace(
            Stream=lambda non_blocking=False: Stream(self, non_blocking),
            Device=lambda *_: types.SimpleNamespace(attributes={"MultiProcessorCount": self.num_sms},
                                                    synchronize=self.synchronize),
            Event=lambda **kw: Event(self, **kw), runtime=runtime,
            alloc_pinned_memory=bytearray, using_allocator=self.using_allocator)
        return cp

    def _filled(self, shape, value, dtype) -> DeviceArray:
        out = self.alloc(shape, dtype)
        out.view(np.ndarray)[...] = value
        return out
