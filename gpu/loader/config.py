"""The model configuration, read from an HF ``config.json`` (Llama, Mistral, Ministral, Qwen2, Qwen3,
Phi-3, Gemma 3).

Anything we do not implement is refused here, by name, so that a model we would compute
wrongly never loads: an unknown architecture or layer type, a rope scaling type we lack, an
activation other than SiLU.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.gpu.errors import ModelError

# Architectures whose forward is the Llama one (Qwen2 adds a bias on q/k/v; Qwen3 an RMSNorm over
# each head's q and k before RoPE, and often a head_dim other than hidden / heads; Phi-3 stores
# qkv_proj and gate_up_proj fused, rotates part of each head and scales RoPE by LongRoPE).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM",
                           "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)  # qkv_proj and gate_up_proj as one tensor each
GEMMA3 = "Gemma3ForCausalLM"  # its own sequence: gpu/models/gemma3.py
# Gemma 3 4B-27B: a vision tower beside the text model; served text-only (gemma3_text_tower)
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults (a multimodal config's text_config lists only what
# differs from them)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
# Architectures that read sliding_window on every layer (Llama's transformers class ignores it;
# Phi-3.5 and Phi-4-mini write one >= max_position_embeddings, which is no window); Qwen2 and
# Qwen3 only with use_sliding_window set, and then only for layers >= max_window_layers.
_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MinistralForCausalLM", "Phi3ForCausalLM")
_OPTIONAL_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of config.json: "linear" (positions / factor), "llama3" or "longrope"
    (Phi-3: each frequency divided by its short or long factor, cos/sin times attention_factor;
    which factors a server uses: gpu/rope.py)."""
    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    fused_projections: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    rotary_dim: int = 0    # the leading dims of each head RoPE rotates (Phi-4-mini: 3/4); 0: head_dim
    rope_scaling: RopeScaling | None = None
    quantization: str | None = None  # "awq" | "gptq": int4 linears (gpu/loader/hf_quant.py)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu", or "gelu_tanh" (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5 (Gemma 3)
    # A query at position p reads keys k with p - sliding_window < k <= p in the layers whose
    # layer_types entry is "sliding_attention" (None: no window anywhere; () means all full).
    # Gemma 3's sliding layers also rotate by their own RoPE base, local_rope_theta, unscaled.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window, 0 for full attention (gpu/models/llama.py Layer.sliding_window)."""
        if self.sliding_window is None or not self.layer_types:
            return (0,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else 0 for t in self.layer_types)

    @property
    def uniform_window(self) -> int:
        """The sliding window when every layer has it, else 0: only then can KV blocks before
        the window be freed while a request runs (engine/kv_cache.py)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    def __post_init__(self) -> None:
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = _read_json(model_dir / "config.json")
        gen_path = model_dir / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = raw.get("architectures")
        if archs == [GEMMA3_MULTIMODAL]:
            raw, archs = gemma3_text_tower(raw), [GEMMA3]
        if archs == [GEMMA3]:
            raw = {**GEMMA3_TEXT_DEFAULTS, **raw}  # what Gemma3TextConfig fills in
        r = _Reader(raw)
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ModelError(f"config.json: architectures {archs!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        arch = archs[0]
        if raw.get("mlp_bias"):
            raise ModelError("config.json: mlp_bias true is not supported")
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        kv_heads = r.positive_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelError(f"config.json: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = r.positive_int("head_dim", hidden // heads if hidden % heads == 0 else None)
        if head_dim % 2:
            raise ModelError(f"config.json: head_dim {head_dim} must be even for rotary embeddings")

        num_layers = r.positive_int("num_hidden_layers")
        max_positions = r.positive_int("max_position_embeddings", 2048)
        extra = (_gemma3_fields(raw, num_layers) if arch == GEMMA3
                 else _llama_fields(raw, arch, num_layers, max_positions))
        rope_theta, rope_scaling, rotary_dim = _rope(raw, head_dim, extra.pop("rope_parameters", None))
        scheme = int4_scheme(raw.get("quantization_config"))  # anything else refused by name
        return cls(
            architecture=arch,
            vocab_size=r.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=r.float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=r.bool("tie_word_embeddings", arch == GEMMA3),  # Gemma's default
            bos_token_id=r.optional_int("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            attention_bias=(arch == "Qwen2ForCausalLM") or r.bool("attention_bias", False),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            fused_projections=arch in FUSED_ARCHITECTURES,
            rotary_dim=rotary_dim,
            rope_scaling=rope_scaling,
            quantization=None if scheme is None else scheme.method,
            **extra,
        )


INT4_GROUP_SIZE = 128   # AWQ's and GPTQ's group: gpu/loader/hf_quant.py unpacks them
INT4_SUPPORTED = ("AWQ (version gemm, bits 4, group_size 128, zero_point true); "
                  "GPTQ (bits 4, group_size 128, sym true, desc_act false)")


@dataclass(frozen=True)
class Int4Scheme:
    method: str          # "awq" | "gptq"
    group_size: int


def int4_scheme(cfg: Any) -> Int4Scheme | None:
    """config.json's quantization_config -> the scheme (None: not quantized); anything we do
    not compute exactly is a ModelError naming it."""
    if cfg is None:
        return None
    if isinstance(cfg, dict) and cfg.get("bits") == 4 and cfg.get("group_size") == INT4_GROUP_SIZE:
        method = cfg.get("quant_method")
        if (method == "awq" and cfg.get("zero_point", True) is True
                and str(cfg.get("version", "gemm")).lower() == "gemm"):
            return Int4Scheme("awq", INT4_GROUP_SIZE)
        if (method == "gptq" and cfg.get("desc_act", False) is False and cfg.get("sym", True) is True
                and cfg.get("checkpoint_format", "gptq") == "gptq"):
            return Int4Scheme("gptq", INT4_GROUP_SIZE)
    raise ModelError(f"config.json: quantization_config {json.dumps(cfg, sort_keys=True)} is not "
                     f"supported (supported: {INT4_SUPPORTED})")


# generation_config.json's sampling fields a request inherits when it leaves them out (vLLM's
# --generation-config auto): generation_config.json name -> the request's name. max_new_tokens
# becomes max_tokens, which the server applies as vLLM does: a cap on every request's
# max_tokens (server/protocol.py check_length), not only a default.
GENERATION_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                              "max_new_tokens": "max_tokens"}


def generation_defaults(choice: str, model_dir: str | Path) -> dict[str, Any]:
    """The default sampling parameters of vLLM's --generation-config (the server's flag, the
    offline LLM's argument): "auto" the model's generation_config.json, "vllm" none
    (SamplingParams' own), else a folder's generation_config.json ({} without one)."""
    if choice == "vllm":
        return {}
    folder = Path(model_dir if choice == "auto" else choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if not folder.is_dir():
            raise ModelError(f"--generation-config {choice}: no such folder")
        return {}
    raw = _read_json(path)
    out = {ours: raw[theirs] for theirs, ours in GENERATION_SAMPLING_FIELDS.items()
           if isinstance(raw.get(theirs), (int, float)) and not isinstance(raw.get(theirs), bool)}
    cap = out.get("max_tokens")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise ModelError(f"{path}: max_new_tokens must be a positive integer, got {cap!r}")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


class _Reader:
    """Typed access to config.json fields with errors that name the field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name, default)
        if value is None:
            value = default
        if value is self._MISSING or value is None:
            raise ModelError(f"config.json: missing field {name!r}")
        return value

    def positive_int(self, name: str, default: Any = _MISSING) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"config.json: {name} {value!r} must be a positive integer")
        return value

    def count(self, name: str, default: Any = _MISSING) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"config.json: {name} {value!r} must be a non-negative integer")
        return value

    def optional_int(self, name: str) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"config.json: {name} {value!r} must be a token id")
        return value

    def float(self, name: str, default: Any = _MISSING) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ModelError(f"config.json: {name} {value!r} must be a positive number")
        return float(value)

    def bool(self, name: str, default: Any = _MISSING) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise ModelError(f"config.json: {name} {value!r} must be true or false")
        return value


