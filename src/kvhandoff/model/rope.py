"""Rotary position embedding as two pure functions: apply to content keys, strip from cached keys.

Frequencies come from transformers' own rope initialisers (`ROPE_INIT_FUNCTIONS`) so every rope type
(default, linear, dynamic, llama3, yarn, longrope, partial rotary) matches the model bit for bit.
"""

from __future__ import annotations

import copy

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvhandoff.errors import UnsupportedModelError


def rope_parameters(config) -> dict:
    """The config's rope parameters as one flat dict (transformers 5 keeps them in `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise UnsupportedModelError(
            f"{type(config).__name__} has no rope_parameters: kvhandoff needs a RoPE model "
            "(Llama, Qwen2/2.5, Qwen3, Mistral)."
        )
    if "rope_type" not in params:  # per-layer-type dict (mixed attention): refused upstream
        raise UnsupportedModelError(
            "per-layer-type RoPE parameters (mixed local/global attention) are not supported"
        )
    return dict(params)


def rope_frequencies(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32) and the attention scaling applied to cos/sin.

    `seq_len` matters only for types whose frequencies depend on the sequence length (dynamic, longrope).
    The default rope type is computed as linear scaling with factor 1, which is the same formula, over the whole
    head: the supported families' default RoPE rotates every dim whatever `partial_rotary_factor` says.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        config = copy.copy(config)
        params.pop("partial_rotary_factor", None)  # the linear initialiser would honour it, the models do not
        config.rope_parameters = {**params, "rope_type": "linear", "factor": 1.0}
        rope_type = "linear"
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(
            f"unknown rope type {rope_type!r}; supported: default, {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config, None, seq_len=seq_len)
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled cos/sin [batch, 1, tokens, rotary_dim] for positions [batch, tokens] (or [tokens]).

    Same operation order as transformers' rotary embedding, so apply_rope reproduces cached keys exactly.
    """
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * attention_scaling)[:, None], (emb.sin() * attention_scaling)[:, None]


def apply_rope(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Rotate content keys [batch, heads, tokens, head_dim] to `positions`, as the model's attention does.

    Dims beyond 2 * len(inv_freq) (partial rotary) pass through unchanged.
    """
    rotary_dim = 2 * inv_freq.numel()
    cos, sin = _cos_sin(positions, inv_freq, attention_scaling)
    dtype = keys.dtype
    rot, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
    rotated = rot * cos + rotate_half(rot) * sin
    return torch.cat((rotated.to(dtype), rest), dim=-1) if rest.numel() else rotated.to(dtype)


def strip_rope(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Inverse of `apply_rope`: rotate cached keys back by their positions and undo the scaling.

    With scaled cos/sin the inverse rotation returns scaling² · content, hence the division.
    """
    rotary_dim = 2 * inv_freq.numel()
    cos, sin = _cos_sin(positions, inv_freq, attention_scaling)
    dtype = keys.dtype
    rot, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
    content = (rot * cos - rotate_half(rot) * sin) / (attention_scaling * attention_scaling)
    return torch.cat((content.to(dtype), rest), dim=-1) if rest.numel() else content.to(dtype)
