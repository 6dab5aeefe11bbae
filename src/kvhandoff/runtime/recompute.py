"""Selective recompute on a mapped cache (CacheBlend's sparse prefill, arXiv 2405.16444; EPIC, arXiv 2410.15332).

After a handoff the target's cache holds mapped K/V. `recompute_positions` lets the target run the tokens at a
chosen set S of positions through all its layers at their true positions: each attends to the cache at positions
up to its own (mapped K/V where not in S, its own fresh K/V where in S — a layer's fresh K/V are written before
that layer attends), and the fresh K/V replace the mapped ones in place. Cost ∝ |S| tokens (plus |S| × T
attention); S = every position gives the target's own prefill.

Which positions: the rules below rank the mapped positions (`RANKINGS`); a rule at a budget takes the first
`budget_count` of its ranking (`select`, and one function per rule: `sinks`, `recent`, `deviation`,
`source_attention`, `mix`). `apply_policy` runs a `config.RecomputePolicy` on a cache.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_view, prefill
from kvhandoff.model.capture import projection_hooks
from kvhandoff.model.geometry import decoder_layers
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.runtime.policy import RecomputePolicy

#: special tokens that open a chat turn (a role marker); `turn_marker_ids` looks them up in a tokenizer
TURN_MARKERS: tuple[str, ...] = (
    "<|im_start|>", "<|start_header_id|>", "[INST]", "<start_of_turn>", "<|user|>", "<|assistant|>", "<|system|>",
)
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


@dataclass(frozen=True)
class SelectionInfo:
    """What the rules may know beyond the cache and the tokens.

    start: the first mapped position; positions before it are the target's own (its exact prefix, or the cache it
        kept) and are never selected; the budget is a fraction of the T − start mapped positions.
    turn_starts: positions where a turn begins (shared by the batch), for "sinks".
    marker_ids: token ids that open a turn (e.g. `<|im_start|>`, see `turn_marker_ids`), for "sinks".
    source_attention: [batch, T] attention the source paid each position (`source_attention_scores`).
    """

    start: int = 0
    turn_starts: tuple[int, ...] = ()
    marker_ids: tuple[int, ...] = ()
    source_attention: torch.Tensor | None = field(default=None, compare=False)


def turn_marker_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the `TURN_MARKERS` the tokenizer has."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return tuple(vocab[token] for token in TURN_MARKERS if token in vocab)


def budget_count(budget: float, candidates: int) -> int:
    """Positions a budget (fraction of ``candidates``) buys: rounded half up, never more than there are."""
    if not 0 <= budget <= 1:
        raise ConfigError(f"a recompute budget is a fraction in [0, 1], got {budget!r}")
    return min(candidates, math.floor(budget * candidates + 0.5))


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


# -- rankings: every candidate position (start..T−1), most wanted first, [batch, T − start] ------------------------


def _positions(batch: int, total: int, start: int, device) -> torch.Tensor:
    return torch.arange(start, total, device=device).expand(batch, -1)


def _by_score(scores: torch.Tensor, start: int) -> torch.Tensor:
    """Candidates start..T−1 by descending score [batch, T] (ties: the earlier position first)."""
    candidates = scores[:, start:].float()
    order = torch.sort(-candidates, dim=1, stable=True).indices
    return order + start


def rank_sinks(target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
    """The first tokens of the context (from `start`) and of every turn, round-robin over the turns: first every
    turn start, then the token after each, and so on."""
    batch, total = input_ids.shape
    device = input_ids.device
    ids = torch.arange(total, device=device)
    starts = torch.zeros(batch, total, dtype=torch.bool, device=device)
    starts[:, info.start] = True
    turns = [p for p in info.turn_starts if info.start <= p < total]
    if turns:
        starts[:, turns] = True
    if info.marker_ids:
        starts |= torch.isin(input_ids, torch.tensor(info.marker_ids, device=device)) & (ids >= info.start)
    segment = torch.where(starts, ids, -1).cummax(dim=1).values  # the latest turn start at or before each position
    offset = ids - segment
    return _by_score(-(offset * total + ids).double(), info.start)


def rank_recent(target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
    """The latest tokens first."""
    batch, total = input_ids.shape
    return _positions(batch, total, info.start, input_ids.device).flip(1)


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


def deviation_scores(target_model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, T]: how far each position's cached layer-0 K and V are from the target's own, each squared error
    relative to the mean squared norm of the target's own (K and V weigh equally)."""
    own_keys, own_values = layer0_kv(target_model, input_ids.to(cache.layers[0].keys.device))
    scores = 0
    for own, cached in ((own_keys, cache.layers[0].keys), (own_values, cache.layers[0].values)):
        own = own.float()
        error = (cached.float() - own).pow(2).sum(dim=(1, 3))
        scores = scores + error / own.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp_min(1e-12)
    return scores


