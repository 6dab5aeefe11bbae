"""KV-cache primitives every handoff path shares: prefill, feed, roll back, views, building a cache from
tensors, and the KL between a model's next-token distributions on two caches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def model_device(model) -> torch.device:
    """Where ``model``'s input ids go: the device of its token embedding (with a device map the layers may sit on
    several devices; accelerate moves activations between them, but the ids must start where the embedding is)."""
    try:
        return model.get_input_embeddings().weight.device
    except AttributeError:
        pass
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, cache=None):
    """Run `model` over `input_ids` [batch, tokens]; return (cache, logits of the last position [batch, vocab])."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1]


def feed(model, cache, ids: Sequence[int]) -> torch.Tensor:
    """Run ``ids`` through ``model`` on top of ``cache`` (extended in place); float32 log-probs [len(ids), V]."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model_device(model))
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    if out.cache is not cache:  # transformers extends the cache in place; be strict about it
        raise RuntimeError("the model returned a new cache object instead of extending the given one")
    return out.logits[0].float().log_softmax(-1)


def rollback(cache, length: int) -> None:
    """Drop cached positions beyond ``length``."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot roll a cache of {cache.get_seq_length()} tokens back to {length}")
    if extra:
        cache.crop(-extra)  # transformers 5: a negative count of tokens to remove


def cache_of(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A `DynamicCache` holding the given (keys, values) [batch, kv_heads, tokens, head_dim] per layer as they
    are (no copy), as `DynamicLayer.update` would have filled it."""
    cache = DynamicCache()
    for keys, values in layers:
        layer = DynamicLayer()
        layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
        cache.layers.append(layer)
    return cache


def cache_copy(cache) -> DynamicCache:
    """A `DynamicCache` with copies of ``cache``'s keys and values (changing one leaves the other as it was)."""
    return cache_of((layer.keys.clone(), layer.values.clone()) for layer in cache.layers)


def cache_view(cache, start: int, end: int | None = None) -> DynamicCache:
    """A `DynamicCache` of the positions ``start``..``end`` (exclusive; None: to the end) of ``cache`` (views,
    no copy)."""
    return cache_of((layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in cache.layers)


def kl_divergence(own_logprobs: torch.Tensor, mapped_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(own ‖ mapped) per position, in nats, from log-probabilities [..., vocab] (the last axis is summed)."""
    return (own_logprobs.exp() * (own_logprobs - mapped_logprobs)).sum(-1)
