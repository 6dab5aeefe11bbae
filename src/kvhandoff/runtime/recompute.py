"""Selective recompute on a mapped cache (CacheBlend's sparse prefill, arXiv 2405.16444; EPIC, arXiv 2410.15332).

After a handoff the target's cache holds mapped K/V. `recompute_positions` lets the target run the tokens at a
chosen set S of positions through all its layers at their true positions: each attends to the cache at positions
up to its own (mapped K/V where not in S, its own fresh K/V where in S — a layer's fresh K/V are written before
that layer attends), and the fresh K/V replace the mapped ones in place. Cost ∝ |S| tokens (plus |S| × T
attention); S = every position gives the target's own prefill.

`leading_layer_rows` is the other axis (DroidSpeak, arXiv 2411.02820): the target's own K/V of its first layers at
every position, from a prefill that stops after the last of them; cost ∝ that share of the layers.

The source's attention (`record_queries`, `attention_from_queries`, `source_attention_scores`, `read_turn`) serves
the policies that rank positions by it (`kvhandoff.runtime.policy`), which choose the positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvhandoff.errors import ConfigError
from kvhandoff.model.attention import layers_received_attention
from kvhandoff.model.cache import cache_of, cache_view, model_device, prefill
from kvhandoff.model.capture import projection_hooks
from kvhandoff.model.geometry import decoder_layers

#: attention implementations whose masks a custom 4D additive mask replaces
MASKED_ATTENTION = ("eager", "sdpa")
#: the attention a sparse forward of an "sdpa" model runs (`stacked_query_attention`)
STACKED_SDPA = "kvhandoff_stacked_sdpa"


def stacked_query_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """sdpa for grouped-query attention under a mask that every head shares ([batch, 1, q, kv]): the query heads of
    each KV head are stacked along the query axis (the mask tiled to match) and attend to that KV head as it is,
    instead of every key and value being copied once per query head (transformers' `repeat_kv` for q > 1). The
    copies cost ∝ the cache length per layer — at 8K cached tokens more than the rest of a few-token forward — the
    stacking ∝ the queries. Same arithmetic; anything else goes to transformers' sdpa."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape
    stacked = query.reshape(batch, key.shape[1], groups * length, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1,
                                                                             groups * length, -1)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(STACKED_SDPA, stacked_query_attention)


@contextmanager
def _stacked_attention(model):
    """While active, an "sdpa" ``model`` attends through `stacked_query_attention` (a sparse forward's mask is shared
    by the heads). The model's forwards run one at a time (one worker per model), so switching its config is safe."""
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if previous == "sdpa":
        config._attn_implementation = STACKED_SDPA
    try:
        yield
    finally:
        if previous == "sdpa":
            config._attn_implementation = previous


# -- the sparse prefill --------------------------------------------------------------------------------------------


class _ScatterLayer(DynamicLayer):
    """A view of a cache layer for one forward whose first ``n`` tokens recompute given positions: `update` writes
    their K/V at those positions of the existing tensors (in place), appends the K/V of the tokens after them (new
    tokens read on top of the cache) and returns the whole, so the queries attend to everything cached."""

    def __init__(self, layer: DynamicLayer, positions: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.device, self.is_initialized = layer.keys, layer.values, layer.keys.device, True
        self._positions = positions[:, None, :, None]  # [batch, 1, n, 1]

    def update(self, key_states, value_states, *args, **kwargs):
        n = self._positions.shape[2]
        index = self._positions.expand(-1, key_states.shape[1], -1, key_states.shape[-1])
        self.keys.scatter_(2, index, key_states[:, :, :n].to(self.keys.dtype))
        self.values.scatter_(2, index, value_states[:, :, :n].to(self.values.dtype))
        if key_states.shape[2] > n:
            self.keys = torch.cat([self.keys, key_states[:, :, n:].to(self.keys.dtype)], dim=-2)
            self.values = torch.cat([self.values, value_states[:, :, n:].to(self.values.dtype)], dim=-2)
        return self.keys, self.values


def _as_positions(positions, batch: int, device) -> torch.Tensor:
    positions = torch.as_tensor(positions, dtype=torch.long, device=device)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(batch, -1)
    if positions.dim() != 2 or positions.shape[0] != batch:
        raise ConfigError(f"positions must be [n] or [batch={batch}, n], got {tuple(positions.shape)}")
    return positions


def takes_custom_mask(model) -> bool:
    """Whether ``model``'s attention takes a custom 4D additive mask (`MASKED_ATTENTION`), which a sparse prefill
    (`recompute_positions`, `recompute_and_read`) needs."""
    return (getattr(model.config, "_attn_implementation", None) or "eager") in MASKED_ATTENTION


def _checked_positions(target_model, cache, input_ids: torch.Tensor, positions) -> torch.Tensor:
    """``positions`` as [batch, n] sorted rows on the cache's device, checked against the cache of ``input_ids``."""
    layers = cache.layers
    batch, total = input_ids.shape
    if not layers or cache.get_seq_length() != total:
        raise ConfigError(f"the cache holds {cache.get_seq_length()} positions, input_ids {total}")
    positions = _as_positions(positions, batch, layers[0].keys.device)
    if not positions.numel():
        return positions
    if int(positions.min()) < 0 or int(positions.max()) >= total:
        raise ConfigError(f"positions must lie in 0..{total - 1}")
    if not takes_custom_mask(target_model):
        implementation = getattr(target_model.config, "_attn_implementation", None)
        raise ConfigError(f"selective recompute needs attention that takes a 4D mask ({', '.join(MASKED_ATTENTION)}), "
                          f"the target uses {implementation!r}: load it with attn_implementation='sdpa'")
    return positions.sort(dim=1).values


def _sparse_forward(target_model, cache, input_ids: torch.Tensor, positions: torch.Tensor, new_ids: torch.Tensor,
                    logits_to_keep: int):
    """One forward of the tokens at ``positions`` [batch, n] (recomputed in place, each at its own position) then
    ``new_ids`` [batch, N] (appended at T..T+N−1); each query attends to cached positions up to its own. Returns
    the model's output (``logits_to_keep`` 0: the body alone, no logits)."""
    layers = cache.layers
    device, dtype = layers[0].keys.device, layers[0].keys.dtype
    batch, total = input_ids.shape
    new = new_ids.shape[1]
    at = torch.cat([positions, torch.arange(total, total + new, device=device).expand(batch, -1)], dim=1)
    visible = torch.arange(total + new, device=device)[None, None, :] <= at[:, :, None]  # [batch, n + N, T + N]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    tokens = torch.cat([input_ids.to(device).gather(1, positions), new_ids.to(device)], dim=1)
    scatter = DynamicCache()
    scatter.layers.extend(_ScatterLayer(layer, positions) for layer in layers)
    model = target_model if logits_to_keep else getattr(target_model, "model", target_model)
    extra = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    with _stacked_attention(target_model):
        out = model(input_ids=tokens, position_ids=at, attention_mask=mask[:, None], cache=scatter, use_cache=True,
                    **extra)
    for layer, written in zip(layers, scatter.layers, strict=True):  # appended tokens made new tensors
        layer.keys, layer.values = written.keys, written.values
    return out


@torch.inference_mode()
def recompute_positions(target_model, cache, input_ids: torch.Tensor, positions) -> DynamicCache:
    """The target recomputes the K/V of the tokens at ``positions`` ([n] or [batch, n], each row distinct) of the
    cache of ``input_ids`` [batch, T] (cache length T), in place; returns ``cache``.

    The tokens at ``positions`` run through every layer at their own positions (RoPE at position_ids); at each
    layer their fresh K/V are written into the cache first, and each attends to cached positions ≤ its own (a 4D
    additive mask, for eager and sdpa attention). The cache length does not change.
    """
    positions = _checked_positions(target_model, cache, input_ids, positions)
    if positions.numel():
        empty = torch.empty(input_ids.shape[0], 0, dtype=torch.long, device=positions.device)
        _sparse_forward(target_model, cache, input_ids, positions, empty, 0)
    return cache


@torch.inference_mode()
def recompute_and_read(target_model, cache, input_ids: torch.Tensor, positions, new_ids: torch.Tensor,
                       logits_to_keep: int = 1) -> torch.Tensor:
    """`recompute_positions` and the target's reading of ``new_ids`` [batch, N ≥ 1] on top of the cache, in one
    forward: the same arithmetic as the two forwards in turn, but the target's weights are read once.

    The recomputed tokens attend to cached positions up to their own (never to the new tokens); the new tokens,
    at positions T..T+N−1, attend to the whole cache with the recomputed K/V written in (each layer writes them
    before it attends) and to the new tokens before them. The cache grows to T + N. Returns the logits of the
    last ``logits_to_keep`` new tokens [batch, keep, vocab]."""
    if new_ids.dim() != 2 or new_ids.shape[1] < 1 or new_ids.shape[0] != input_ids.shape[0]:
        raise ConfigError(f"new_ids must be [batch={input_ids.shape[0]}, N ≥ 1], got {tuple(new_ids.shape)}")
    if not 1 <= logits_to_keep <= new_ids.shape[1]:
        raise ConfigError(f"logits_to_keep must be in 1..{new_ids.shape[1]} (the new tokens), got {logits_to_keep}")
    positions = _checked_positions(target_model, cache, input_ids, positions)
    if not positions.numel():  # nothing to recompute: the plain read (any attention implementation)
        return target_model(input_ids=new_ids.to(positions.device), cache=cache, use_cache=True,
                            logits_to_keep=logits_to_keep).logits
    return _sparse_forward(target_model, cache, input_ids, positions, new_ids, logits_to_keep).logits


# -- whole layers ----------------------------------------------------------------------------------------------------


class _LayersDone(Exception):
    """Stops a forward once the layers asked for have written their K/V."""


def _stop(*_args) -> None:
    raise _LayersDone


@torch.inference_mode()
def leading_layer_rows(target_model, input_ids: torch.Tensor, count: int, past: DynamicCache | None = None
                       ) -> DynamicCache:
    """The target's own K/V of its first ``count`` layers for ``input_ids`` [batch, N], read on top of ``past`` (rows
    of the positions before them, at least those ``count`` layers; None: from position 0): a forward that stops after
    layer ``count`` − 1, so it costs about count / L of a prefill of the N tokens. A layer's own K/V depend only on
    the layers below it, so these are exactly what the target's full prefill would cache there. Returns the rows of
    the N positions, ``count`` layers."""
    layers = decoder_layers(target_model)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(layers):
        raise ConfigError(f"leading layers must be in 1..{len(layers)} (the target's layers), got {count!r}")
    if past is not None and len(past.layers) < count:
        raise ConfigError(f"the rows before the new positions hold {len(past.layers)} layers, need {count}")
    cache = DynamicCache() if past is None else cache_of((layer.keys, layer.values) for layer in past.layers[:count])
    start = cache.get_seq_length()
    body = getattr(target_model, "model", target_model)
    hook = layers[count - 1].register_forward_hook(_stop)
    try:
        body(input_ids=input_ids.to(model_device(target_model)), cache=cache, use_cache=True)
    except _LayersDone:
        pass
    finally:
        hook.remove()
    return cache_view(cache, start)


def with_leading_layers(rows: DynamicCache, target_model, input_ids: torch.Tensor, count: int,
                        past: DynamicCache | None = None) -> DynamicCache:
    """``rows`` (every layer's rows of the positions of ``input_ids``) with their first ``count`` layers replaced
    by the target's own (`leading_layer_rows`, read on top of ``past``); the other layers' rows as they are."""
    fresh = leading_layer_rows(target_model, input_ids, count, past)
    return cache_of([(layer.keys, layer.values) for layer in fresh.layers]
                    + [(layer.keys, layer.values) for layer in rows.layers[count:]])


# -- the source's attention ------------------------------------------------------------------------------------------


@contextmanager
def record_queries(model, window: int):
    """While active, keep the pre-RoPE queries of the last ``window`` tokens each layer of ``model`` sees in a
    forward ([batch, heads, ≤ window, head_dim] per layer; a later forward replaces them). Nothing is hooked
    outside the block, so an unused capture costs nothing."""
    records: list[torch.Tensor | None] = [None] * len(decoder_layers(model))

    def keep(_kind, index, queries):
        records[index] = queries[:, :, -window:].clone()

    with projection_hooks(model, "q", keep):
        yield records


@torch.inference_mode()
def attention_from_queries(model, queries, cache) -> torch.Tensor:
    """[batch, T]: the attention the recorded queries (the last ones of the T cached positions) paid each cached
    position, summed over layers, heads and queries (each query's weights sum to 1)."""
    if any(q is None for q in queries):
        raise ConfigError("no queries were recorded for a layer: record them during the source's forward")
    total, count = cache.get_seq_length(), queries[0].shape[2]
    at = torch.arange(total - count, total, device=queries[0].device)
    return layers_received_attention(model, queries, [cached.keys for cached in cache.layers], at)


@dataclass(frozen=True)
class TurnRead:
    """A model's read of a new turn on a cache it leaves as it was: ``scores`` [batch, T], the attention it paid
    each of the T cached positions (summed over layers, heads and the turn's tokens), and ``logprobs`` [batch, keep,
    vocab], the float32 log-probs after each of the turn's last ``keep`` tokens."""

    scores: torch.Tensor
    logprobs: torch.Tensor


def check_turn_read(tokens: int, keep, lookahead) -> None:
    """ConfigError unless ``keep`` is in 1..``tokens`` (the turn's) and ``lookahead`` a non-negative integer: what a
    turn read (`read_turn`, `KVCache.read_turn` in any engine) takes."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ConfigError(f"lookahead must be a non-negative integer, got {lookahead!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= tokens:
        raise ConfigError(f"keep must be an integer in 1..{tokens} (the turn's tokens), got {keep!r}")


@torch.inference_mode()
def read_turn(model, cache, new_turn: torch.Tensor, keep: int = 1, lookahead: int = 0) -> TurnRead:
    """``model`` reads ``new_turn`` [batch, N] (the turn the target reads next) on a view of ``cache`` (its own,
    or one handed to it; not changed): the attention it pays the cached positions and its log-probs after the
    turn's last ``keep`` tokens (`TurnRead`). Cost: ``model``'s forward of N tokens. One read serves a recompute
    policy that ranks by the attention and a guard that compares against the log-probs.

    ``lookahead`` > 0: ``model`` then answers that many tokens greedily on the same view, and the attention its
    answer's queries pay the T positions is added: an answer quoting the history looks at the span it quotes, which
    the question alone may only point near (speculative prefill, arXiv 2502.02789). Cost: that many decode steps.
    The log-probs stay those of the turn."""
    check_turn_read(new_turn.shape[1], keep, lookahead)
    total = cache.get_seq_length()
    view = cache_view(cache, 0)
    with record_queries(model, new_turn.shape[1]) as queries:
        logits = model(input_ids=new_turn.to(cache.layers[0].keys.device), cache=view, use_cache=True,
                       logits_to_keep=keep).logits
    scores = attention_from_queries(model, queries, view)[:, :total]
    next_logits = logits[:, -1]
    for _ in range(lookahead):
        with record_queries(model, 1) as queries:
            _, next_logits = prefill(model, next_logits.argmax(dim=-1, keepdim=True), view)
        scores = scores + attention_from_queries(model, queries, view)[:, :total]
    return TurnRead(scores, logits.float().log_softmax(-1))


def turn_attention_scores(model, cache, new_turn: torch.Tensor, lookahead: int = 0) -> torch.Tensor:
    """[batch, T]: the attention ``model`` pays each of the T positions of ``cache`` while it reads ``new_turn``
    [batch, N] on top of it (and answers ``lookahead`` tokens): `read_turn`'s ``scores``."""
    return read_turn(model, cache, new_turn, 1, lookahead).scores


@torch.inference_mode()
def source_attention_scores(source_model, source_cache, input_ids: torch.Tensor, window: int = 32) -> torch.Tensor:
    """[batch, T]: the attention the source's last ``window`` queries over the T cached positions paid each
    position, from its cache alone: the last ``window`` tokens are read again on a view of the cache before them
    (cost: ``window`` tokens; the cache is not changed). When the source prefills the history anyway, recording
    the queries then (`record_queries` + `attention_from_queries`) saves even that."""
    total = source_cache.get_seq_length()
    if input_ids.shape[1] != total:
        raise ConfigError(f"input_ids hold {input_ids.shape[1]} tokens, the source cache {total}")
    count = min(window, total)
    view = cache_view(source_cache, 0, total - count)
    with record_queries(source_model, count) as queries:
        prefill(source_model, input_ids[:, total - count :].to(source_cache.layers[0].keys.device), view)
    return attention_from_queries(source_model, queries, source_cache)
