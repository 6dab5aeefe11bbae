"""Handoff: the source prefills, the mapper converts its cache, the target decodes on.

The entry points: `map_for_target` (a `MappedCache` whose recompute is left to the target's next forward: `read`,
`generate` or `settle`), `catch_up` (a cache the target kept, brought up to date), and the thin wrappers
`handoff_cache` and `handoff_generate`; `kvhandoff.runtime.session.SwitchingSession` serves a conversation. What the
target recomputes comes from one `HandoffPlan`. Caches are touched only through the cache seam (`KVCache`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvhandoff.errors import ConfigError, ContextTooLongError, MapperMismatchError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import model_device
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.recompute import attention_from_queries, record_queries, with_leading_layers
from kvhandoff.runtime.seam import CacheFactory, KVCache, Pending, as_kv_cache, new_cache


def _check_ids(input_ids: torch.Tensor, minimum: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] < minimum:
        raise ConfigError(
            f"input_ids must be [batch, tokens] with at least {minimum} token(s), got {tuple(input_ids.shape)}"
        )


def verify_mapper(mapper, source_model=None, target_model=None) -> None:
    """MapperMismatchError unless ``mapper`` was fitted for these models; fingerprints each (mapper, model) pair
    once (`Mapper.check_models`). Objects that only offer ``transfer`` (stand-ins without a manifest) have
    nothing to check against and pass."""
    if isinstance(mapper, Mapper):
        mapper.check_models(source_model, target_model)


def check_context(length: int, target_model=None, mapper=None) -> None:
    """ContextTooLongError unless a context of ``length`` tokens fits the target's context window (its config's
    max_position_embeddings, and the one the mapper was fitted for)."""
    if isinstance(mapper, Mapper):
        mapper.check_context(length)
    limit = getattr(getattr(target_model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and length > limit:
        raise ContextTooLongError(
            f"a context of {length} tokens exceeds the target's max_position_embeddings ({limit}): shorten the "
            "context (drop earlier turns) or hand off to a model with a longer context window"
        )


def _check_target_cache(cache: KVCache, mapper) -> None:
    geometry = cache.geometry()
    if not isinstance(mapper, Mapper) or geometry is None:
        return
    tgt = mapper.target
    if geometry != (tgt.num_layers, tgt.num_kv_heads, tgt.head_dim):
        layers, heads, head_dim = geometry
        raise MapperMismatchError(
            f"the target cache has {layers} layers × {heads} KV heads × head dim {head_dim}, but this mapper maps to "
            f"{tgt.num_layers} × {tgt.num_kv_heads} × {tgt.head_dim}: use the mapper fitted for this target model"
        )


@torch.inference_mode()
def _prefill_prefix(cache: KVCache, target_model, input_ids: torch.Tensor, count: int) -> None:
    """Overwrite the first ``count`` cached positions with the target's own K/V of those tokens, by a prefill of
    them alone (exact: causal attention) — for a target that cannot recompute inside a forward."""
    count = min(count, input_ids.shape[1], cache.length)
    if count <= 0:
        return
    own = cache.empty()
    own.read(target_model, input_ids[:, :count].to(model_device(target_model)))
    cache.write(0, own.export())


def _recompute_leading_layers(cache: KVCache, target_model, input_ids: torch.Tensor, start: int,
                              plan: HandoffPlan) -> None:
    """The target's own K/V of its first layers (as many as the plan's policy recomputes) at positions start..T−1 of
    ``input_ids`` [batch, T], written over the mapped ones; positions before ``start`` are the target's own in those
    layers (its kept cache, or layers recomputed at an earlier switch), and the new ones are read on top of them."""
    geometry = cache.geometry()
    count = plan.recompute.leading_layers(geometry[0]) if geometry is not None else 0
    if not count or start >= input_ids.shape[1]:
        return
    if not isinstance(target_model, torch.nn.Module) or not cache.supports_recompute(target_model):
        raise ConfigError(f"recompute {plan.recompute.spec!r} runs the target's first layers in a transformers "
                          "forward, which this target cannot: choose a rule that picks positions (e.g. recent:5%)")
    past = cache.export(0, start) if start else None
    cache.write(start, with_leading_layers(cache.export(start), target_model, input_ids[:, start:], count, past))


def _nothing(input_ids: torch.Tensor | None, device) -> torch.Tensor:
    return torch.empty(1 if input_ids is None else input_ids.shape[0], 0, dtype=torch.long, device=device)


@dataclass
class MappedCache:
    """A freshly mapped target cache (``cache``, a `KVCache`) of ``input_ids`` [batch, T] whose ``pending`` positions
    [batch, n] (sorted rows: the exact prefix, then what the recompute policy picked) still hold mapped K/V that the
    target recomputes.

    The recompute is left to the target's next forward: `read` recomputes them and reads the new tokens in one
    forward (the target's weights are read once, not twice); `generate` does the same in `generate`'s first forward;
    `settle` recomputes them alone, for a caller that hands the cache on. Each empties ``pending``. With a
    ``prefix_store``, the first ``unstored_prefix`` positions (an exact prefix the store did not hold) go into it
    once recomputed."""

    cache: KVCache
    input_ids: torch.Tensor | None
    pending: torch.Tensor
    prefix_store: PrefixStore | None = None
    unstored_prefix: int = 0

    @classmethod
    def from_mapped(cls, cache, target_model, input_ids: torch.Tensor, mapper, plan: HandoffPlan | None = None,
                    selection_info: SelectionInfo | None = None, source_model=None, source_cache=None) -> MappedCache:
        """A freshly mapped ``cache`` of ``input_ids`` with the positions ``plan`` has the target recompute left
        pending: the exact prefix (None in the plan: the mapper's), then the recompute policy's picks among the rest
        (``source_model``/``source_cache`` serve a policy that ranks by the source's attention when
        ``selection_info`` carries none). A prefix the plan's store holds is copied in instead of left pending (else
        it is stored once recomputed). A target that cannot recompute inside a forward recomputes the exact prefix
        now, by a prefill of it (and cannot run a recompute policy): nothing is left pending."""
        plan = plan or DEFAULT_PLAN
        cache = as_kv_cache(cache)
        source = None if source_cache is None else as_kv_cache(source_cache)
        input_ids = input_ids.to(cache.device)
        _recompute_leading_layers(cache, target_model, input_ids, 0, plan)
        own = plan.prefix_length(mapper, input_ids.shape[1])
        positions = _pending_positions(cache, target_model, input_ids, own, plan, selection_info, source_model,
                                       source)
        store = plan.prefix_store
        stored = store.lookup(target_model, input_ids[:, :own], cache.dtype) if store is not None and own else None
        if stored is not None:
            cache.write(0, stored)
            positions, own = positions[:, own:], 0
        if not cache.supports_recompute(target_model):  # the prefix by a prefill; a policy's picks are refused
            _prefill_prefix(cache, target_model, input_ids, own)
            cache.recompute(target_model, Pending(input_ids, positions[:, own:]))
            if store is not None and own:
                store.remember(target_model, input_ids[:, :own], cache)
            return cls(cache, input_ids, positions[:, :0])
        return cls(cache, input_ids, positions, store, own if store is not None else 0)

    def _pending(self) -> Pending | None:
        return Pending(self.input_ids, self.pending) if self.pending.numel() else None

    def read(self, target_model, new_ids: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        """The target recomputes the pending positions and reads ``new_ids`` [batch, N] on top (the cache grows to
        T + N), in one forward; the logits of the last ``logits_to_keep`` new tokens [batch, keep, vocab]."""
        pending = self._pending()
        logits = self.cache.read(target_model, new_ids, logits_to_keep, pending)
        if pending is not None:
            self._recomputed(target_model)
        return logits

    def settle(self, target_model) -> KVCache:
        """The target recomputes the pending positions alone (one forward; none when nothing is pending); returns
        the cache."""
        pending = self._pending()
        if pending is not None:
            self.cache.recompute(target_model, pending)
            self._recomputed(target_model)
        return self.cache

    def generate(self, target_model, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """The target's ``generate`` on this cache for ``input_ids`` [batch, T + N] (the mapped T tokens, then N ≥ 1
        new ones the target reads; generate_kwargs: max_new_tokens, do_sample, ... but no attention mask: the rows
        are unpadded). `generate`'s first forward is `read`: the pending recompute and the new tokens in one forward.
        Returns the full sequences [batch, T + N + generated], as `generate` does."""
        total = self.cache.length
        if input_ids.dim() != 2 or input_ids.shape[1] <= total:
            raise ConfigError(f"input_ids must be [batch, tokens] with more than the {total} cached tokens, got "
                              f"{tuple(input_ids.shape)}")
        if "attention_mask" in generate_kwargs:
            raise ConfigError("MappedCache.generate reads unpadded rows: pass no attention_mask")
        first_read = None
        if self.pending.numel():
            def first_read(new_ids, keep):
                return self.read(target_model, new_ids, keep)
        return self.cache.generate(target_model, input_ids, first_read, **generate_kwargs)

    def _recomputed(self, target_model) -> None:
        self.pending = self.pending[:, :0]
        if self.prefix_store is not None and self.unstored_prefix:
            self.prefix_store.remember(target_model, self.input_ids[:, : self.unstored_prefix], self.cache)
            self.unstored_prefix = 0


def _pending_positions(cache: KVCache, target_model, input_ids: torch.Tensor, own: int, plan: HandoffPlan,
                       selection_info: SelectionInfo | None, source_model, source: KVCache | None) -> torch.Tensor:
    """The positions [batch, n] the target recomputes in a freshly mapped cache of ``input_ids`` [batch, T]: the first
    ``own`` (its exact prefix), then the ones the plan's recompute policy picks among the rest."""
    batch, total = input_ids.shape
    positions = torch.arange(own, device=cache.device).expand(batch, -1)
    policy = plan.recompute
    if policy.active and own < total:
        info = replace(selection_info or SelectionInfo(), start=own)
        picked = policy.positions(target_model, cache.export(), input_ids, info, source_model, source)
        positions = torch.cat([positions, picked.to(cache.device)], dim=1)
    return positions