def rank_deviation(target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
    """The positions whose mapped K/V at the target's layer 0 deviate most from its own (`deviation_scores`)."""
    return _by_score(deviation_scores(target_model, cache, input_ids).to(input_ids.device), info.start)


def rank_source_attention(target_model, cache, input_ids: torch.Tensor, info: SelectionInfo) -> torch.Tensor:
    """The positions the source attended to most (``info.source_attention``, `source_attention_scores`)."""
    if info.source_attention is None:
        raise ConfigError("rule 'source_attention' needs the source's attention (SelectionInfo.source_attention, "
                          "from source_attention_scores); hand off with the source model and its cache")
    return _by_score(info.source_attention.to(input_ids.device), info.start)


RANKINGS = {
    "sinks": rank_sinks,
    "recent": rank_recent,
    "deviation": rank_deviation,
    "source_attention": rank_source_attention,
}


def _sorted_first(ranking: torch.Tensor, count: int) -> torch.Tensor:
    return ranking[:, :count].sort(dim=1).values


def _check_start(input_ids: torch.Tensor, info: SelectionInfo) -> None:
    if input_ids.dim() != 2 or not 0 <= info.start < input_ids.shape[1]:
        raise ConfigError(f"input_ids must be [batch, T] with start in 0..T−1, got {tuple(input_ids.shape)} and "
                          f"start {info.start}")


def select(rule: str, target_model, cache, input_ids: torch.Tensor, budget: float, info: SelectionInfo | None = None,
           mix=None) -> torch.Tensor:
    """The positions [batch, n] (each row sorted) ``rule`` picks at ``budget`` (a fraction of the mapped positions
    start..T−1; n = `budget_count`). ``mix``: (rule, share) pairs of rule "mix" (default: the policy's)."""
    info = info or SelectionInfo()
    _check_start(input_ids, info)
    batch, total = input_ids.shape
    count = budget_count(budget, total - info.start)
    if rule == "mix":
        return _select_mix(target_model, cache, input_ids, count, info, mix or RecomputePolicy().mix)
    if rule not in RANKINGS:
        raise ConfigError(f"unknown recompute rule {rule!r} (rules: {', '.join(RANKINGS)}, mix)")
    if count == 0:
        return torch.empty(batch, 0, dtype=torch.long, device=input_ids.device)
    return _sorted_first(RANKINGS[rule](target_model, cache, input_ids, info), count)


def _select_mix(target_model, cache, input_ids, count: int, info: SelectionInfo, mix) -> torch.Tensor:
    """Each rule of ``mix`` takes its share of ``count`` (largest remainders round), from its ranking, skipping
    what the rules before it took."""
    batch, total = input_ids.shape
    if count == 0:
        return torch.empty(batch, 0, dtype=torch.long, device=input_ids.device)
    exact = [share * count for _, share in mix]
    quotas = [math.floor(q) for q in exact]
    for i in sorted(range(len(mix)), key=lambda i: quotas[i] - exact[i])[: count - sum(quotas)]:
        quotas[i] += 1
    rows = []
    for row in range(batch):
        taken = torch.zeros(total, dtype=torch.bool, device=input_ids.device)
        for (rule, _), quota in zip(mix, quotas, strict=True):
            if quota == 0:
                continue
            ranking = RANKINGS[rule](target_model, cache, input_ids[row : row + 1], _row_info(info, row))[0]
            fresh = ranking[~taken[ranking]][:quota]
            taken[fresh] = True
        rows.append(taken.nonzero().flatten())
    return torch.stack(rows)


def _row_info(info: SelectionInfo, row: int) -> SelectionInfo:
    if info.source_attention is None:
        return info
    return replace(info, source_attention=info.source_attention[row : row + 1])


def _rule(name: str):
    def rule(target_model, cache, input_ids, budget, info=None):
        return select(name, target_model, cache, input_ids, budget, info)

    rule.__name__ = rule.__qualname__ = name
    rule.__doc__ = f"`select` with rule {name!r}: {RANKINGS[name].__doc__}"
    return rule


sinks = _rule("sinks")
recent = _rule("recent")
deviation = _rule("deviation")
source_attention = _rule("source_attention")


def mix(target_model, cache, input_ids, budget, info=None, shares=None):
    """`select` with rule "mix": each rule of ``shares`` ((rule, share) pairs; default the policy's) takes its share
    of the budget."""
    return select("mix", target_model, cache, input_ids, budget, info, mix=shares)


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
    total = cache.get_seq_length()
    inv_freq, scaling = rope_frequencies(model.config, seq_len=total)
    scores = None
    for layer, q, cached in zip(decoder_layers(model), queries, cache.layers, strict=True):
        if q is None:
            raise ConfigError("no queries were recorded for a layer: record them during the source's forward")
        count = q.shape[2]
        at = torch.arange(total - count, total, device=q.device)
        q = apply_rope(q, at, inv_freq.to(q.device), scaling).float()
        keys = cached.keys.float()
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        logits = (q @ keys.transpose(2, 3)) * layer.self_attn.scaling
        logits = logits.masked_fill(torch.arange(total, device=q.device) > at[:, None], float("-inf"))
        weights = logits.softmax(-1).sum(dim=(1, 2))
        scores = weights if scores is None else scores + weights
    return scores


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


# -- a policy on a cache ---------------------------------------------------------------------------------------------


def needs_source_attention(policy: RecomputePolicy) -> bool:
    return policy.active and "source_attention" in policy.rules


def policy_positions(policy, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo | None = None,
                     source_model=None, source_cache=None) -> torch.Tensor:
    """The positions [batch, n] a `RecomputePolicy` (or spec) picks on ``cache`` (of ``input_ids`` [batch, T];
    positions before ``info.start`` are the target's own), recomputing nothing. For "source_attention" without
    ``info.source_attention`` the scores come from ``source_model`` and ``source_cache``
    (`source_attention_scores`)."""
    policy = RecomputePolicy.parse(policy)
    info = info or SelectionInfo()
    if not policy.active:
        return torch.empty(input_ids.shape[0], 0, dtype=torch.long, device=input_ids.device)
    if needs_source_attention(policy) and info.source_attention is None:
        if source_model is None or source_cache is None:
            raise ConfigError("recompute rule 'source_attention' needs the source model and its cache")
        scores = source_attention_scores(source_model, source_cache, input_ids, policy.window)
        info = replace(info, source_attention=scores)
    return select(policy.rule, target_model, cache, input_ids, policy.budget, info, mix=policy.mix)


def apply_policy(policy, target_model, cache, input_ids: torch.Tensor, info: SelectionInfo | None = None,
                 source_model=None, source_cache=None) -> torch.Tensor:
    """Run a `RecomputePolicy` (or spec) on ``cache``: select the positions (`policy_positions`), recompute them in
    place. Returns the positions [batch, n]."""
    positions = policy_positions(policy, target_model, cache, input_ids, info, source_model, source_cache)
    if positions.numel():
        recompute_positions(target_model, cache, input_ids, positions)
    return positions
