"""GGUF weight types kept packed in memory: each tensor's raw GGUF blocks repacked once, at load,
into planes the CPU kernels (gpu/cpu/quant_kernels.py) stream with vector instructions.

GGUF interleaves each block's f16 scale(s) with its quants (Q4_0: 2 scale bytes, then 16 bytes of
nibbles; 18-byte blocks), and the K-quants pack 6-bit sub-block scales into 12 bytes: a kernel that
reads that format directly cannot vectorize. Repacking splits every weight W [out, in] into:

- ``q``: the quants as a plane, one of three kinds
  - ``"i8"``: int8 [out, in], one byte a weight (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, and
    4-bit types whose ``in`` is not a multiple of 64);
  - ``"u4"``: uint8 [out, in / 2], two 4-bit quants a byte in groups of 64 weights: byte j of
    group g holds weight 64g + j in its low nibble and 64g + 32 + j in its high one (Q4_0, Q4_1,
    Q4_K; Q4_K's own order, so its bytes are copied as they are);
  - ``"f16"``: IEEE half bits, uint16 [out, in] (F16);
- ``scale``: float32 [out, in / block], one per sub-block of ``block`` weights (32; 16 for the
  K-quants with 16-weight sub-blocks), already multiplied out (K-quants: ``d * sc``);
- ``offset``: float32 [out, in / block] or None (types without a minimum), already negated
  (K-quants: ``-(dmin * m)``; Q4_0 as nibbles: ``-8 * d``, its zero point folded in),

so that weight = ``scale * q + offset``, each of these operations in float32 and in the same
order as gguf-py's ``dequantize``: ``dequantize(repack(raw))`` is bit-identical to it
(tests/test_quant_kernels.py). (Q4_0's fold is exact too: d has an f16's 11-bit significand, so
``d * q``, ``-8 * d`` and their sum ``d * (q - 8)`` all fit float32's 24 bits; only a zero weight
with a negative d comes out +0.0 where gguf-py has -0.0.) Signed types
without a minimum (Q8_0, Q5_0, Q6_K, Q3_K, and Q4_0 as int8) store ``q`` already centred.
F32 and BF16 stay the arrays gpu/cpu/linear.py takes (float32;
bfloat16 bits as uint16), kinds ``"f32"`` and ``"bf16"``.

Compact scale planes (what the CUDA backend uploads: a batch-1 decode step is bound by the
bytes it streams, and float32 planes are 0.25 B/weight of Q4_K's 0.75). The scales are exact in
fewer bytes, and ``dequantize`` reads every form to the same float32 values:
- ``repack(..., factored=True)``, the K-quants (Q2_K..Q6_K): ``scale`` and ``offset`` hold the
  int8 sub-block factors (sc; m) and ``scale_super`` / ``offset_super`` float32 [out, in / 256]
  the super-block's ``d`` and ``-dmin``: a value is ``factor * super[k // 256]``, the same
  float32 product as ``d * sc`` (and ``m * -dmin == -(dmin * m)`` exactly). Q4_K: 0.5 + 1/32 +
  1/32 + 8/256 = 0.594 B/weight, Q6_K 1.078 (0.828 as the u6 plane, as_u6), Q5_K 1.094;
- float16 ``scale`` / ``offset`` (``as_halves``, where every value of both planes is exactly a
  half): the legacy types' d and m are GGUF f16 fields, Q4_0's folded ``-8 d`` too unless it
  overflows (GPTQ's s and -8 s as well). Q4_1 as nibbles 0.625 B/weight, Q8_0 1.0625;
- no offset plane where every offset is ``-8 * scale`` (``as_zero_point``: Q4_0, GPTQ): the
  kernels make it, QuantWeight.zero says so. Q4_0 0.5625 B/weight, GPTQ 0.516.
The CPU backend keeps the float32 planes (its kernels read them; the bytes change nothing there).

Layout choice, measured on the 2-core Zen 5 VM (tools/bench_quant.py, docs/bench_quant.md): 4-bit
quants stay nibbles in 64-weight groups by default: 0.75 instead of 1.25 bytes a weight (what lets
an 8B Q4_K_M model fit beside llama.cpp's footprint) and the fastest at batch 4 (7.3 vs 5.0 G
weights/s on one thread: the tile dequantizes at 12 G/s against 8), but slower at batch 1 (14.7
vs 18-21 G/s: unpacking costs more than the bytes it saves; ``nibbles=False`` gives int8 planes).
Nibbles in 32-weight groups (Q4_0's own order) streamed at 10 and dequantized at 4 G/s. 5- and
6-bit quants are widened to int8 here (the float32-activation kernels: their split high bits would
cost more to gather than they save); the int8-activation tiles hold them in 6 bits again
(gpu/cpu/int8_kernels.py's u6, unpacked in registers).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

QK_K = 256
# GGUF type name -> (weights per block, bytes per block), as ggml defines them.
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
SUPPORTED_TYPES = tuple(BLOCK_SIZES)


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """One weight W [out, in] in its GGUF type, packed for the CPU kernels (see the module doc)."""

    qtype: str                  # GGUF type name: "Q4_K", "F16", ...
    shape: tuple[int, int]      # (out, in): the logical float matrix
    kind: str                   # "i8" | "u4" | "f16" | "f32" | "bf16" | "u6" (the CUDA store's Q6_K)
    q: np.ndarray
    scale: np.ndarray | None = None     # float32, float16, or int8 factors of scale_super
    offset: np.ndarray | None = None    # as scale (int8 factors of offset_super)
    block: int = 1
    scale_super: np.ndarray | None = None   # float32 [out, in / 256]: factored K-quants' d
    offset_super: np.ndarray | None = None  # float32 [out, in / 256]: their -dmin
    zero: int = 0  # weight = scale * (q - zero): the offset plane -zero * scale left out (as_zero_point)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (what a batch-1 step streams)."""
        return sum(a.nbytes for a in self.planes() if a is not None)

    def planes(self) -> tuple:
        """Every array it holds (None where absent), in the order of the dataclass fields."""
        return self.q, self.scale, self.offset, self.scale_super, self.offset_super

    @property
    def dtype(self) -> np.dtype:
        """The dtype it stands for (it dequantizes to float32), as a float weight's dtype."""
        return np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Its float32 values (numpy planes): a store that keeps floats widens it as it is."""
        return np.asarray(dequantize(self), dtype=dtype or np.float32)


def from_gguf(tensor, *, nibbles: bool = True) -> QuantWeight:
    """A 2-D tensor of gguf-py's GGUFReader (a view into the memory map) -> its QuantWeight."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest first
    if len(shape) != 2:
        raise ValueError(f"{tensor.name}: {len(shape)}-D; only matrices are packed")
    return repack(tensor.data, tensor.tensor_type.name, (shape[0], shape[1]), nibbles=nibbles)