def _rope(raw: dict[str, Any], head_dim: int, params: Any = None) -> tuple[float, RopeScaling | None, int]:
    """(rope_theta, rope_scaling, rotary_dim). transformers >= 5 writes theta, the scaling and
    partial_rotary_factor into "rope_parameters"; older configs use top-level fields. params:
    Gemma 3's full_attention entry of rope_parameters."""
    params = raw.get("rope_parameters") if params is None else params
    scaling = dict(params) if isinstance(params, dict) else raw.get("rope_scaling")
    theta_source = params if isinstance(params, dict) and "rope_theta" in params else raw
    theta = _Reader(theta_source).float("rope_theta", 10000.0)
    rotary_dim = _rotary_dim(raw, params, head_dim)
    if scaling is None:
        return theta, None, rotary_dim
    if not isinstance(scaling, dict):
        raise ModelError(f"config.json: rope_scaling {scaling!r} must be an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None, rotary_dim
    r = _Reader(scaling)
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=r.float("factor")), rotary_dim
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3", factor=r.float("factor"), low_freq_factor=r.float("low_freq_factor"),
            high_freq_factor=r.float("high_freq_factor"),
            original_max_position_embeddings=r.positive_int("original_max_position_embeddings")), rotary_dim
    if rope_type in ("longrope", "su"):  # "su": Phi-3's first name for it (transformers maps it)
        return theta, _longrope(raw, scaling, rotary_dim), rotary_dim
    raise ModelError(f"config.json: rope_scaling type {rope_type!r} is not supported "
                     f"(default, linear, llama3 and longrope only)")