@torch.inference_mode()
def _source_prefill(source_model, input_ids: torch.Tensor, plan: HandoffPlan, info: SelectionInfo,
                    cache_factory: CacheFactory):
    """The source's cache of ``input_ids`` (``cache_factory(source_model)`` prefilled); its attention recorded into
    ``info`` when the plan's policy ranks by it."""
    source = cache_factory(source_model)
    ids = input_ids.to(model_device(source_model))
    if not plan.recompute.needs_source_attention:
        source.read(source_model, ids)
        return source, info
    with record_queries(source_model, plan.recompute.window) as queries:
        source.read(source_model, ids)
    return source, replace(info, source_attention=attention_from_queries(source_model, queries, source.export()))


def map_for_target(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor,
                   plan: HandoffPlan | None = None, source_cache=None,
                   selection_info: SelectionInfo | None = None, *,
                   cache_factory: CacheFactory = new_cache) -> MappedCache:
    """The mapped target cache of all of ``input_ids`` [batch, T], built from the source's prefill, with the
    positions the target recomputes (``plan``: the exact prefix and the recompute policy's picks; None: the
    mapper's exact prefix and `DEFAULT_RECOMPUTE`) still pending: `MappedCache.read` does them with the target's
    next tokens in one forward, `generate` in its first forward, `settle` alone.

    source_cache: the source's cache of exactly ``input_ids`` when the caller already has one (a `KVCache` or a
    `transformers` cache; e.g. a reused few-shot prefix extended by the rest); the source prefill is then skipped.
    selection_info: what the recompute policy may know beyond the cache (turn starts, the source's attention).
    cache_factory: makes each model's fresh cache, ``cache_factory(model)`` → an empty `KVCache` of the engine that
    runs it (`CacheFactory`; default `new_cache`: the model's own engine's): the target's, which the mapped rows go
    into, and the source's for its prefill (none when ``source_cache`` is given). The target's cache never comes
    from the source's kind: the two may live in different engines.

    Refused before any work: a mapper fitted for another pair (MapperMismatchError; checked once per mapper and
    model) and a context longer than the target's window (ContextTooLongError).
    """
    plan = plan or DEFAULT_PLAN
    _check_ids(input_ids, 1)
    verify_mapper(mapper, source_model, target_model)
    check_context(input_ids.shape[1], target_model, mapper)
    info = selection_info or SelectionInfo()
    if source_cache is None:
        source, info = _source_prefill(source_model, input_ids, plan, info, cache_factory)
    else:
        source = as_kv_cache(source_cache)
        if source.length != input_ids.shape[1]:
            raise ConfigError(f"source_cache holds {source.length} tokens, the mapped part of input_ids "
                              f"{input_ids.shape[1]}")
    target = cache_factory(target_model)  # the target's engine makes its cache; the source's kind may differ
    if target.length:
        raise ConfigError(f"the cache factory made a cache of {target.length} positions for the target; a mapped "
                          "cache starts empty")
    target.append(mapper.transfer(source.export(), dtype=target_model.dtype))
    return MappedCache.from_mapped(target, target_model, input_ids, mapper, plan, info, source_model, source)


