"""Rotary position embedding: apply it to content keys, strip it from cached keys (`apply_rope`, `strip_rope`),
and, for a hot path that rotates many caches, one rotation (`rotate`) by cos/sin rows looked up in a per-model
table (`RopeTable`).

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin (inverse: − rotate_half(x)·sin), written per half so rotate_half is never
    materialised; negation is exact, so this is the model's rotation bit for bit. A new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    if inverse:
        out[..., :half] += x2 * sin[..., :half]
        out[..., half:] -= x1 * sin[..., half:]
    else:
        out[..., :half] -= x2 * sin[..., :half]
        out[..., half:] += x1 * sin[..., half:]
    return out


def scaled_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled cos/sin [..., tokens, rotary_dim] for integer positions [..., tokens].

    Same operation order as transformers' rotary embedding, so a rotation by them reproduces cached keys exactly.
    """
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def _rotation_for_heads(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scaled_cos_sin` as [batch, 1, tokens, rotary_dim] for positions [batch, tokens] (or [tokens])."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    cos, sin = scaled_cos_sin(positions, inv_freq, attention_scaling)
    return cos[:, None], sin[:, None]


def apply_rope(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Rotate content keys [batch, heads, tokens, head_dim] to `positions`, as the model's attention does.

    Dims beyond 2 * len(inv_freq) (partial rotary) pass through unchanged.
    """
    rotary_dim = 2 * inv_freq.numel()
    cos, sin = _rotation_for_heads(positions, inv_freq, attention_scaling)
    dtype = keys.dtype
    rot, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
    rotated = rotate(rot, cos, sin)
    return torch.cat((rotated.to(dtype), rest), dim=-1) if rest.numel() else rotated.to(dtype)


def strip_rope(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Inverse of `apply_rope`: rotate cached keys back by their positions and undo the scaling.

    With scaled cos/sin the inverse rotation returns scaling² · content, hence the division.
    """
    rotary_dim = 2 * inv_freq.numel()
    cos, sin = _rotation_for_heads(positions, inv_freq, attention_scaling)
    dtype = keys.dtype
    rot, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
    content = rotate(rot, cos, sin, inverse=True) / (attention_scaling * attention_scaling)
    return torch.cat((content.to(dtype), rest), dim=-1) if rest.numel() else content.to(dtype)


#: rope types whose frequencies do not depend on the sequence length: one table serves every context length
LENGTH_FREE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
#: a length-free table grows in steps of this many positions, so a growing context rebuilds it rarely
TABLE_STEP = 1024


class RopeTable:
    """One model's scaled RoPE cos/sin by position, computed once and looked up by position after.

    Rows are exactly what `apply_rope` computes for each position (the op is elementwise). Length-free rope types
    keep one table, grown in steps of `TABLE_STEP` positions; types whose frequencies depend on the sequence length
    (dynamic, longrope) get the table of the length asked for, rebuilt when it changes. A request on another
    device rebuilds the table there.
    """

    def __init__(self, config):
        self.config = config
        self.length_free = rope_parameters(config)["rope_type"] in LENGTH_FREE_ROPE_TYPES
        self._table: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def lookup(
        self, positions: torch.Tensor | None, tokens: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Scaled cos/sin [b, T, rotary_dim] for integer positions [b, T] (None: 0..tokens−1) and the attention
        scaling."""
        seq_len = tokens if positions is None else int(positions.max()) + 1
        cos, sin, scaling = self._rows(seq_len, torch.device(device))
        if positions is None:
            return cos[None, :tokens], sin[None, :tokens], scaling
        return cos[positions], sin[positions], scaling

    def _rows(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
        table = self._table
        if table is not None and table[0].device == device and (
            table[0].shape[0] >= seq_len if self.length_free else table[0].shape[0] == seq_len
        ):
            return table
        inv_freq, scaling = rope_frequencies(self.config, seq_len=seq_len)
        length = -(-seq_len // TABLE_STEP) * TABLE_STEP if self.length_free else seq_len
        cos, sin = scaled_cos_sin(torch.arange(length, device=device), inv_freq, scaling)
        self._table = (cos, sin, scaling)
        return self._table
