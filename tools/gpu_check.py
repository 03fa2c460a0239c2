"""One command for a GPU machine (issue 6): the `gpu` tests, then a benchmark table.

    python -m ringserve.tools.gpu_check [--json FILE] [--skip-tests] [--budget-s 360]

1. pytest -m gpu (kernels vs references, graphs == eager, greedy == CPU backend).
2. Decode-step time at batch 1/16/64/256 for random-weight Llama shapes (~1B, ~8B; weights
   made on the GPU), eager vs CUDA graphs; transformers (torch) on the same shapes as the peer
   when it is installed; paged-attention read bandwidth vs a measured device-to-device copy.
Without a CUDA device it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

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


def config_for(shape: dict):
    from ringserve.gpu.config import ModelConfig
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


def decode_batch(B: int, block_size: int):
    import numpy as np
    from ringserve.gpu.batch import Batch
    nb = -(-(CONTEXT + 1) // block_size)
    tables = np.arange(B * nb, dtype=np.int32).reshape(B, nb)
    pos = np.full(B, CONTEXT, np.int32)
    return Batch(np.ones(B, np.int32), pos, tables[:, CONTEXT // block_size] * block_size
                 + CONTEXT % block_size, np.arange(B + 1, dtype=np.int32),
                 np.full(B, CONTEXT + 1, np.int32), tables)


def time_steps(fn, n=20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def copy_bandwidth() -> float:
    import cupy as cp
    a = cp.empty(1 << 30, cp.uint8)
    b = cp.empty_like(a)
    cp.cuda.Device().synchronize()
    dt = time_steps(lambda: (b.__setitem__(Ellipsis, a), cp.cuda.Device().synchronize()), 10)
    return 2 * a.nbytes / dt  # read + write


def bench_ours(name, shape, rows, deadline) -> None:
    import cupy as cp
    from ringserve.gpu.cuda.runner import CudaModelRunner
    c = config_for(shape)
    w = random_weights(c)
    weight_bytes = sum(int(x.nbytes) for x in w.values())
    nb_needed = max(BATCHES) * (-(-(CONTEXT + 1) // 16))
    for eager in (True, False):
        if time.monotonic() > deadline:
            return
        r = CudaModelRunner(c, w, num_blocks=nb_needed, max_num_seqs=max(BATCHES),
                            max_model_len=2048, enforce_eager=eager)
        for B in BATCHES:
            b = decode_batch(B, 16)
            dt = time_steps(lambda: r.execute(b))
            rows.append(dict(model=name, impl="ringserve " + ("eager" if eager else "graphs"),
                             batch=B, step_ms=dt * 1e3, tok_s=B / dt, weight_bytes=weight_bytes))
        del r
        cp.get_default_memory_pool().free_all_blocks()


def bench_transformers(name, shape, rows, deadline) -> None:
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers/torch not installed: no peer row", file=sys.stderr)
        return
    cfg = LlamaConfig(**shape, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    for B in BATCHES:
        if time.monotonic() > deadline:
            break
        from transformers import DynamicCache
        ids = torch.ones((B, CONTEXT), dtype=torch.long, device="cuda")
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            step = torch.ones((B, 1), dtype=torch.long, device="cuda")

            def one():
                model(step, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
                cache.crop(CONTEXT) if isinstance(cache, DynamicCache) else None
            dt = time_steps(one, 10)
        rows.append(dict(model=name, impl="transformers", batch=B, step_ms=dt * 1e3, tok_s=B / dt))
    del model
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget-s", type=float, default=360.0)
    args = ap.parse_args(argv)
    device = cuda_device_name()
    if device is None:
        print("gpu_check: no CUDA device (CuPy sees none); nothing to check here. "
              "Run it on a machine with an NVIDIA GPU and `pip install -e .[cuda]`.", file=sys.stderr)
        return 1
    result = dict(device=device, date=time.strftime("%Y-%m-%d"), tests=None, rows=[])
    if not args.skip_tests:
        tests = Path(__file__).resolve().parent.parent / "tests" / "test_gpu_cuda.py"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests)])
        result["tests"] = "passed" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
    deadline = time.monotonic() + args.budget_s
    result["copy_GBps"] = copy_bandwidth() / 1e9
    for name, shape in SHAPES.items():
        bench_ours(name, shape, result["rows"], deadline)
        bench_transformers(name, shape, result["rows"], deadline)
    print(f"{device}  tests: {result['tests']}  d2d copy: {result['copy_GBps']:.0f} GB/s")
    print(f"{'model':6} {'impl':20} {'batch':>5} {'step ms':>9} {'tok/s':>10} {'%bound':>7}")
    for r in result["rows"]:
        bound = (r["weight_bytes"] / (result["copy_GBps"] * 1e9) * 1e3 / r["step_ms"] * 100
                 if "weight_bytes" in r else float("nan"))
        print(f"{r['model']:6} {r['impl']:20} {r['batch']:>5} {r['step_ms']:>9.3f} "
              f"{r['tok_s']:>10.0f} {bound:>7.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["tests"] in (None, "passed") else 1


if __name__ == "__main__":
    sys.exit(main())
