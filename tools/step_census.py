"""Every launch of one CUDA decode step (a graph replay), without a GPU: the kernels and geometry
the runner's launch plan gives (gpu/cuda/step_plan.py, through gpu/cuda/census.py's run of the
model sequence), the bytes each reads and writes, and the step's floor at a copy bandwidth:

    python -m ringserve.tools.step_census --shape 8B --batch 1 [--context 512] [--dtype fp16|bf16]
    python -m ringserve.tools.step_census --shape 8B --batch 1 --speculative-tokens 3   # a verify step
    python -m ringserve.tools.step_census --shape 8B --batch 1 --format q4_k_m          # packed weights

Shapes: gpu_check's 1B and 8B (Llama-3.2-1B, Llama-3-8B) and tools/random_gguf.py's (read as
Llama-shaped: their dims, head size and rotary size), or --model-dir for a real config.json
(Qwen3's q/k norm, Qwen2's bias, Phi's partial rotary, sliding windows). The split count is the
graph's (planned for --max-model-len on --num-sms SMs, as CudaModelRunner.capture_graphs).
--speculative-tokens K: speculative decoding's verify step as its graph replays it (1 + K tokens
and rows of logits per request: gpu/cuda/plan.py GraphTable.shape).
--format keeps the linears packed as the CUDA store uploads them (gpu/cuda/quant_linear.py
QuantStore; each linear's type as tools/gpu_check.py quant_type gives it: Q4_K_M's Q4_K and Q6_K
mix): each launch is quant.cu's kernel of the crossover table and its weights column the packed
bytes it reads (the planes' bytes a weight measured on a QuantStore-form weight of each type).
"""
from __future__ import annotations

import argparse
import sys

from ringserve.gpu.cuda.census import Census, Packed, Row, census_for
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.settings import ATTENTION_BACKENDS

COPY_GBPS = 4268.0  # an H200's measured device-to-device copy (issue 28)
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "float16": "float16", "bfloat16": "bfloat16"}
FORMATS = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "awq": "AWQ"}  # --format -> gpu_check's format
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")


def packed_format(fmt: str, c: ModelConfig) -> Packed:
    """census_for's `packed` for gpu_check's format: each HF linear (and a GGUF format's embedding
    and lm_head) as (type, plane kind, bytes), the bytes a weight of a 16 x 256 weight of that
    type in QuantStore's form (gpu_check.random_planes, which makes that form) times its size."""
    import numpy as np

    from ringserve.tools.gpu_check import quant_type, random_planes
    per_type: dict[str, tuple[str, float]] = {}

    def form(qtype: str) -> tuple[str, float]:
        if qtype not in per_type:
            w = random_planes(np, np.random.default_rng(0), qtype, 16, 256)
            per_type[qtype] = (w.kind, w.nbytes / (16 * 256))
        return per_type[qtype]

    def packed(name: str, shape: tuple) -> tuple[str, str, int] | None:
        parts = name.split(".")
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            if fmt == "AWQ":  # NOTE: AWQ checkpoints keep both fp16
                return None
            short, layer = ("lm_head" if name.startswith("lm_head") else "embed"), 0
        elif len(parts) > 4 and ".".join(parts[3:5]) in _LINEARS:
            short, layer = ".".join(parts[3:5]), int(parts[2])
        else:
            return None
        qtype = quant_type(fmt, short, layer, c.num_hidden_layers)
        kind, per_weight = form(qtype)
        return qtype, kind, round(per_weight * shape[0] * shape[1])
    return packed


def shape_names() -> list[str]:
    from ringserve.tools import gpu_check, random_gguf
    return sorted(gpu_check.SHAPES) + sorted(random_gguf.SHAPES)


def config_for(name: str) -> ModelConfig:
    """A named shape's config: gpu_check's own (1B, 8B), or random_gguf's dims as a Llama."""
    from ringserve.tools import gpu_check, random_gguf
    if name in gpu_check.SHAPES:
        return gpu_check.config_for(gpu_check.SHAPES[name])
    s = random_gguf.SHAPES[name]
    extra = {} if s.rotary_dim is None else dict(partial_rotary_factor=s.rotary_dim / s.dim)
    return ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=s.hidden, intermediate_size=s.ffn,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        head_dim=s.dim, vocab_size=s.vocab, rms_norm_eps=1e-5, rope_theta=s.rope_theta,
        max_position_embeddings=s.context, tie_word_embeddings=s.tied, bos_token_id=1, eos_token_id=2,
        **extra))


