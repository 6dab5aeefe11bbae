"""Content-space K/V: keys before RoPE (after k_norm where the model has one) and values, per layer."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvhandoff.geometry import decoder_layers, read_geometry
from kvhandoff.rope import rope_frequencies, strip_rope


@dataclass
class ContentKV:
    """Per-layer content-space keys and values, each [layers, batch, kv_heads, tokens, head_dim].

    `queries` (optional) are the pre-RoPE queries [layers, batch, heads, tokens, head_dim].
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[3]


def nonfinite_layers(tensor: torch.Tensor, dim: int) -> list[int]:
    """Indices along ``dim`` (a layer axis) of the slices that hold NaN or ±Inf."""
    finite = tensor.isfinite().movedim(dim, 0).reshape(tensor.shape[dim], -1).all(dim=1)
    return (~finite).nonzero().flatten().tolist()


def _heads_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, tokens, heads*head_dim] or [batch, tokens, heads, head_dim] → [batch, heads, tokens, head_dim]."""
    if x.dim() == 3:
        x = x.unflatten(-1, (-1, head_dim))
    return x.transpose(1, 2)


@contextmanager
def _record_projections(model, with_queries: bool):
    """Forward hooks that record each layer's pre-RoPE key, value (and query) projections."""
    head_dim = read_geometry(model).head_dim
    records: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "q": []}
    handles = []

    def recorder(kind):
        return lambda _module, _inputs, output: records[kind].append(_heads_first(output.detach(), head_dim))

    for layer in decoder_layers(model):
        attn = layer.self_attn
        handles.append(getattr(attn, "k_norm", attn.k_proj).register_forward_hook(recorder("k")))
        handles.append(attn.v_proj.register_forward_hook(recorder("v")))
        if with_queries:
            handles.append(getattr(attn, "q_norm", attn.q_proj).register_forward_hook(recorder("q")))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def capture_content_kv(model, input_ids: torch.Tensor, with_queries: bool = False) -> ContentKV:
    """Run the model once over `input_ids` [batch, tokens] and return its content-space K/V.

    Runs the decoder body only (no LM head: the vocab projection would dominate memory and time).
    """
    body = getattr(model, "model", model)
    with _record_projections(model, with_queries) as records:
        body(input_ids=input_ids, use_cache=False)
    return ContentKV(
        keys=torch.stack(records["k"]),
        values=torch.stack(records["v"]),
        queries=torch.stack(records["q"]) if with_queries else None,
    )


def cache_positions(num_tokens: int, batch: int = 1, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + num_tokens).expand(batch, num_tokens)


def cache_to_content(cache, model_config, position_ids: torch.Tensor | None = None) -> ContentKV:
    """Strip RoPE from a live transformers cache: content-space ContentKV of everything cached."""
    keys = torch.stack([layer.keys for layer in cache.layers])
    values = torch.stack([layer.values for layer in cache.layers])
    batch, tokens = keys.shape[1], keys.shape[3]
    if position_ids is None:
        position_ids = cache_positions(tokens, batch)
    inv_freq, scaling = rope_frequencies(model_config, seq_len=int(position_ids.max()) + 1)
    # strip_rope broadcasts over leading dims: positions [batch, tokens] → cos [batch, 1, tokens, dim]
    return ContentKV(keys=strip_rope(keys, position_ids, inv_freq, scaling), values=values)
