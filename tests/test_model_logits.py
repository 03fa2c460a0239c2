"""The CPU forward (gpu/runner.py) on the real default model reproduces transformers' logits.

The reference is computed live when torch and transformers are installed, else read from
tests/data/smollm2_reference.npz (made by tools/make_reference_logits.py, which also checked that
transformers gives identical logits from the original GGUF and from our converted folder).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig

REFERENCE = Path(__file__).parent / "data" / "smollm2_reference.npz"
BLOCK = 16
RTOL = 1e-4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref():
    with np.load(REFERENCE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def prompts(ref) -> list[list[int]]:
    return [a.tolist() for a in np.split(ref["prompt_ids"], np.cumsum(ref["prompt_lens"])[:-1])]


@pytest.fixture(scope="module")
def runner(default_model_dir) -> ModelRunner:
    return ModelRunner(default_model_dir,
                       DeviceConfig(device="cpu", dtype="float32", cpu_activation_dtype="float32"),
                       CacheConfig(block_size=BLOCK, num_gpu_blocks_override=32))


def batch(chunks: list[tuple[list[int], int, list[int]]]) -> Batch:
    """One step: per request (all its tokens, how many are already cached, its block ids);
    every not-yet-cached token is scheduled."""
    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    width = max(len(blocks) for _, _, blocks in chunks)
    for tokens, cached, blocks in chunks:
        for p in range(cached, len(tokens)):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(len(ids))
        lens.append(len(tokens))
        tables.append(blocks + [-1] * (width - len(blocks)))
    i32 = lambda x: np.array(x, dtype=np.int32)  # noqa: E731
    return Batch(input_ids=i32(ids), positions=i32(pos), slot_mapping=i32(slots), query_start_loc=i32(starts),
                 seq_lens=i32(lens), block_tables=i32(tables))


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def test_last_position_logits_match_stored_transformers(runner, prompts, ref):
    """All three prompts (one chat-templated) prefilled together in one packed batch."""
    assert "<|im_start|>assistant\n" in str(ref["prompt_texts"][2])
    blocks = [[3, 0], [7, 1, 12], [5, 9, 2, 20]]
    logits = runner.execute(batch([(p, 0, b) for p, b in zip(prompts, blocks, strict=True)]))
    assert logits.shape == (3, 49152) and logits.dtype == np.float32
    for ours, reference in zip(logits, ref["logits_last"], strict=True):
        assert relative_error(ours, reference) <= RTOL
        assert ours.argmax() == reference.argmax()


def test_chunked_prefill_and_decode_match_stored_transformers(runner, prompts, ref):
    """Each prompt fed in chunks of 1, 5, 2 and 8 tokens over an already cached prefix: the logits
    at each chunk's end (stored for every position, every 32nd vocabulary id)."""
    stride = int(ref["column_stride"])
    expected = np.split(ref["logits_every_position"], np.cumsum(ref["prompt_lens"])[:-1])
    sizes = [1, 5, 2, 8]
    for tokens, reference in zip(prompts, expected, strict=True):
        blocks, cached, step = [11, 4, 8, 30], 0, 0
        while cached < len(tokens):
            end = min(len(tokens), cached + sizes[step % len(sizes)])
            row = runner.execute(batch([(tokens[:end], cached, blocks)]))[0]
            assert relative_error(row[::stride], reference[end - 1]) <= RTOL, f"position {end - 1}"
            cached, step = end, step + 1


def test_live_transformers_logits(runner, prompts, default_model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    blocks = [[0, 1], [2, 3, 4], [5, 6, 7, 8]]
    ours = runner.execute(batch([(p, 0, b) for p, b in zip(prompts, blocks, strict=True)]))
    with torch.no_grad():
        for row, tokens in zip(ours, prompts, strict=True):
            reference = model(torch.tensor([tokens])).logits[0, -1].numpy()
            assert relative_error(row, reference) <= RTOL