def _rotary_dim(raw: dict[str, Any], params: Any, head_dim: int) -> int:
    source = params if isinstance(params, dict) and "partial_rotary_factor" in params else raw
    fraction = _Reader(source).float("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * fraction)  # as transformers rounds it
    if fraction > 1.0 or rotary_dim < 2 or rotary_dim % 2:
        raise ModelError(f"config.json: partial_rotary_factor {fraction!r} gives {rotary_dim} rotary dims "
                         f"of head_dim {head_dim} (must be even, 2 to head_dim)")
    return rotary_dim


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], rotary_dim: int) -> RopeScaling:
    """LongRoPE as transformers computes it: the attention factor is the config's, else
    sqrt(1 + ln(s) / ln(original)) with s = factor, else max_position_embeddings / original."""
    r = _Reader(scaling)
    original = _Reader(scaling if "original_max_position_embeddings" in scaling else raw).positive_int(
        "original_max_position_embeddings")
    short, long = (_factors(scaling, name, rotary_dim) for name in ("short_factor", "long_factor"))
    s = r.float("factor") if scaling.get("factor") is not None else (
        _Reader(raw).positive_int("max_position_embeddings") / original)
    if scaling.get("attention_factor") is not None:
        attention = r.float("attention_factor")
    else:
        attention = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))
    return RopeScaling("longrope", factor=s, original_max_position_embeddings=original,
                       short_factor=short, long_factor=long, attention_factor=attention)


