"""Which model definition a checkpoint gets, by its architecture: the weight mapping (fuse) and the
layer sequence (hidden_states), for both runners (gpu/cpu/runner.py, gpu/cuda/runner.py) and the
host-shim forward. gpu/models/llama.py holds the Llama family (Llama, Mistral, Ministral, Qwen2,
Qwen3, Phi-3), gpu/models/ops.py the ops protocol every definition runs on; gpu/models/gemma3.py
holds Gemma 3.

RoPE tables come by layer type ({FULL_ATTENTION: (cos, sin), SLIDING_ATTENTION: ...}: gpu/rope.py
inv_freqs): a Llama has one, a Gemma 3 two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from ringserve.gpu.loader.config import FULL_ATTENTION, GEMMA3, ModelConfig
from ringserve.gpu.models.gemma3 import Gemma3Weights, gemma3_hidden_states
from ringserve.gpu.models.llama import LlamaWeights, hidden_states
from ringserve.gpu.models.ops import ModelOps, compute_logits

Weights = Union[LlamaWeights, Gemma3Weights]
Ropes = dict[str, tuple[Any, Any]]


def _llama_hidden_states(ops: ModelOps, w: LlamaWeights, buf, caches, attention, ropes: Ropes) -> None:
    cos, sin = ropes[FULL_ATTENTION]
    hidden_states(ops, w, buf, caches, attention, cos, sin)


@dataclass(frozen=True)
class ModelDefinition:
    fuse: Callable[..., Any]           # (config, HF tensors, WeightStore) -> weights
    hidden_states: Callable[..., None]  # (ops, weights, buf, caches, attention, ropes)

    def forward(self, ops: ModelOps, w: Any, buf, caches, attention, ropes: Ropes) -> None:
        """One step as a CUDA graph captures it: the hidden states, then buf.logits at each
        request's last token (buf.logits_indices)."""
        self.hidden_states(ops, w, buf, caches, attention, ropes)
        compute_logits(ops, w, buf.x, buf.logits_indices, buf.last, buf.logits16, buf.logits)


LLAMA = ModelDefinition(LlamaWeights.fuse, _llama_hidden_states)
GEMMA3_DEFINITION = ModelDefinition(Gemma3Weights.fuse, gemma3_hidden_states)


def model_definition(config: ModelConfig) -> ModelDefinition:
    return GEMMA3_DEFINITION if config.architecture == GEMMA3 else LLAMA
