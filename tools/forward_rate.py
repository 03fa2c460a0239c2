"""The forward's decode rate of a model folder, timed as gpu_check times its graphs rows (the
forward and sampling on the device, B token ids back to the host; no scheduler, no rings, no
HTTP): the reference tools/serve_sweep.py divides the served out tok/s by (issue 28's item 4:
ring loadgen at >= 85 % of it, HTTP at >= 90 % of ring).

    python -m ringserve.tools.forward_rate --model DIR [--device cuda] [--batches 1,8,64,256]
        [--context 192] [--json PATH]

The runner is the server's (gpu/runner.py ModelRunner: the checkpoint's dtype, CUDA graphs up
to the largest batch, the model's max_model_len), each request `context` tokens deep (the serve
sweep passes its prompt plus half its output: the mean depth of a 128 in / 128 out request).
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits
from ringserve.tools.gpu_check import decode_batch, greedy_metadata, time_steps

BLOCK_SIZE = 16


def forward_rates(model: Path, device: str, batches: list[int], context: int,
                  steps: int = 20) -> dict[int, float]:
    """Decode tok/s at each batch size (batch / the mean step time over `steps` steps)."""
    blocks = max(batches) * -(-(context + 1) // BLOCK_SIZE)
    runner = ModelRunner(model, DeviceConfig(device=device),
                         CacheConfig(num_gpu_blocks_override=blocks, block_size=BLOCK_SIZE),
                         StepLimits(max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(CUDA_MAX_NUM_BATCHED_TOKENS, max(batches))))
    rates = {}
    for B in batches:
        step = partial(_decode_step, runner, decode_batch(B, BLOCK_SIZE, context), np.arange(B),
                       greedy_metadata(B))
        rates[B] = B / time_steps(step, steps)
    return rates


def _decode_step(runner, batch, rows, meta) -> None:
    runner.submit(batch, rows, meta).result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=192, help="tokens in the cache per request")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per batch size (after one warm-up)")
    ap.add_argument("--json", type=Path, help="write {batch: tok/s} here too")
    args = ap.parse_args(argv)
    rates = forward_rates(args.model, args.device, args.batches, args.context, args.steps)
    for B, r in rates.items():
        print(f"forward_rate: batch {B:>4}: {r:10.1f} tok/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({str(B): r for B, r in rates.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
