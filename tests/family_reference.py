"""What the family tests (test_qwen3, test_mistral, test_phi3, test_gemma3) share: a tiny random
checkpoint of a family (tools/tiny_models.py) run on the CPU backend with float32 activations
and compared with transformers' reference (tests/data/<name>_tiny/reference.npz, made once
offline by tools/make_reference.py): its greedy tokens, the argmax at every position over the
whole vocabulary, and the logits at every position for every column_stride-th vocabulary id.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.loader.gguf_convert import convert_gguf
from ringserve.gpu.loader.model_store import default_gguf_path
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits
from ringserve.tools.tiny_models import make_tiny_model, write_gguf

DATA = Path(__file__).parent / "data"
BLOCK = 16
RTOL = 1e-4  # relative to the largest logit: float32 against float32, another summation order

Case = tuple[list[int], int, np.ndarray, np.ndarray]  # a reference sequence: see sequences()


def load_reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}_tiny" / "reference.npz") as data:
        return {k: data[k] for k in data.files}


def reference_fixture(name: str):
    """A module fixture (bind it to a name in the test module): tests/data/<name>_tiny/reference.npz."""
    def ref() -> dict[str, np.ndarray]:
        return load_reference(name)
    return pytest.fixture(scope="module")(ref)


def folder_fixture(family: str):
    """A module fixture: the family's tiny checkpoint of tests/data/<family>_tiny/config.json."""
    def folder(tmp_path_factory, default_model_dir) -> Path:
        return tiny_folder(family, family, tmp_path_factory.mktemp(family) / "hf", default_model_dir)
    return pytest.fixture(scope="module")(folder)


def tiny_folder(family: str, name: str, folder: Path, tokenizer_dir: Path) -> Path:
    """The tiny checkpoint of tests/data/<name>_tiny/config.json, written into ``folder``."""
    return make_tiny_model(family, folder, config=DATA / f"{name}_tiny" / "config.json",
                           tokenizer_dir=tokenizer_dir)


def converted_gguf(family: str, folder: Path, out: Path, matrix_type: str = "F32") -> Path:
    """The folder written as the family's llama.cpp GGUF of ``matrix_type``, converted back by ours."""
    out.mkdir(parents=True, exist_ok=True)
    path = write_gguf(family, folder, out / f"tiny-{family}-{matrix_type}.gguf", default_gguf_path(),
                      matrix_type)
    return convert_gguf(path, out / "converted", progress=False)


def sequences(ref: dict[str, np.ndarray]) -> list[Case]:
    """(prompt + greedy tokens, prompt length, argmax [len], logit columns [len, vocab / stride])."""
    cut = np.cumsum(ref["sequence_lens"])[:-1]
    return list(zip([s.tolist() for s in np.split(ref["sequence_ids"], cut)], ref["prompt_lens"].tolist(),
                    np.split(ref["argmax"], cut), np.split(ref["logits_columns"], cut), strict=True))


def runner(model_dir: Path, activations: str = "float32", limits: StepLimits | None = None) -> ModelRunner:
    device = DeviceConfig(device="cpu", dtype="float32", cpu_activation_dtype=activations)
    return ModelRunner(model_dir, device, CacheConfig(num_gpu_blocks_override=8, block_size=BLOCK), limits)


def step(tokens: list[int], cached: int, blocks: list[int], window: int = 0) -> Batch:
    """One request's tokens cached.. scheduled (the rest already in the cache); with a window on
    every layer, its blocks wholly before the first scheduled token's window are -1 (freed), as
    the KV manager leaves them."""
    i32 = lambda x: np.array(x, dtype=np.int32)  # noqa: E731
    positions = list(range(cached, len(tokens)))
    freed = max(0, cached - window + 1) // BLOCK if window else 0
    table = [-1] * freed + blocks[freed:]
    return Batch(input_ids=i32(tokens[cached:]), positions=i32(positions),
                 slot_mapping=i32([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]),
                 query_start_loc=i32([0, len(positions)]), seq_lens=i32([len(tokens)]),
                 block_tables=i32([table]))


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def assert_rows_match(rows: dict[int, np.ndarray], argmax: np.ndarray, columns: np.ndarray,
                      stride: int) -> None:
    """Our logits at each position: transformers' argmax, and its columns within RTOL."""
    for position, logits in rows.items():
        assert int(logits.argmax()) == argmax[position]
        assert relative_error(logits[::stride], columns[position]) <= RTOL, f"position {position}"


def assert_greedy_decode_matches(model: ModelRunner, case: Case, blocks: list[int], stride: int,
                                 label: str) -> None:
    """Prefill in two chunks (the first 3 tokens, no logits kept, then the rest of the prompt),
    then decode one token at a time, greedily from our own logits: the tokens transformers
    generated, and its logits at every position (prefill and decode)."""
    seq, prompt_len, argmax, columns = case
    tokens, cached = seq[:3], 0
    rows = {}
    while len(tokens) <= len(seq):
        if cached == 0 and prompt_len > 3:  # the prompt's first chunk: no logits kept
            model.execute(step(tokens, 0, blocks))
            tokens, cached = seq[:prompt_len], 3
        logits = model.execute(step(tokens, cached, blocks))[0]
        rows[len(tokens) - 1] = logits
        cached = len(tokens)
        if len(tokens) == len(seq):
            break
        tokens = tokens + [int(logits.argmax())]
    assert tokens == seq, f"{label}: greedy tokens {tokens[prompt_len:]} != {seq[prompt_len:]}"
    assert_rows_match(rows, argmax, columns, stride)


def assert_served_decodes_as_reference(serve, folder: Path, case: Case, max_model_len: int = 256,
                                       prefix_hits: int = BLOCK) -> None:
    """`ringserve serve` on the folder (CPU, float32: the checkpoint's dtype): the engine's
    scheduler, paged cache and sampler give transformers' greedy tokens; asked again, the answer
    is the same and the prompt's whole blocks (at least ``prefix_hits`` tokens; 0: not looked
    for) come from the prefix cache."""
    import httpx

    from ringserve.server.tokenizer import Tokenizer

    seq, prompt_len, _, _ = case
    want = Tokenizer.from_dir(folder).decode(seq[prompt_len:], skip_special_tokens=True)
    url = serve(folder, "--workers", "1", "--max-model-len", str(max_model_len), "--device", "cpu",
                "--served-model-name", "tiny", "--drain-timeout", "2", timeout=300).url
    body = dict(model="tiny", prompt=seq[:prompt_len], max_tokens=len(seq) - prompt_len, temperature=0,
                ignore_eos=True)
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        if not prefix_hits:
            return
        for _ in range(50):  # the engine publishes its counters with its next stats
            hits = [float(line.split()[-1]) for line in c.get("/metrics").text.splitlines()
                    if "prefix_cache_hits" in line and not line.startswith("#")]
            if hits and hits[0] >= prefix_hits:
                break
            time.sleep(0.1)
    assert hits and hits[0] >= prefix_hits, hits