def take_rows(w: QuantWeight, index: np.ndarray) -> QuantWeight:
    """W[index] (rows are independent in every kind): e.g. llama.cpp's q/k row permutation undone."""
    return _with_planes(w, len(index), [None if a is None else np.ascontiguousarray(a[index])
                                        for a in w.planes()])


def layout(w: QuantWeight) -> tuple:
    """What weights must share to be stacked into one (concat_rows; gpu/cpu/packed.py)."""
    return (w.qtype, w.kind, w.block, w.shape[1], w.zero,
            *(None if a is None else str(a.dtype) for a in w.planes()))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one layout stacked along rows (a fused qkv or gate_up), as np.concatenate."""
    first = parts[0]
    for w in parts[1:]:
        if layout(w) != layout(first):
            raise ValueError(f"cannot stack {w.qtype}/{w.kind} {w.shape} under {first.qtype}/{first.kind} "
                             f"{first.shape}")
    planes = [None if a is None else np.concatenate([w.planes()[i] for w in parts])
              for i, a in enumerate(first.planes())]
    return _with_planes(first, sum(w.shape[0] for w in parts), planes)


def _with_planes(w: QuantWeight, rows: int, planes: list) -> QuantWeight:
    """w with `rows` rows held in `planes` (QuantWeight.planes' order): the one way a weight is
    made from another."""
    q, scale, offset, scale_super, offset_super = planes
    return replace(w, shape=(rows, w.shape[1]), q=q, scale=scale, offset=offset, scale_super=scale_super,
                   offset_super=offset_super)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """Q4_0/Q4_1/Q5_x quant bytes [rows, blocks, 16] (byte j: weight j low, j + 16 high) ->
    uint8 values [rows, blocks * 32] in weight order."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1 qh bytes [rows, blocks, 4] (bit i of the uint32: weight i) -> 0/1 [rows, in]."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.reshape(n, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 scale bytes [rows, blocks, 12] -> 6-bit scales and mins [rows, blocks, 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def to_u4(values: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [rows, in] (in a multiple of 64) -> the u4 plane [rows, in / 2]."""
    g = values.reshape(values.shape[0], -1, 2, 32)
    return np.ascontiguousarray(g[:, :, 0] | (g[:, :, 1] << 4)).reshape(values.shape[0], -1)


def _four_bit(qtype: str, values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
              nibbles: bool, shape: tuple[int, int]) -> QuantWeight:
    """A 4-bit type (values 0..15; Q4_0's weight is scale * (value - 8)) as u4 nibbles when asked
    and ``in`` fills whole 64-weight groups, else as int8."""
    zero = 8 if qtype == "Q4_0" else 0
    if nibbles and shape[1] % 64 == 0:
        if zero:  # folded into an offset (exact: see the module doc)
            offset = np.float32(-zero) * scale
        return QuantWeight(qtype, shape, "u4", to_u4(values), scale, offset, 32)
    q = (values.astype(np.int16) - zero).astype(np.int8)  # NOTE: q - zero is exact in int8
    return QuantWeight(qtype, shape, "i8", q, scale, offset, 32)


def repack(raw: np.ndarray, qtype: str, shape: tuple[int, int], *, nibbles: bool = True,
           factored: bool = False) -> QuantWeight:
    """The raw GGUF bytes of a tensor (any shape holding out * row-bytes uint8, as GGUFReader's
    ``tensor.data``) of type ``qtype`` and logical shape (out, in) -> its packed QuantWeight.
    nibbles: keep 4-bit types (Q4_0, Q4_1, Q4_K) as u4 nibbles (else int8 planes: 1.25 instead of
    0.75 bytes a weight, faster at batch 1, slower from 4: docs/bench_quant.md).
    factored: the K-quants' scales as int8 factors of float32 super planes (the module doc)."""
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"GGUF type {qtype} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    n, k = shape
    bs, ts = BLOCK_SIZES[qtype]
    if k % bs:
        raise ValueError(f"{qtype}: a row of {k} weights is not a whole number of {bs}-weight blocks")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != n * (k // bs) * ts:
        raise ValueError(f"{qtype} {shape}: {data.size} bytes, expected {n * (k // bs) * ts}")
    if qtype == "F32":
        return QuantWeight(qtype, shape, "f32", data.view(np.float32).reshape(n, k))
    if qtype in ("F16", "BF16"):
        return QuantWeight(qtype, shape, qtype.lower(), data.view(np.uint16).reshape(n, k))
    b = data.reshape(n, k // bs, ts)
    return _REPACK[qtype](b, n, shape, nibbles, factored)


def _k_quant(qtype: str, shape: tuple[int, int], kind: str, q: np.ndarray, block: int, factored: bool,
             d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None = None,
             mn: np.ndarray | None = None) -> QuantWeight:
    """A K-quant from its super-blocks' d (and dmin), float32 [out, in / 256], and its sub-blocks'
    integer scales sc (and mins mn) [out, in / 256, subs]: scale = d * sc, offset = -(dmin * mn)
    in float32, or (factored) sc and mn as int8 planes with d and -dmin as the super planes."""
    n = shape[0]
    if factored:  # NOTE: sc, mn fit int8 in every K-quant (6-bit, or Q6_K's own int8)
        return QuantWeight(qtype, shape, kind, q, sc.astype(np.int8).reshape(n, -1),
                           None if mn is None else mn.astype(np.int8).reshape(n, -1), block,
                           np.ascontiguousarray(d), None if dmin is None else -dmin)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    offset = None if mn is None or dmin is None else -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return QuantWeight(qtype, shape, kind, q, scale, offset, block)


def _q8_0(b, n, shape, nibbles, factored):
    return QuantWeight("Q8_0", shape, "i8", b[..., 2:].copy().view(np.int8).reshape(n, -1), _f16(b[..., 0:2]),
                       None, 32)


def _q4_0(b, n, shape, nibbles, factored):
    return _four_bit("Q4_0", _nibbles(b[..., 2:], n), _f16(b[..., 0:2]), None, nibbles, shape)


def _q4_1(b, n, shape, nibbles, factored):
    return _four_bit("Q4_1", _nibbles(b[..., 4:], n), _f16(b[..., 0:2]), _f16(b[..., 2:4]), nibbles, shape)


def _q5(b, n, shape, qtype: str):
    has_min = qtype == "Q5_1"
    qh, qs = (b[..., 4:8], b[..., 8:]) if has_min else (b[..., 2:6], b[..., 6:])
    values = _nibbles(qs, n) | (_high_bits(qh, n) << 4)
    zero = 0 if has_min else 16
    q = (values.astype(np.int16) - zero).astype(np.int8)
    offset = _f16(b[..., 2:4]) if has_min else None
    return QuantWeight(qtype, shape, "i8", q, _f16(b[..., 0:2]), offset, 32)


def _q4_k(b, n, shape, nibbles, factored):
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    qs = b[..., 16:].reshape(n, -1)
    if nibbles:  # 4 groups of 32 bytes a block, weight 64g + j low, 64g + 32 + j high: the u4 order
        return _k_quant("Q4_K", shape, "u4", qs.copy(), 32, factored, d, sc, dmin, mn)
    g = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (g & 15).astype(np.int8).reshape(n, -1)
    return _k_quant("Q4_K", shape, "i8", q, 32, factored, d, sc, dmin, mn)


def _q5_k(b, n, shape, nibbles, factored):
    sc, mn = _k_scales(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:]
    groups = qs.reshape(n, -1, 4, 32)
    low = np.stack([groups & 15, groups >> 4], axis=3)                    # [n, blk, 4, 2, 32]
    high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1                # [n, blk, 8, 32]
    q = (low.reshape(n, -1, 8, 32) | (high << 4)).astype(np.int8).reshape(n, -1)
    return _k_quant("Q5_K", shape, "i8", q, 32, factored, _f16(b[..., 0:2]), sc, _f16(b[..., 2:4]), mn)


def _q6_k(b, n, shape, nibbles, factored):
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    low = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 15).reshape(n, -1, 8, 32)
    high = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 3).reshape(n, -1, 8, 32)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, -1)
    return _k_quant("Q6_K", shape, "i8", q, 16, factored, d, sc.copy().view(np.int8))


def _q3_k(b, n, shape, nibbles, factored):
    hmask, qs, scales, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    lo = scales[..., 0:8, None] >> np.array([0, 4], dtype=np.uint8)            # [n, blk, byte, shift]
    hi = scales[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)
    lo, hi = (a.transpose(0, 1, 3, 2).reshape(n, -1, 16) for a in (lo, hi))  # shift-major, as ggml
    sc = ((lo & 15) | ((hi & 3) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    qm = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(n, -1, 8, 32).astype(np.int8) - ((qm ^ 1) << 2).astype(np.int8)
    return _k_quant("Q3_K", shape, "i8", q.reshape(n, -1), 16, factored, d, sc)


def _q2_k(b, n, shape, nibbles, factored):
    scales, qs, d, dmin = b[..., 0:16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    return _k_quant("Q2_K", shape, "i8", q.astype(np.int8).reshape(n, -1), 16, factored, d, scales & 15, dmin,
                    scales >> 4)


# type -> its repacker (b: [out, blocks, block bytes]); nibbles: the 4-bit types', factored: the
# K-quants' (repack's arguments; the others take and ignore them)
_REPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
           "Q3_K": _q3_k, "Q2_K": _q2_k, "Q5_0": lambda b, n, s, *_: _q5(b, n, s, "Q5_0"),
           "Q5_1": lambda b, n, s, *_: _q5(b, n, s, "Q5_1")}


def dequantize(w: QuantWeight) -> np.ndarray:
    """float32 [out, in]: bit-identical to gguf-py's ``dequantize`` of the raw blocks (any form of
    the scale planes: float32, float16, int8 factors of super planes)."""
    n, k = w.shape
    if w.kind == "f32":
        return w.q
    if w.kind == "bf16":
        return (w.q.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if w.kind == "f16":
        return w.q.view(np.float16).astype(np.float32)
    if w.kind == "u4":
        g = w.q.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (g & 15).astype(np.float32).reshape(n, -1, w.block)
    elif w.kind == "u6":
        q = u6_values(w.q, k).astype(np.float32).reshape(n, -1, w.block)
    else:
        q = w.q.astype(np.float32).reshape(n, -1, w.block)
    scale = plane_values(w.scale, w.scale_super, w.block)
    assert scale is not None  # every quantized kind has scales
    out = scale[..., None] * q
    offset = plane_values(w.offset, w.offset_super, w.block)
    if w.zero:  # NOTE: the offset plane as_zero_point left out, as the kernels make it (exact)
        offset = np.float32(-w.zero) * scale
    if offset is not None:
        out = out + offset[..., None]
    return out.reshape(n, k)


def plane_values(plane: np.ndarray | None, super_: np.ndarray | None, block: int) -> np.ndarray | None:
    """A scale or offset plane [out, in / block] as float32 values: float32 as it is, float16
    widened (exact), int8 factors times their super plane [out, in / 256] (the float32 product
    quant.cu's plane_at computes)."""
    if plane is None:
        return None
    values = plane.astype(np.float32, copy=False)
    if super_ is None:
        return values
    return values * np.repeat(super_, QK_K // block, axis=1)


def as_halves(w: QuantWeight) -> QuantWeight:
    """w with its float32 scale and offset planes as float16 when every value of both is exactly
    a half (the legacy types' GGUF f16 fields; Q4_0's -8 d unless it overflows; GPTQ's s and
    -8 s), else w as it is: half the bytes of the planes, the same values. Works on any xp's
    arrays (numpy here, cupy for planes made on the device)."""
    planes = [a for a in (w.scale, w.offset) if a is not None]
    if not planes or w.scale_super is not None or any(a.dtype != np.float32 for a in planes):
        return w
    with np.errstate(over="ignore"):  # NOTE: a value past 65504 becomes inf: inexact, so kept
        halves = [a.astype(np.float16) for a in planes]
    if not all(bool((h.astype(np.float32) == a).all()) for h, a in zip(halves, planes, strict=True)):
        return w
    return replace(w, scale=halves[0], offset=halves[1] if w.offset is not None else None)


def as_zero_point(w: QuantWeight, zero: int = 8) -> QuantWeight:
    """w without its offset plane where every offset is exactly -zero * scale (Q4_0's folded
    -8 d; GPTQ's -8 s when every group's zero point is 8): weight = scale * (q - zero), the raw
    block's bytes (Q4_0 0.5625 B/weight with fp16 scales, GPTQ 0.516), else w as it is. The
    values are the same bits: dequantize and the kernels make the offset -zero * scale in
    float32, exactly the plane's value. Any xp's arrays."""
    scale, offset = w.scale, w.offset
    if w.kind != "u4" or scale is None or offset is None or w.scale_super is not None or w.zero:
        return w
    if offset.dtype != scale.dtype or not bool((offset == scale * -zero).all()):
        return w
    return replace(w, offset=None, zero=zero)


# The "u6" plane (the CUDA store's Q6_K, 0.75 B/weight of quants instead of int8's 1): uint8
# [out, 3 in / 4], a row's u4 nibble plane of v & 15 (in / 2 bytes) followed by its high bits v >> 4
# (in / 4 bytes), where v = q + 32 (0..63). 16 high bytes a 64-weight group g: byte i holds, at bits
# 2j, the high bits of weight 64 g + 16 j + i (j = 0..3: the group's four 16-weight runs, in the
# order quant.cu's mat-vec reads the nibble plane: low nibbles of bytes 0-15 and 16-31, then high).
U6_CENTRE = 32


def to_u6(q: np.ndarray) -> np.ndarray:
    """int8 quants -32..31 [rows, in] (in a multiple of 64) -> the u6 plane [rows, 3 in / 4]."""
    n, k = q.shape
    v = (q.astype(np.int16) + U6_CENTRE).astype(np.uint8)
    high = (v >> 4).reshape(n, -1, 4, 16) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return np.concatenate([to_u4(v & 15), np.bitwise_or.reduce(high, axis=2).reshape(n, -1)], axis=1)


def u6_values(plane: np.ndarray, k: int) -> np.ndarray:
    """The u6 plane [rows, 3 k / 4] -> int8 quants -32..31 [rows, k] (to_u6 undone)."""
    n = plane.shape[0]
    low = (plane[:, :k // 2].reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    high = (plane[:, k // 2:].reshape(n, -1, 1, 16) >> shifts) & 3
    v = low.reshape(n, -1) | (high.reshape(n, -1) << 4)
    return (v.astype(np.int16) - U6_CENTRE).astype(np.int8)


def as_u6(w: QuantWeight) -> QuantWeight:
    """A Q6_K weight's int8 plane as the u6 plane (its scales as they are) where rows are whole
    64-weight groups, else w as it is: 0.828 B/weight with factored scales, not 1.078."""
    if w.qtype != "Q6_K" or w.kind != "i8" or w.shape[1] % 64 or not isinstance(w.q, np.ndarray):
        return w  # NOTE: planes already on the device (gpu_check's) are made in their form there
    return replace(w, kind="u6", q=to_u6(w.q))


# Byte offsets of each type's f16 fields in its block (d, dmin, m): the only bytes that can make a
# block invalid (inf / nan); every other byte pattern is a valid block.
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_raw(qtype: str, shape: tuple[int, int], rng: np.random.Generator,
               scale: float = 0.05) -> np.ndarray:
    """Random raw GGUF bytes [out, row bytes] of a valid tensor (tests, benchmarks): random bytes,
    with the f16 fields set to finite values ~ N(0, scale) (floats: N(0, 1))."""
    n, k = shape
    bs, ts = BLOCK_SIZES[qtype]
    if qtype in ("F32", "F16"):
        return rng.standard_normal((n, k)).astype(np.float32 if qtype == "F32" else np.float16).view(np.uint8)
    if qtype == "BF16":
        bits = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> np.uint32(16)
        return bits.astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (n, k // bs * ts), dtype=np.uint8)
    blocks = raw.reshape(n, k // bs, ts)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((n, k // bs, 1)) * scale).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8)
    return raw
