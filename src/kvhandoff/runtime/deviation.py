"""How far a cache's rows are from the target's own, per position: the scores the deviation rules of
`kvhandoff.runtime.policy` rank by — at layer 0, computed from each token alone (`deviation_scores`), and at the
first context-dependent layer, the layers below run over the whole context (`blend_scores`, CacheBlend's)."""

from __future__ import annotations

import torch

from kvhandoff.model.geometry import decoder_layers
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.runtime.recompute import leading_layer_rows


@torch.inference_mode()
def layer0_kv(target_model, input_ids: torch.Tensor):
    """The target's own K (post-RoPE, at positions 0..T−1) and V of layer 0 [batch, kv_heads, T, head_dim]: a
    function of each token alone (embedding → input norm → projections), so no attention runs."""
    body = getattr(target_model, "model", target_model)
    layer = decoder_layers(target_model)[0]
    attn = layer.self_attn
    hidden = layer.input_layernorm(body.embed_tokens(input_ids))
    head_dim = attn.head_dim
    keys = attn.k_proj(hidden).unflatten(-1, (-1, head_dim))
    if hasattr(attn, "k_norm"):
        keys = attn.k_norm(keys)
    values = attn.v_proj(hidden).unflatten(-1, (-1, head_dim)).transpose(1, 2)
    inv_freq, scaling = rope_frequencies(target_model.config, seq_len=input_ids.shape[1])
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    keys = apply_rope(keys.transpose(1, 2), positions, inv_freq.to(keys.device), scaling)
    return keys, values


def relative_deviation(own_rows, cached_rows) -> torch.Tensor:
    """[batch, T]: each position's squared error of cached (K, V) against own (K, V), relative to the mean squared
    norm of the own (K and V weigh equally)."""
    scores = 0
    for own, cached in zip(own_rows, cached_rows, strict=True):
        own = own.float()
        error = (cached.float() - own).pow(2).sum(dim=(1, 3))
        scores = scores + error / own.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp_min(1e-12)
    return scores


def deviation_scores(target_model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, T]: how far each position's cached layer-0 K and V are from the target's own (`relative_deviation`)."""
    cached = cache.layers[0]
    own = layer0_kv(target_model, input_ids.to(cached.keys.device))
    return relative_deviation(own, (cached.keys, cached.values))


#: the layer whose K/V rule "blend" compares: the first whose rows depend on the context (layer 0's depend on each
#: token and its position alone)
BLEND_LAYER = 1


def blend_scores(target_model, cache, input_ids: torch.Tensor, layer: int = BLEND_LAYER) -> torch.Tensor:
    """[batch, T]: how far each position's cached K and V at ``layer`` are from the target's own there, the layers
    below computed over the whole context (CacheBlend's selection; costs about (layer + 1) / L of a prefill)."""
    cached = cache.layers[layer]
    own = leading_layer_rows(target_model, input_ids.to(cached.keys.device), layer + 1).layers[layer]
    return relative_deviation((own.keys, own.values), (cached.keys, cached.values))
