"""Re-quantize a GGUF into one weight type, as `llama-quantize --pure` does: every 2-D weight in
TYPE (a K-quant where its rows allow: `K_FALLBACK`), the norms (1-D) left in float32, the
metadata copied with general.file_type updated.

    python -m ringserve.tools.quantize_gguf SRC.gguf Q4_K OUT.gguf

Each matrix is read as float32 (gguf-py's `dequantize`) and written in TYPE: the legacy types,
F16 and BF16 by gguf-py's `quantize` (ggml's reference rounding), the K-quants by
tools/kquants.py (plain scales, not llama-quantize's searched ones). The use here is measuring
what each type the CPU backend keeps packed costs in perplexity (tools/perplexity.py,
docs/quality.md) on the default model, whose only published file is Q4_1: its weights are
re-quantized from those Q4_1 values, not from the original bfloat16 ones.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from ringserve.tools.kquants import K_TYPES, QK_K, quantize_k

# What llama-quantize writes where a row is not a whole number of 256-weight super-blocks
# (SmolLM2's 576-wide rows: every matrix but ffn_down): llama_tensor_get_type's fallbacks, except
# that Q2_K/Q3_K fall back to IQ4_NL there, a type the CPU backend does not keep: Q4_0 here
# (the same 4.5 bits a weight).
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_TYPES)
# llama.cpp's LLAMA_FTYPE_MOSTLY_* for general.file_type
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
              "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "BF16": 32}


def matrix_type(type_name: str, cols: int) -> str:
    return K_FALLBACK[type_name] if type_name in K_FALLBACK and cols % QK_K else type_name


def quantize_matrix(weights: np.ndarray, type_name: str) -> np.ndarray:
    if type_name in K_TYPES:
        return quantize_k(weights, type_name)
    return quantize(weights, gguf.GGMLQuantizationType[type_name])


def requantize(src: str | Path, type_name: str, out: str | Path) -> None:
    if type_name not in GGUF_TYPES:
        raise ValueError(f"type must be one of {', '.join(GGUF_TYPES)}, got {type_name!r}")
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(FILE_TYPES[type_name])
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)          # float32 [.., ne0], ggml's row order
        if values.ndim == 2:
            kind = matrix_type(type_name, values.shape[1])
            writer.add_tensor(t.name, quantize_matrix(values, kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(t.name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringserve.tools.quantize_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a GGUF file")
    p.add_argument("type", choices=GGUF_TYPES)
    p.add_argument("out", help="the GGUF to write")
    args = p.parse_args(argv)
    requantize(args.src, args.type, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