def _mb(n: int) -> str:
    return f"{n / 1e6:10.3f}"


def _dims(d: tuple[int, ...]) -> str:
    return "x".join(map(str, d)) if d else "-"  # cuBLAS picks its own


def _line(i: int, r: Row) -> str:
    t = r.traffic
    where = "-" if r.layer is None else str(r.layer)
    return (f"{i:4d} {where:>5} {r.op:<14} {r.launch.kernel:<28} {_dims(r.launch.grid):>12} x "
            f"{_dims(r.launch.block):<7}{_mb(t.weights)}{_mb(t.kv_read)}{_mb(t.kv_written)}"
            f"{_mb(t.act_read)}{_mb(t.act_written)}")


def report(name: str, census: Census, bandwidth_gbps: float = COPY_GBPS, every_layer: bool = False) -> str:
    c = census.config
    total = census.total()
    lines = [f"step census: {name} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
             f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads of {c.head_dim}, ffn "
             f"{c.intermediate_size}, vocab {c.vocab_size}), {census.dtype}, batch {census.batch}"
             + (f" verifying {census.speculative_tokens} drafts each ({census.num_tokens} tokens)"
                if census.speculative_tokens else "") + ", "
             f"context {census.context}; attention {census.attention_backend}, {census.splits} split(s)"
             + "".join(f" (window {w}: {n})" for w, n in census.window_splits.items()),
             f"{'#':>4} {'layer':>5} {'op':<14} {'kernel':<28} {'grid':>12} x {'block':<7}"
             f"{'weights MB':>10}{'kv rd MB':>10}{'kv wr MB':>10}{'act rd MB':>10}{'act wr MB':>10}"]
    for i, r in enumerate(census.rows):
        if every_layer or r.layer is None or r.layer == 0:
            lines.append(_line(i, r))
        elif r.layer == 1 and census.rows[i - 1].layer == 0:
            lines.append(f"{'':10} layers 1-{c.num_hidden_layers - 1}: layer 0's {census.per_layer} "
                         f"launches each")
    above = total.total - total.weights
    floor_ms = total.total / (bandwidth_gbps * 1e9) * 1e3
    lines += [f"launches per step: {len(census.rows)}; weights {total.weights / 1e9:.3f} GB; above them "
              f"{above / 1e6:.2f} MB: KV read {total.kv_read / 1e6:.2f}, KV written "
              f"{total.kv_written / 1e6:.3f}, activations read {total.act_read / 1e6:.2f} and written "
              f"{total.act_written / 1e6:.2f}"
              + (f" (split-K partials {census.partial_bytes / 1e6:.2f} of them)"
                 if census.partial_bytes else ""),
              f"launches per layer: {census.per_layer}; bytes per step: {total.total / 1e9:.3f} GB; "
              f"floor at {bandwidth_gbps:g} GB/s: {floor_ms:.3f} ms"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringserve.tools.step_census",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=shape_names(), default="8B")
    p.add_argument("--model-dir", help="a model folder: its config.json instead of --shape")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="keys each request attends to (default 512)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--format", choices=sorted(FORMATS), default=None,
                   help="linears kept packed in this format (quant.cu); default: dense fp16/bf16")
    p.add_argument("--max-model-len", type=int, default=2048, help="the graphs' (gpu_check's: 2048)")
    p.add_argument("--num-sms", type=int, default=132, help="the device's SMs (an H200: 132)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--bandwidth", type=float, default=COPY_GBPS, help="GB/s the floor is taken at")
    p.add_argument("--every-layer", action="store_true", help="list every layer's launches")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="a verify step of speculative decoding: 1 + K tokens a request (default 0: decode)")
    a = p.parse_args(argv)
    if a.batch < 1 or a.context < 1:
        p.error("--batch and --context must be at least 1")
    if a.speculative_tokens < 0:
        p.error("--speculative-tokens must be at least 0")
    config = ModelConfig.from_dir(a.model_dir) if a.model_dir else config_for(a.shape)
    census = census_for(config, batch=a.batch, context=a.context, dtype=DTYPES[a.dtype],
                        max_model_len=a.max_model_len, num_sms=a.num_sms,
                        attention_backend=a.attention_backend, speculative_tokens=a.speculative_tokens,
                        packed=packed_format(FORMATS[a.format], config) if a.format else None)
    name = (a.model_dir or a.shape) + (f" {a.format}" if a.format else "")
    print(report(name, census, a.bandwidth, a.every_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
