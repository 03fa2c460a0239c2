"""A draft model on the CUDA backend without a GPU: the real engine (EngineCore, the scheduler,
engine/draft_proposer.py's catch-up and draft steps, the verify step) over the CUDA forward
compiled for the host (tests/test_cuda_forward_host.py's HostRunner: fused.cu and attention.cu
for the host, the model definition CudaModelRunner runs, steps shaped as CudaModelRunner._launch
shapes them: a decode or verify step its ladder holds as its graph replays it, else eager), for
the target and the draft alike. Greedy output with the draft is the plain engine's token for
token, and the drafts accepted at each position are the CPU backend's with the same two models.
The runner's own set-up with a draft (one stream, one pool size, the draft's decode graphs) is
tests/test_cuda_graph_memory.py's; the device sampler's rejection sampling is
tests/test_cuda_sampler.py's; on a GPU, tests/test_gpu_cuda.py."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.gpu.cuda import plan
from ringserve.gpu.sampling.sampler import sample_on_host
from ringserve.ipc.sampling_params import SamplingParams
from test_cuda_forward_host import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, SPEC_TOKENS, HostRunner

pytestmark = pytest.mark.sim
PROMPTS = [[1, 5, 9, 33, 7, 5, 9, 33], [1, 200, 3], [1] + list(range(40, 60))]


class HostCudaRunner:
    """The Runner face (gpu/runner.py) over HostRunner: logits from the CUDA forward on the
    host, a step through its graph's shape where the ladder holds it (CudaModelRunner._launch),
    sampled by the numpy sampler (greedy here: the device sampler's argmax is its own test's)."""
    device = "cuda"
    asynchronous = False

    def __init__(self, model_dir, cuda_host):
        self.host = HostRunner(model_dir, cuda_host)
        self.config, self.model_dir = self.host.config, model_dir
        self.block_size, self.num_blocks = BLOCK_SIZE, NUM_BLOCKS
        self.graph_steps = 0   # steps shaped as a graph replays them

    def _logits(self, batch) -> np.ndarray:
        table = self.host.decode if plan.is_decode_only(batch) else self.host.verify
        if table.fit(batch) is None:
            return self.host.eager(batch)
        self.graph_steps += 1
        return self.host.graph_shaped(batch)

    def execute(self, batch, logits_indices=None) -> np.ndarray:
        if logits_indices is not None:
            batch = replace(batch, sample_indices=np.asarray(logits_indices, np.int32))
        return self._logits(batch)

    def submit(self, batch, rows, metadata, prompt_logprobs=None):
        assert prompt_logprobs is None
        return sample_on_host(self._logits(batch), rows, metadata)


def _config(target, draft=None) -> EngineConfig:
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": SPEC_TOKENS,
                                       "disable_by_batch_size": 4}
    return EngineConfig.create(model=str(target), device="cpu", max_model_len=MAX_MODEL_LEN,
                               block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=4,
                               speculative_config=spec)


def _generate(core: EngineCore, max_tokens: int = 14) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[str(i)] for i in range(len(PROMPTS))]


def _first_layer(model_dir: Path, out: Path) -> Path:
    """model_dir's embeddings, norm, head, tokenizer and first layer only: an early-exit draft,
    right now and then."""
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if not k.startswith("model.layers.")
                   or k.startswith("model.layers.0.")}, str(out / "model.safetensors"), metadata=f.metadata())
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    for f in model_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


# the target itself (every draft right), its first layer (some right, some rejected)
@pytest.mark.parametrize("draft_name", ["tied-g3", "early-exit"])
def test_a_draft_model_on_the_cuda_forward_is_exact_and_accepts_as_the_cpu(tiny_cuda_models, cuda_host,
                                                                          draft_name, tmp_path):
    target = tiny_cuda_models("tied-g3")
    draft = _first_layer(target, tmp_path) if draft_name == "early-exit" else tiny_cuda_models(draft_name)
    plain = _generate(EngineCore(_config(target), runner=HostCudaRunner(target, cuda_host)))
    runner, draft_runner = HostCudaRunner(target, cuda_host), HostCudaRunner(draft, cuda_host)
    core = EngineCore(_config(target, draft), runner=runner, draft_runner=draft_runner)
    assert core.draft_runner is draft_runner
    assert _generate(core) == plain
    stats = core.scheduler.speculation.stats
    # the CPU backend, target and draft alike: the same drafts accepted at each position
    cpu = EngineCore(_config(target, draft))
    assert _generate(cpu) == plain
    cpu_stats = cpu.scheduler.speculation.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (cpu_stats.num_draft_tokens, cpu_stats.num_accepted_tokens, cpu_stats.accepted_per_pos)
    assert stats.num_draft_tokens > 20, stats
    if draft_name == "tied-g3":   # drafting for itself: every draft right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if draft_name == "early-exit":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    # the draft's one-token draft steps and the target's verify steps replayed as graphs
    assert draft_runner.graph_steps > 0 and runner.graph_steps > 0
