"""The attention each key position receives: what ranks positions for selective recompute and weights the rows
of an attention-weighted calibration."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvhandoff.model.geometry import decoder_layers
from kvhandoff.model.rope import apply_rope, rope_frequencies

#: query rows scored at once: bounds the [batch, heads, rows, keys] logits of a long read
QUERY_CHUNK = 256


def received_attention(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """[batch, T]: the attention weight each of T key positions receives, summed over heads and queries.

    queries [batch, heads, n, head_dim] and keys [batch, kv_heads, T, head_dim] both carry RoPE at their positions
    (the keys at 0..T−1, the queries at ``query_positions`` [n]); a query at position p sees the keys at ≤ p (causal),
    and each query's weights sum to 1. Grouped-query heads share their KV head, as in the model's attention."""
    keys = keys.float().repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    total = keys.shape[2]
    received = torch.zeros(queries.shape[0], total, device=queries.device)
    for start in range(0, queries.shape[2], QUERY_CHUNK):
        rows, at = queries[:, :, start : start + QUERY_CHUNK].float(), query_positions[start : start + QUERY_CHUNK]
        logits = (rows @ keys.transpose(2, 3)) * scaling
        logits = logits.masked_fill(torch.arange(total, device=queries.device) > at[:, None], float("-inf"))
        received += logits.softmax(-1).sum(dim=(1, 2))
    return received


def layers_received_attention(model, queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
                              query_positions: torch.Tensor, rotate_keys: bool = False) -> torch.Tensor:
    """[batch, T]: `received_attention` summed over ``model``'s layers, from each layer's pre-RoPE queries [batch,
    heads, n, head_dim] at ``query_positions`` [n] and its keys [batch, kv_heads, T, head_dim] at 0..T−1 (carrying
    RoPE, as a cache holds them; content keys with ``rotate_keys``)."""
    tokens, device = keys[0].shape[2], keys[0].device
    inv_freq, scaling = rope_frequencies(model.config, seq_len=tokens)
    inv_freq = inv_freq.to(device)
    key_positions = torch.arange(tokens, device=device)
    total = None
    for layer, layer_queries, layer_keys in zip(decoder_layers(model), queries, keys, strict=True):
        if rotate_keys:
            layer_keys = apply_rope(layer_keys, key_positions, inv_freq, scaling)
        rotated = apply_rope(layer_queries, query_positions, inv_freq, scaling)
        received = received_attention(rotated, layer_keys, query_positions, layer.self_attn.scaling)
        total = received if total is None else total + received
    return total