@torch.inference_mode()
def catch_up(target_cache, source_cache, mapper: Mapper, source_model=None, target_model=None,
             input_ids: torch.Tensor | None = None, plan: HandoffPlan | None = None,
             selection_info: SelectionInfo | None = None) -> MappedCache:
    """Bring ``target_cache`` (positions 0..m−1: the target's own, or mapped at an earlier switch) up to
    ``source_cache``'s length by mapping only the source's positions m..T−1 and appending them (in place); a
    `MappedCache` whose pending positions are the plan's recompute policy's picks among the newly mapped ones (the
    budget a fraction of them): `read` does them with the target's next tokens, `settle` alone.

    What a model returning to a conversation needs: it keeps its own cache of the turns it served, so only the
    turns another model served since are mapped, once. Nothing is mapped twice, so no position makes a round
    trip through two mappers. An active policy needs ``target_model`` and ``input_ids`` (the conversation's T token
    ids, [batch, T]). Either cache is a `KVCache` or a `transformers` cache.

    Refused before any work: a target cache of another geometry than the mapper's target, models (when given)
    the mapper was not fitted for (checked once per mapper and model), a context past the target's window.
    """
    plan = plan or DEFAULT_PLAN
    target, source = as_kv_cache(target_cache), as_kv_cache(source_cache)
    verify_mapper(mapper, source_model, target_model)
    _check_target_cache(target, mapper)
    have, total = target.length, source.length
    check_context(total, target_model, mapper)
    if have > total:
        raise ConfigError(f"the target's cache holds {have} tokens, more than the source's {total}")
    policy = plan.recompute
    if have == total:
        return MappedCache(target, input_ids, _nothing(input_ids, target.device))
    if policy.active and (target_model is None or input_ids is None or input_ids.shape[-1] != total):
        raise ConfigError(f"recompute {policy.spec!r} at a catch-up needs the target model and the conversation's "
                          f"{total} token ids (input_ids); pass them, or a plan with recompute='none' to only map")
    positions = torch.arange(have, total, device=source.device)
    target.append(mapper.transfer(source.export(have), position_ids=positions, dtype=target.dtype))
    if not policy.active:
        return MappedCache(target, input_ids, _nothing(input_ids, target.device))
    input_ids = input_ids.to(target.device)
    _recompute_leading_layers(target, target_model, input_ids, have, plan)
    info = replace(selection_info or SelectionInfo(), start=have)
    picked = policy.positions(target_model, target.export(), input_ids, info, source_model, source)
    return MappedCache(target, input_ids, picked.to(target.device))


