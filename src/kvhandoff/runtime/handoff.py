"""Handoff: the source prefills, the mapper converts its cache, the target decodes on."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvhandoff.errors import ConfigError, ContextTooLongError, MapperMismatchError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import cache_view, model_device, prefill
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.recompute import (
    SelectionInfo,
    attention_from_queries,
    needs_source_attention,
    policy_positions,
    recompute_and_read,
    recompute_positions,
    record_queries,
    takes_custom_mask,
)


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


def recompute_policy(mapper, recompute=None) -> RecomputePolicy:
    """The selective-recompute policy of a handoff: ``recompute`` (a `RecomputePolicy` or a spec such as
    "deviation:10%"), or with None the mapper's default (its fit config's `recompute`, recorded in the manifest;
    `config.DEFAULT_RECOMPUTE` for objects without a manifest)."""
    if recompute is not None:
        return RecomputePolicy.parse(recompute)
    return RecomputePolicy.parse(DEFAULT_RECOMPUTE)


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


@torch.inference_mode()
def patch_exact_prefix(mapped_cache, target_model, input_ids: torch.Tensor, exact_prefix: int | None):
    """Overwrite the first `exact_prefix` cached positions with the target's own K/V for those tokens.

    The leading positions act as attention sinks (they draw much of every query's attention), so an error
    there reaches every later token; the target recomputes them from `exact_prefix` tokens alone (causal
    attention makes that exact), a cost independent of the context length.
    """
    if not exact_prefix or exact_prefix <= 0:
        return mapped_cache
    n = min(exact_prefix, input_ids.shape[1], mapped_cache.get_seq_length())
    own_cache, _ = prefill(target_model, input_ids[:, :n])
    for mapped, own in zip(mapped_cache.layers, own_cache.layers, strict=True):
        mapped.keys[:, :, :n] = own.keys
        mapped.values[:, :, :n] = own.values
    return mapped_cache


class PrefixStore:
    """The target's own K/V of the exact prefix (the first tokens of a handed-over context), by model and token ids.

    A router's conversations open alike (chat template, system prompt), so after the first handoff of an opening the
    target's K/V of its exact prefix are copied from here instead of recomputed, and the target's first forward
    after a switch reads only the new tokens. The K/V of positions 0..p−1 depend on those p tokens alone (causal
    attention), so a copy is exact. Holds up to ``capacity`` openings per model, least recently used dropped first;
    it assumes a model's weights do not change in place (`clear` it if they do). Thread-safe."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ConfigError(f"a prefix store holds at least one opening, got capacity {capacity}")
        self.capacity = capacity
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def lookup(self, model, prefix_ids: torch.Tensor, dtype: torch.dtype):
        """The stored K/V of ``prefix_ids`` [batch, p] as [(keys, values) [batch, kv_heads, p, head_dim] per layer],
        or None unless every row is stored."""
        keys = _row_keys(prefix_ids, dtype)
        with self._lock:
            entries = self._entries.get(model, {})
            rows = [entries.get(key) for key in keys]
            if any(row is None for row in rows):
                self.misses += 1
                return None
            self.hits += 1
            for key in keys:
                entries.move_to_end(key)
        return [(torch.cat([row[i][0] for row in rows]), torch.cat([row[i][1] for row in rows]))
                for i in range(len(rows[0]))]

    def remember(self, model, prefix_ids: torch.Tensor, cache) -> None:
        """Store ``cache``'s positions 0..p−1 (the target's own K/V of ``prefix_ids`` [batch, p]), row by row."""
        count = prefix_ids.shape[1]
        keys = _row_keys(prefix_ids, cache.layers[0].keys.dtype)
        with self._lock:
            entries = self._entries.setdefault(model, OrderedDict())
            for row, key in enumerate(keys):
                entries[key] = [
                    (layer.keys[row : row + 1, :, :count].clone(), layer.values[row : row + 1, :, :count].clone())
                    for layer in cache.layers
                ]
                entries.move_to_end(key)
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    @torch.inference_mode()
    def prime(self, model, prefix_ids: torch.Tensor) -> None:
        """Store ``model``'s own K/V of ``prefix_ids`` [batch, p] (a prefill of those p tokens), e.g. a system
        prompt's opening before the first switch."""
        cache, _ = prefill(model, prefix_ids.to(model_device(model)))
        self.remember(model, prefix_ids, cache)


def _row_keys(prefix_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
    """A `PrefixStore` key per row of ``prefix_ids`` [batch, p]: its token ids and the cache dtype."""
    return [(tuple(row.tolist()), dtype) for row in prefix_ids]


def _copy_prefix(cache, stored) -> None:
    for layer, (keys, values) in zip(cache.layers, stored, strict=True):
        count = keys.shape[2]
        layer.keys[:, :, :count] = keys.to(layer.keys.device)
        layer.values[:, :, :count] = values.to(layer.values.device)


@dataclass
class MappedCache:
    """A freshly mapped target cache of ``input_ids`` [batch, T] whose ``pending`` positions [batch, n] (sorted rows:
    the exact prefix, then what the recompute policy picked) still hold mapped K/V that the target recomputes.

    The recompute is left to the target's next forward: `read` recomputes them and reads the new tokens in one
    forward (the target's weights are read once, not twice); `generate` does the same in `generate`'s first forward;
    `settle` recomputes them alone, for a caller that hands the cache on. Each empties ``pending``. With a
    ``prefix_store``, the first ``unstored_prefix`` positions (an exact prefix the store did not hold) go into it
    once recomputed."""

    cache: object
    input_ids: torch.Tensor
    pending: torch.Tensor
    prefix_store: PrefixStore | None = None
    unstored_prefix: int = 0

    def read(self, target_model, new_ids: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        """The target recomputes the pending positions and reads ``new_ids`` [batch, N] on top (the cache grows to
        T + N), in one forward; the logits of the last ``logits_to_keep`` new tokens [batch, keep, vocab]."""
        if not self.pending.numel():  # nothing pending: the plain read
            out = target_model(input_ids=new_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
            return out.logits
        logits = recompute_and_read(target_model, self.cache, self.input_ids, self.pending, new_ids, logits_to_keep)
        self._recomputed(target_model)
        return logits

    def settle(self, target_model):
        """The target recomputes the pending positions alone (one forward; none when nothing is pending); returns
        the cache."""
        if self.pending.numel():
            recompute_positions(target_model, self.cache, self.input_ids, self.pending)
            self._recomputed(target_model)
        return self.cache

    @torch.inference_mode()
    def generate(self, target_model, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """``target_model.generate`` on this cache for ``input_ids`` [batch, T + N] (the mapped T tokens, then N ≥ 1
        new ones the target reads; generate_kwargs: max_new_tokens, do_sample, ... but no attention mask: the rows
        are unpadded). `generate`'s first forward is `read`: the pending recompute and the new tokens in one forward.
        Returns the full sequences [batch, T + N + generated], as `generate` does."""
        total = self.cache.get_seq_length()
        if input_ids.dim() != 2 or input_ids.shape[1] <= total:
            raise ConfigError(f"input_ids must be [batch, tokens] with more than the {total} cached tokens, got "
                              f"{tuple(input_ids.shape)}")
        if "attention_mask" in generate_kwargs:
            raise ConfigError("MappedCache.generate reads unpadded rows: pass no attention_mask")
        with self._first_forward_reads(target_model):
            return target_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         cache=self.cache, **generate_kwargs)

    @contextmanager
    def _first_forward_reads(self, target_model):
        """While active, the model's first forward on this cache is `read` (the pending recompute included)."""
        if not self.pending.numel():
            yield
            return

        replaced = target_model.__dict__.get("forward")  # e.g. accelerate's device hook: kept

        def restore() -> None:
            if replaced is None:
                target_model.__dict__.pop("forward", None)
            else:
                target_model.forward = replaced

        def first_forward(input_ids=None, cache=None, logits_to_keep=0, **kwargs):
            restore()  # later forwards: the model's own
            if cache is not self.cache or input_ids is None:
                return target_model.forward(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep,
                                            **kwargs)
            keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep else input_ids.shape[1]
            return CausalLMOutputWithPast(logits=self.read(target_model, input_ids, keep), cache=self.cache)

        target_model.forward = first_forward
        try:
            yield
        finally:
            restore()

    def _recomputed(self, target_model) -> None:
        self.pending = self.pending[:, :0]
        if self.prefix_store is not None and self.unstored_prefix:
            self.prefix_store.remember(target_model, self.input_ids[:, : self.unstored_prefix], self.cache)
            self.unstored_prefix = 0


def pending_positions(cache, target_model, input_ids: torch.Tensor, mapper, exact_prefix: int | None = None,
                      recompute=None, recompute_info: SelectionInfo | None = None, source_model=None,
                      source_cache=None) -> torch.Tensor:
    """The positions [batch, n] the target recomputes in a freshly mapped cache of ``input_ids`` [batch, T]: the first
    `exact_prefix` (None = the mapper's setting; causal attention makes them exact from those tokens alone: they
    act as attention sinks, so an error there reaches every later token), then the ones the recompute policy picks
    among the rest (`recompute.policy_positions`; None = the mapper's default)."""
    batch, total = input_ids.shape
    own = _prefix_length(mapper, exact_prefix, total)
    device = cache.layers[0].keys.device
    positions = torch.arange(own, device=device).expand(batch, -1)
    policy = recompute_policy(mapper, recompute)
    if policy.active and own < total:
        info = replace(recompute_info or SelectionInfo(), start=own)
        picked = policy_positions(policy, target_model, cache, input_ids, info, source_model, source_cache)
        positions = torch.cat([positions, picked.to(device)], dim=1)
    return positions


def _prefix_length(mapper, exact_prefix: int | None, total: int) -> int:
    prefix = mapper.exact_prefix if exact_prefix is None else exact_prefix
    return min(max(prefix or 0, 0), total)


def patch_mapped_cache(cache, target_model, input_ids: torch.Tensor, mapper, exact_prefix: int | None = None,
                       recompute=None, recompute_info: SelectionInfo | None = None, source_model=None,
                       source_cache=None):
    """What the target does to a freshly mapped cache of ``input_ids`` [batch, T] before it reads on: recompute the
    `pending_positions` (the exact prefix and the recompute policy's picks), in place, in one forward; returns
    ``cache``. ``source_model``/``source_cache`` serve rule "source_attention" when ``recompute_info`` carries no
    scores. A target whose attention takes no custom mask recomputes the exact prefix by a prefill of it (and
    cannot run a recompute policy)."""
    return defer_recompute(cache, target_model, input_ids, mapper, exact_prefix, recompute, recompute_info,
                           source_model, source_cache).settle(target_model)


def defer_recompute(cache, target_model, input_ids: torch.Tensor, mapper, exact_prefix: int | None = None,
                    recompute=None, recompute_info: SelectionInfo | None = None, source_model=None,
                    source_cache=None, prefix_store: PrefixStore | None = None) -> MappedCache:
    """A freshly mapped ``cache`` of ``input_ids`` as a `MappedCache` whose `pending_positions` the target recomputes
    at its next forward. With a ``prefix_store`` that holds the target's K/V of the exact prefix, they are copied in
    and only the policy's picks stay pending (else the recomputed prefix is stored). A target whose attention takes
    no custom mask recomputes the exact prefix now, by a prefill of it (and cannot run a recompute policy): nothing
    is left pending."""
    input_ids = input_ids.to(cache.layers[0].keys.device)
    positions = pending_positions(cache, target_model, input_ids, mapper, exact_prefix, recompute, recompute_info,
                                  source_model, source_cache)
    own = _prefix_length(mapper, exact_prefix, input_ids.shape[1])
    stored = None
    if prefix_store is not None and own:
        stored = prefix_store.lookup(target_model, input_ids[:, :own], cache.layers[0].keys.dtype)
    if stored is not None:
        _copy_prefix(cache, stored)
        positions, own = positions[:, own:], 0
    if not takes_custom_mask(target_model):  # no sparse forward: the prefix by a prefill; a policy is refused
        patch_exact_prefix(cache, target_model, input_ids, own)
        recompute_positions(target_model, cache, input_ids, positions[:, own:])
        if prefix_store is not None and own:
            prefix_store.remember(target_model, input_ids[:, :own], cache)
        return MappedCache(cache, input_ids, positions[:, :0])
    return MappedCache(cache, input_ids, positions, prefix_store, own if prefix_store is not None else 0)


def map_for_target(
    source_model,
    target_model,
    mapper: Mapper,
    input_ids: torch.Tensor,
    exact_prefix: int | None = None,
    source_cache=None,
    recompute=None,
    recompute_info: SelectionInfo | None = None,
    prefix_store: PrefixStore | None = None,
) -> MappedCache:
    """The mapped target cache of all of ``input_ids`` [batch, T], built from the source's prefill, with the
    positions the target recomputes still pending (`MappedCache`: `read` does them with the target's next tokens in
    one forward). Arguments as in `handoff_cache`; refused, before any work, as there."""
    _check_ids(input_ids, 1)
    verify_mapper(mapper, source_model, target_model)
    check_context(input_ids.shape[1], target_model, mapper)
    policy = recompute_policy(mapper, recompute)
    info = recompute_info or SelectionInfo()
    if source_cache is None:
        if needs_source_attention(policy):
            with record_queries(source_model, policy.window) as queries:
                source_cache, _ = prefill(source_model, input_ids.to(model_device(source_model)))
            info = replace(info, source_attention=attention_from_queries(source_model, queries, source_cache))
        else:
            source_cache, _ = prefill(source_model, input_ids.to(model_device(source_model)))
    elif source_cache.get_seq_length() != input_ids.shape[1]:
        raise ConfigError(
            f"source_cache holds {source_cache.get_seq_length()} tokens, the mapped part of input_ids "
            f"{input_ids.shape[1]}"
        )
    mapped = mapper.transfer(source_cache, dtype=target_model.dtype)
    return defer_recompute(mapped, target_model, input_ids, mapper, exact_prefix, policy, info, source_model,
                           source_cache, prefix_store)


def handoff_cache(
    source_model,
    target_model,
    mapper: Mapper,
    input_ids: torch.Tensor,
    exact_prefix: int | None = None,
    source_cache=None,
    target_tail: int = 0,
    recompute=None,
    recompute_info: SelectionInfo | None = None,
    prefix_store: PrefixStore | None = None,
):
    """The target's cache for all of `input_ids`, built from the source's prefill (no target prefill of the
    context; with `exact_prefix` > 0 the target recomputes only that many leading tokens; None = the
    mapper's own setting). `source_cache`: the source's cache of exactly the mapped part of `input_ids` when
    the caller already has one (e.g. a reused few-shot prefix extended by the rest); the source prefill is
    then skipped.

    target_tail: the last `target_tail` tokens are not mapped but prefilled by the target itself on top of
    the mapped cache — what a switch looks like when the new turn has not been read by any model yet. It
    costs a target prefill of that many tokens (independent of the context length) and keeps the positions
    the next token attends to most exact. The target recomputes the exact prefix (and the recompute policy's
    picks) in the same forward (`handoff_read`); without a tail, in one forward of its own.

    prefix_store: where the target's own K/V of exact prefixes are kept (`PrefixStore`): a stored prefix is
    copied, not recomputed; a recomputed one is stored.

    Refused before any work: a mapper fitted for another pair (MapperMismatchError; checked once per mapper and
    model) and a context longer than the target's window (ContextTooLongError).
    """
    _check_ids(input_ids, 1)
    if not 0 <= target_tail < input_ids.shape[1]:
        raise ConfigError(
            f"target_tail must be in 0..{input_ids.shape[1] - 1} (at least one token is mapped), got {target_tail}"
        )
    if target_tail:
        return handoff_read(source_model, target_model, mapper, input_ids, target_tail, exact_prefix, source_cache,
                            recompute, recompute_info, prefix_store=prefix_store)[0]
    mapped = map_for_target(source_model, target_model, mapper, input_ids, exact_prefix, source_cache, recompute,
                            recompute_info, prefix_store)
    return mapped.settle(target_model)


@torch.inference_mode()
def handoff_read(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor, new_tokens: int = 1,
                 exact_prefix: int | None = None, source_cache=None, recompute=None,
                 recompute_info: SelectionInfo | None = None, logits_to_keep: int = 1,
                 prefix_store: PrefixStore | None = None):
    """A handoff up to the target's next-token logits: all but the last ``new_tokens`` of ``input_ids`` [batch, T]
    are mapped (as `handoff_cache`; ``source_cache``: the source's cache of exactly that part), and the target reads
    the last ``new_tokens`` itself in one forward that also recomputes the exact prefix and the recompute policy's
    picks (`MappedCache.read`). Returns (the target's cache of all T tokens, the logits of the last
    ``logits_to_keep`` tokens [batch, keep, vocab]). prefix_store: as in `handoff_cache`."""
    _check_ids(input_ids, 2)
    if not 1 <= new_tokens < input_ids.shape[1]:
        raise ConfigError(f"new_tokens must be in 1..{input_ids.shape[1] - 1} (at least one token is mapped), "
                          f"got {new_tokens}")
    verify_mapper(mapper, source_model, target_model)
    check_context(input_ids.shape[1], target_model, mapper)
    cut = input_ids.shape[1] - new_tokens
    mapped = map_for_target(source_model, target_model, mapper, input_ids[:, :cut], exact_prefix, source_cache,
                            recompute, recompute_info, prefix_store)
    logits = mapped.read(target_model, input_ids[:, cut:].to(mapped.input_ids.device), logits_to_keep)
    return mapped.cache, logits


@torch.inference_mode()
def catch_up(target_cache, source_cache, mapper: Mapper, source_model=None, target_model=None, input_ids=None,
             recompute=None, recompute_info: SelectionInfo | None = None):
    """Bring ``target_cache`` (positions 0..m−1: the target's own, or mapped at an earlier switch) up to
    ``source_cache``'s length by mapping only the source's positions m..T−1 and appending them.

    What a model returning to a conversation needs: it keeps its own cache of the turns it served, so only the
    turns another model served since are mapped, once. Nothing is mapped twice, so no position makes a round
    trip through two mappers. Returns ``target_cache``, extended in place.

    recompute: as in `handoff_cache` (None = the mapper's default); only the newly mapped positions m..T−1 are
    candidates, and the budget is a fraction of them. An active policy needs ``target_model`` and ``input_ids``
    (the conversation's T token ids, [batch, T]). `catch_up_mapped` leaves that recompute to the target's next
    forward.

    Refused before any work: a target cache of another geometry than the mapper's target, models (when given)
    the mapper was not fitted for (checked once per mapper and model), a context past the target's window.
    """
    return catch_up_mapped(target_cache, source_cache, mapper, source_model, target_model, input_ids, recompute,
                           recompute_info).settle(target_model)


@torch.inference_mode()
def catch_up_mapped(target_cache, source_cache, mapper: Mapper, source_model=None, target_model=None,
                    input_ids=None, recompute=None, recompute_info: SelectionInfo | None = None) -> MappedCache:
    """`catch_up`, with the recompute policy's picks left pending (`MappedCache`: the target recomputes them in
    the forward that reads its next tokens)."""
    verify_mapper(mapper, source_model, target_model)
    _check_target_cache(target_cache, mapper)
    have, total = target_cache.get_seq_length(), source_cache.get_seq_length()
    check_context(total, target_model, mapper)
    if have > total:
        raise ConfigError(f"the target's cache holds {have} tokens, more than the source's {total}")
    device = target_cache.layers[0].keys.device
    nothing = torch.empty(1 if input_ids is None else input_ids.shape[0], 0, dtype=torch.long, device=device)
    policy = recompute_policy(mapper, recompute)
    if have == total:
        return MappedCache(target_cache, input_ids, nothing)
    if policy.active and (target_model is None or input_ids is None or input_ids.shape[-1] != total):
        raise ConfigError(f"recompute {policy.spec!r} at a catch-up needs the target model and the conversation's "
                          f"{total} token ids (input_ids); pass them, or recompute='none' to only map")
    dtype = target_cache.layers[0].keys.dtype
    positions = torch.arange(have, total, device=source_cache.layers[0].keys.device)
    mapped = mapper.transfer(cache_view(source_cache, have), position_ids=positions, dtype=dtype)
    for own, new in zip(target_cache.layers, mapped.layers, strict=True):
        own.keys = torch.cat([own.keys, new.keys.to(own.keys.device)], dim=-2)
        own.values = torch.cat([own.values, new.values.to(own.values.device)], dim=-2)
    if not policy.active:
        return MappedCache(target_cache, input_ids, nothing)
    input_ids = input_ids.to(device)
    info = replace(recompute_info or SelectionInfo(), start=have)
    picked = policy_positions(policy, target_model, target_cache, input_ids, info, source_model, source_cache)
    return MappedCache(target_cache, input_ids, picked.to(device))


def _check_target_cache(cache, mapper) -> None:
    if not isinstance(mapper, Mapper) or not cache.layers:
        return
    tgt = mapper.target
    _, heads, _, head_dim = cache.layers[0].keys.shape
    if (len(cache.layers), heads, head_dim) != (tgt.num_layers, tgt.num_kv_heads, tgt.head_dim):
        raise MapperMismatchError(
            f"the target cache has {len(cache.layers)} layers × {heads} KV heads × head dim {head_dim}, but this "
            f"mapper maps to {tgt.num_layers} × {tgt.num_kv_heads} × {tgt.head_dim}: use the mapper fitted for "
            "this target model"
        )


@torch.inference_mode()
def handoff_generate(
    source_model,
    target_model,
    mapper: Mapper,
    input_ids: torch.Tensor,
    exact_prefix: int | None = None,
    target_tail: int = 0,
    recompute=None,
    prefix_store: PrefixStore | None = None,
    **generate_kwargs,
):
    """Source prefills all but the last token (all but the last 1 + `target_tail`, which the target reads
    itself: see `handoff_cache`); the mapped cache goes to the target, which generates. `generate`'s first forward
    reads the unmapped tokens and recomputes the exact prefix and the recompute policy's picks (recompute; None =
    the mapper's default): one target forward before the first new token (`MappedCache.generate`).
    prefix_store: as in `handoff_cache`.

    generate_kwargs go to `target_model.generate` (max_new_tokens, do_sample, temperature, ...).
    Returns the full sequences [batch, tokens + new], as `generate` does.
    """
    _check_ids(input_ids, 2)
    if not 0 <= target_tail < input_ids.shape[1] - 1:
        raise ConfigError(
            f"target_tail must be in 0..{input_ids.shape[1] - 2} (at least one token is mapped), got {target_tail}"
        )
    cut = input_ids.shape[1] - 1 - target_tail
    mapped = map_for_target(source_model, target_model, mapper, input_ids[:, :cut], exact_prefix, recompute=recompute,
                            prefix_store=prefix_store)
    return mapped.generate(target_model, input_ids.to(mapped.input_ids.device), **generate_kwargs)
