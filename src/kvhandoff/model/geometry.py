"""What kvhandoff needs to know about a model's KV cache, read once from a loaded transformers model.

Unsupported layouts are refused here, up front, with the reason named.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from kvhandoff.errors import IncompatiblePairError, UnsupportedModelError
from kvhandoff.files import sha256_json
from kvhandoff.model.rope import rope_frequencies, rope_parameters

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "ministral")

_REFUSED_REASONS = {
    "gemma3": "mixed local/global (sliding-window) attention",
    "gemma3_text": "mixed local/global (sliding-window) attention",
    "gemma2": "mixed local/global (sliding-window) attention",
    "cohere2": "mixed local/global (sliding-window) attention",
    "deepseek_v2": "multi-head latent attention (MLA) has no per-head K/V cache to map",
    "deepseek_v3": "multi-head latent attention (MLA) has no per-head K/V cache to map",
    "qwen3_next": "linear-attention hybrid layers keep recurrent state, not a KV cache",
    "jamba": "Mamba/attention hybrid layers keep recurrent state, not a KV cache",
    "falcon_h1": "Mamba/attention hybrid layers keep recurrent state, not a KV cache",
    "qwen3_5": "linear-attention hybrid layers keep recurrent state, not a KV cache",
}


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    rope_theta: float
    rotary_dim: int
    attention_scaling: float
    parameters: str  # JSON of the full rope parameters, for fingerprints


@dataclass(frozen=True)
class ModelGeometry:
    model_type: str
    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    has_k_norm: bool
    qkv_bias: bool
    rope: RopeSpec

    def to_dict(self) -> dict:
        return asdict(self)


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers (`model.model.layers` for every supported family)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no `.model.layers`; not a supported decoder LM"
        )
    return layers


def _refuse_unless_supported(config) -> None:
    model_type = getattr(config, "model_type", "?")
    if model_type in _REFUSED_REASONS:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: {_REFUSED_REASONS[model_type]}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; kvhandoff maps {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{model_type} config uses sliding-window attention in some layers "
            f"(layer_types={sorted(set(layer_types))}); only full attention in every layer is supported"
        )
    if model_type in ("mistral", "ministral") and getattr(config, "sliding_window", None):
        raise UnsupportedModelError(
            f"{model_type} config has sliding_window={config.sliding_window}: sliding-window attention is "
            "not supported (use a checkpoint with sliding_window=null)"
        )


def read_geometry(model) -> ModelGeometry:
    """Read the KV-cache geometry of a loaded causal LM, refusing unsupported attention layouts."""
    config = _text_config(model)
    _refuse_unless_supported(config)
    attn = decoder_layers(model)[0].self_attn
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = rope_parameters(config)
    inv_freq, scaling = rope_frequencies(config)
    return ModelGeometry(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        num_attention_heads=config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        has_k_norm=hasattr(attn, "k_norm"),
        qkv_bias=attn.k_proj.bias is not None,
        rope=RopeSpec(
            rope_type=params["rope_type"],
            rope_theta=float(params.get("rope_theta", 0.0)),
            rotary_dim=2 * inv_freq.numel(),
            attention_scaling=scaling,
            parameters=json.dumps(params, sort_keys=True, default=str),
        ),
    )


#: a text whose encoding tells apart tokenizers of one vocabulary that normalise or add special tokens differently
TOKENIZER_PROBE = "The quick brown fox, 12,345 times: \"naïve\" café!\n\nQ: why?\nA: because"


def tokenizer_hash(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary (token → id) and of how it encodes a probe text (special tokens
    included): what two paired models must share."""
    probe = list(tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=True))
    return sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "probe": probe})


@torch.no_grad()
def weight_signature(model) -> list[float]:
    """Mean |w| of a few K/V projections: tells apart checkpoints of identical shapes (base vs instruct)
    while tolerating a dtype change (compared with a relative tolerance, see `signatures_match`)."""
    layers = decoder_layers(model)
    picks = [layers[0].self_attn.k_proj, layers[-1].self_attn.k_proj, layers[-1].self_attn.v_proj]
    return [float(f"{p.weight.float().abs().mean().item():.6g}") for p in picks]


def signatures_match(a, b, rel_tol: float = 1e-2) -> bool:
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@torch.no_grad()
def weights_checksum(model) -> str:
    """Sum of a strided sample of every weight's values: tells apart checkpoints (and dtypes) exactly enough to
    key cached results, cheaply."""
    total = 0.0
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        total += float(flat[:: max(1, flat.numel() // 997)].double().sum())
    return f"{total:.9e}"


#: the fingerprint entries that say which model a mapper was fitted for (the rest also tell apart dtypes and
#: local copies, which a mapper tolerates)
PAIRING_KEYS = ("architecture", "geometry", "weights_hash", "weight_signature", "tokenizer_hash")


def model_fingerprint(model, tokenizer=None) -> dict:
    """The one identity of a model: architecture, geometry with RoPE, a hash of weight names/shapes, a weight
    signature (`PAIRING_KEYS`: what mapper manifests check), plus name, dtype, parameter count and a weight
    checksum (what keys cached statistics and results), and the tokenizer's hash when one is given.

    A model run by another engine (llama.cpp) carries the fingerprint of the transformers model of its weights as
    ``kvhandoff_fingerprint``: that one is returned."""
    known = getattr(model, "kvhandoff_fingerprint", None)
    if isinstance(known, dict):
        return {**known, "tokenizer_hash": tokenizer_hash(tokenizer) if tokenizer is not None else None}
    geometry = read_geometry(model)
    weights = sorted((name, list(p.shape)) for name, p in model.state_dict().items())
    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    return {
        "architecture": type(model).__name__,
        "geometry": geometry.to_dict(),
        "weights_hash": sha256_json(weights),
        "weight_signature": weight_signature(model),
        "tokenizer_hash": tokenizer_hash(tokenizer) if tokenizer is not None else None,
        "name": name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_checksum": weights_checksum(model),
    }


def check_pair(source_model, target_model, source_tokenizer=None, target_tokenizer=None) -> None:
    """Refuse pairs that cannot share token ids (and unsupported models, via read_geometry)."""
    source_fp = model_fingerprint(source_model, source_tokenizer)
    target_fp = model_fingerprint(target_model, target_tokenizer)
    s_vocab, t_vocab = source_fp["geometry"]["vocab_size"], target_fp["geometry"]["vocab_size"]
    if s_vocab != t_vocab:
        raise IncompatiblePairError(
            f"source and target have different vocabulary sizes ({s_vocab} vs {t_vocab}): a KV handoff "
            "needs both models to read the same token ids; pick two models of one family with one tokenizer"
        )
    if (
        source_fp["tokenizer_hash"]
        and target_fp["tokenizer_hash"]
        and (source_fp["tokenizer_hash"] != target_fp["tokenizer_hash"])
    ):
        raise IncompatiblePairError(
            "source and target tokenizers differ (different vocabularies): a KV handoff needs both models to "
            "read the same token ids; pick two models of one family with one tokenizer"
        )