def handoff_cache(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor,
                  plan: HandoffPlan | None = None, source_cache=None, target_tail: int = 0,
                  selection_info: SelectionInfo | None = None, *, cache_factory: CacheFactory = new_cache):
    """The target's cache for all of ``input_ids`` [batch, T], built from the source's prefill (no target prefill of
    the context), the plan's recompute done: `map_for_target`, settled. Returns the engine's own cache object
    (`KVCache.native`), which the target's ``generate`` takes.

    target_tail: the last ``target_tail`` tokens are not mapped but read by the target itself on top of the mapped
    cache — what a switch looks like when the new turn has not been read by any model yet; the recompute runs in
    that same forward (`MappedCache.read`). source_cache: the source's cache of exactly the mapped part.
    cache_factory: each model's fresh cache, as in `map_for_target`. Refused as `map_for_target` is, before any
    work.
    """
    _check_ids(input_ids, 1)
    if not 0 <= target_tail < input_ids.shape[1]:
        raise ConfigError(
            f"target_tail must be in 0..{input_ids.shape[1] - 1} (at least one token is mapped), got {target_tail}"
        )
    verify_mapper(mapper, source_model, target_model)
    check_context(input_ids.shape[1], target_model, mapper)
    cut = input_ids.shape[1] - target_tail
    mapped = map_for_target(source_model, target_model, mapper, input_ids[:, :cut], plan, source_cache,
                            selection_info, cache_factory=cache_factory)
    if target_tail:
        mapped.read(target_model, input_ids[:, cut:])
        return mapped.cache.native
    return mapped.settle(target_model).native


def handoff_generate(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor,
                     plan: HandoffPlan | None = None, target_tail: int = 0, *,
                     cache_factory: CacheFactory = new_cache, **generate_kwargs) -> torch.Tensor:
    """The source prefills all but the last token (all but the last 1 + ``target_tail``, which the target reads
    itself: see `handoff_cache`); the mapped cache goes to the target, which generates. `generate`'s first forward
    reads the unmapped tokens and recomputes what ``plan`` says (`MappedCache.generate`): one target forward before
    the first new token.

    cache_factory: each model's fresh cache, as in `map_for_target`. generate_kwargs go to the target's
    ``generate`` (max_new_tokens, do_sample, temperature, ...).
    Returns the full sequences [batch, tokens + new], as ``generate`` does.
    """
    _check_ids(input_ids, 2)
    if not 0 <= target_tail < input_ids.shape[1] - 1:
        raise ConfigError(
            f"target_tail must be in 0..{input_ids.shape[1] - 2} (at least one token is mapped), got {target_tail}"
        )
    cut = input_ids.shape[1] - 1 - target_tail
    mapped = map_for_target(source_model, target_model, mapper, input_ids[:, :cut], plan,
                            cache_factory=cache_factory)
    return mapped.generate(target_model, input_ids.to(mapped.cache.device), **generate_kwargs)