def _factors(scaling: dict[str, Any], name: str, rotary_dim: int) -> tuple[float, ...]:
    value = scaling.get(name)
    if (not isinstance(value, list) or len(value) != rotary_dim // 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value)):
        raise ModelError(f"config.json: rope_scaling {name} must be {rotary_dim // 2} positive numbers "
                         f"(rotary_dim / 2)")
    return tuple(float(x) for x in value)


def gemma3_text_tower(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json as its text model's: text_config, with the
    top level's token ids (its eos list has <end_of_turn>). Text-only requests run the text
    model exactly as the multimodal class runs them (no image token, causal masks);
    gpu/loader/weights.py load_weights takes the text model's tensors and leaves the vision
    tower's."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelError(f"config.json: {GEMMA3_MULTIMODAL} needs a text_config object (the text model's)")
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
    return {**text, **ids, "architectures": [GEMMA3]}


def _llama_fields(raw: dict[str, Any], arch: str, num_layers: int, max_positions: int) -> dict[str, Any]:
    """The Llama sequence's config fields: its activation checked (SiLU), its windows."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelError(f"config.json: hidden_act {hidden_act!r} is not supported (silu only)")
    window, layer_types = _windows(raw, arch, num_layers, max_positions)
    return {"sliding_window": window, "layer_types": layer_types}


def _gemma3_fields(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """What Gemma 3 adds to a Llama config (transformers' Gemma3TextConfig), each checked:
    layer_types (or the older sliding_window_pattern: every n-th layer full), the window, the
    two RoPE bases (transformers >= 5: rope_parameters per layer type; older: rope_theta +
    rope_scaling for full layers, rope_local_base_freq for sliding ones), GELU-tanh, and the
    softcaps Gemma 3 leaves null (Gemma 2's; refused)."""
    r = _Reader(raw)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(name) is not None:
            raise ModelError(f"config.json: {name} {raw[name]!r} is not supported (null only, as Gemma 3)")
    if raw.get("use_bidirectional_attention"):
        raise ModelError("config.json: use_bidirectional_attention true is not supported (causal only)")
    if raw.get("attention_bias"):
        raise ModelError("config.json: attention_bias true is not supported for Gemma 3 (false only)")
    types = raw.get("layer_types")
    if types is None:
        pattern = r.positive_int("sliding_window_pattern", 6)
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in types)):
        raise ModelError(f"config.json: layer_types must list {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} "
                         f"for each of the {layers} layers")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:
        full, local = params.get(FULL_ATTENTION) or {}, params.get(SLIDING_ATTENTION) or {}
        local_theta = _Reader(local).float("rope_theta", 10000.0)
        if local.get("rope_type", "default") != "default":
            raise ModelError(f"config.json: rope_parameters.{SLIDING_ATTENTION} rope_type "
                             f"{local['rope_type']!r} is not supported (default only)")
        full = {"rope_theta": 1_000_000.0, **full}
    else:
        local_theta = r.float("rope_local_base_freq", 10000.0)
        full = None
    return {"hidden_act": "gelu_tanh", "layer_types": tuple(types),
            "sliding_window": r.positive_int("sliding_window", 4096), "local_rope_theta": local_theta,
            "query_pre_attn_scalar": r.float("query_pre_attn_scalar", 256), "rope_parameters": full}


def _windows(raw: dict[str, Any], arch: str, num_layers: int,
             max_positions: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers derives them: Mistral slides every layer
    (an explicit layer_types interleaves, as Ministral-8B's config and vLLM read it); Ministral
    follows layer_types; Qwen2/Qwen3 slide layers >= max_window_layers, and only with
    use_sliding_window. A window >= max_position_embeddings is no window."""
    r = _Reader(raw)
    window: int | None = None
    if arch in _WINDOW_ARCHITECTURES or (arch in _OPTIONAL_WINDOW_ARCHITECTURES
                                         and r.bool("use_sliding_window", False)):
        window = r.positive_int("sliding_window") if raw.get("sliding_window") is not None else None
    if window is not None and window >= max_positions:
        window = None
    types = raw.get("layer_types")
    if types is None:
        if arch in _OPTIONAL_WINDOW_ARCHITECTURES:
            first = r.count("max_window_layers", 28) if window is not None else num_layers
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
        else:
            types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelError(f"config.json: layer_types must be a list of num_hidden_layers ({num_layers}) "
                         f"entries, not {str(types)[:60]}")
    for i, t in enumerate(types):
        if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ModelError(f"config.json: layer_types[{i}] {t!r} is not supported "
                             f"({FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} only)")
    if window is None:  # no window: every layer attends fully, whatever layer_types says
        types = [FULL_ATTENTION] * num_layers
    return window, tuple(types)


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                ids.append(token)
    return tuple(ids)
