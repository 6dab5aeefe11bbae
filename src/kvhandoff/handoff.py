"""Handoff: the source prefills, the mapper converts its cache, the target decodes on."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvhandoff.errors import ConfigError
from kvhandoff.mapper import Mapper


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, cache=None):
    """Run `model` over `input_ids` [batch, tokens]; return (cache, logits of the last position [batch, vocab])."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1]


def rollback(cache, length: int) -> None:
    """Drop cached positions beyond ``length``."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot roll a cache of {cache.get_seq_length()} tokens back to {length}")
    if extra:
        cache.crop(-extra)  # transformers 5: a negative count of tokens to remove


def _check_ids(input_ids: torch.Tensor, minimum: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] < minimum:
        raise ConfigError(
            f"input_ids must be [batch, tokens] with at least {minimum} token(s), got {tuple(input_ids.shape)}"
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


def handoff_cache(
    source_model,
    target_model,
    mapper: Mapper,
    input_ids: torch.Tensor,
    exact_prefix: int | None = None,
    source_cache=None,
    target_tail: int = 0,
):
    """The target's cache for all of `input_ids`, built from the source's prefill (no target prefill of the
    context; with `exact_prefix` > 0 the target recomputes only that many leading tokens; None = the
    mapper's own setting). `source_cache`: the source's cache of exactly the mapped part of `input_ids` when
    the caller already has one (e.g. a reused few-shot prefix extended by the rest); the source prefill is
    then skipped.

    target_tail: the last `target_tail` tokens are not mapped but prefilled by the target itself on top of
    the mapped cache — what a switch looks like when the new turn has not been read by any model yet. It
    costs a target prefill of that many tokens (independent of the context length) and keeps the positions
    the next token attends to most exact.
    """
    _check_ids(input_ids, 1)
    if not 0 <= target_tail < input_ids.shape[1]:
        raise ConfigError(
            f"target_tail must be in 0..{input_ids.shape[1] - 1} (at least one token is mapped), got {target_tail}"
        )
    mapped_ids = input_ids[:, : input_ids.shape[1] - target_tail]
    if source_cache is None:
        source_cache, _ = prefill(source_model, mapped_ids.to(source_model.device))
    elif source_cache.get_seq_length() != mapped_ids.shape[1]:
        raise ConfigError(
            f"source_cache holds {source_cache.get_seq_length()} tokens, the mapped part of input_ids "
            f"{mapped_ids.shape[1]}"
        )
    mapped = mapper.transfer(source_cache, dtype=target_model.dtype)
    prefix = mapper.exact_prefix if exact_prefix is None else exact_prefix
    cache = patch_exact_prefix(mapped, target_model, mapped_ids.to(target_model.device), prefix)
    if target_tail:
        prefill(target_model, input_ids[:, mapped_ids.shape[1] :].to(target_model.device), cache)
    return cache


def cache_from(cache, start: int, end: int | None = None) -> DynamicCache:
    """A `DynamicCache` of the positions ``start``..``end`` (exclusive; None: to the end) of ``cache`` (views,
    no copy)."""
    view = DynamicCache()
    for layer in cache.layers:
        part = DynamicLayer()
        part.device, part.is_initialized = layer.keys.device, True
        part.keys, part.values = layer.keys[:, :, start:end], layer.values[:, :, start:end]
        view.layers.append(part)
    return view


@torch.inference_mode()
def catch_up(target_cache, source_cache, mapper: Mapper):
    """Bring ``target_cache`` (positions 0..m−1: the target's own, or mapped at an earlier switch) up to
    ``source_cache``'s length by mapping only the source's positions m..T−1 and appending them.

    What a model returning to a conversation needs: it keeps its own cache of the turns it served, so only the
    turns another model served since are mapped, once. Nothing is mapped twice, so no position makes a round
    trip through two mappers. Returns ``target_cache``, extended in place.
    """
    have, total = target_cache.get_seq_length(), source_cache.get_seq_length()
    if have > total:
        raise ConfigError(f"the target's cache holds {have} tokens, more than the source's {total}")
    if have == total:
        return target_cache
    dtype = target_cache.layers[0].keys.dtype
    positions = torch.arange(have, total, device=source_cache.layers[0].keys.device)
    mapped = mapper.transfer(cache_from(source_cache, have), position_ids=positions, dtype=dtype)
    for own, new in zip(target_cache.layers, mapped.layers, strict=True):
        own.keys = torch.cat([own.keys, new.keys.to(own.keys.device)], dim=-2)
        own.values = torch.cat([own.values, new.values.to(own.values.device)], dim=-2)
    return target_cache


@torch.inference_mode()
def handoff_generate(
    source_model,
    target_model,
    mapper: Mapper,
    input_ids: torch.Tensor,
    exact_prefix: int | None = None,
    target_tail: int = 0,
    **generate_kwargs,
):
    """Source prefills all but the last token (all but the last 1 + `target_tail`, which the target
    prefills itself: see `handoff_cache`); the mapped cache goes to the target, which generates.

    generate_kwargs go to `target_model.generate` (max_new_tokens, do_sample, temperature, ...).
    Returns the full sequences [batch, tokens + new], as `generate` does.
    """
    _check_ids(input_ids, 2)
    cache = handoff_cache(source_model, target_model, mapper, input_ids[:, :-1], exact_prefix,
                          target_tail=target_tail)
    attention_mask = torch.ones_like(input_ids)
    return target_model.generate(
        input_ids=input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs
    )


#: how a conversation is handed over at a switch: "all" — the current server's whole cache is mapped for the new
#: server; "incremental" — every model keeps its own cache and only the positions it has not cached are mapped
HANDOVERS = ("all", "incremental")


class SwitchingSession:
    """One conversation served by several models in turn (a router switching between them at turn boundaries).

    models: name → model (one family, one tokenizer); mappers: (from name, to name) → `Mapper`.
    handover: see `HANDOVERS` ("incremental": a model returning to the conversation keeps its cache and catches
    up on the turns it missed, so no position is mapped twice). exact_prefix: leading positions a model
    recomputes itself the first time it is handed the conversation (None = the mapper's own setting).

    `read(server, ids)` lets ``server`` read the next tokens of the conversation, switching to it first when
    another model served last; `generate(server, ids, ...)` also answers, and the answer joins the conversation.
    A caller may decode from `cache(server)` itself: what it decodes past `tokens` (what every cache agrees on)
    is dropped before the conversation goes on (`rollback`).
    """

    def __init__(self, models, mappers, handover: str = "incremental", exact_prefix: int | None = None) -> None:
        if handover not in HANDOVERS:
            raise ConfigError(f"handover must be one of {', '.join(HANDOVERS)}, got {handover!r}")
        self.models, self.mappers = dict(models), dict(mappers)
        self.handover, self.exact_prefix = handover, exact_prefix
        self.tokens: list[int] = []
        self.owner: str | None = None  # the model that read the conversation last
        self._caches: dict[str, object] = {}

    def cache(self, server: str):
        """``server``'s cache of the conversation (None before it has one)."""
        return self._caches.get(server)

    def switch_to(self, server: str):
        """Make ``server`` the owner; returns its cache of `tokens` (mapped as `handover` says)."""
        if server not in self.models:
            raise ConfigError(f"unknown model {server!r}; this session serves {', '.join(self.models)}")
        owner = self.owner
        for name in (owner, server):
            if name in self._caches:
                self.rollback(name)
        if owner is not None and server != owner:
            mapper = self.mappers.get((owner, server))
            if mapper is None:
                raise ConfigError(f"no mapper for the handoff {owner} → {server}")
            current = self._caches[owner] if self.handover == "incremental" else self._caches.pop(owner)
            if server in self._caches:
                catch_up(self._caches[server], current, mapper)
            else:
                ids = torch.tensor([self.tokens], device=current.layers[0].keys.device)
                self._caches[server] = handoff_cache(self.models[owner], self.models[server], mapper, ids,
                                                     self.exact_prefix, source_cache=current)
        self.owner = server
        return self._caches.get(server)

    @torch.inference_mode()
    def read(self, server: str, ids) -> torch.Tensor:
        """``server`` reads ``ids`` (the conversation's next tokens); float32 log-probs of the token after them."""
        ids = list(ids)
        if not ids:
            raise ConfigError("read needs at least one token")
        cache = self.switch_to(server)
        model = self.models[server]
        input_ids = torch.tensor([ids], device=model.device)
        cache, logits = prefill(model, input_ids, cache)
        self._caches[server] = cache
        self.tokens += ids
        return logits[0].float().log_softmax(-1)

    @torch.inference_mode()
    def generate(self, server: str, ids, **generate_kwargs) -> list[int]:
        """``server`` reads ``ids`` (the new turn) and generates its answer with ``model.generate``
        (generate_kwargs: max_new_tokens, do_sample, ...). The answer joins the conversation: every generated
        token is cached and appended to `tokens`. Returns the generated token ids."""
        ids = list(ids)
        if not ids:
            raise ConfigError("generate needs at least one token of the new turn")
        cache = self.switch_to(server)
        model = self.models[server]
        if cache is None:  # the conversation's first turn: generate prefills it
            cache = self._caches[server] = DynamicCache()
        input_ids = torch.tensor([self.tokens + ids], device=model.device)
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                             **generate_kwargs)
        answer = out[0, input_ids.shape[1]:].tolist()
        everything = out[0].tolist()
        missing = everything[cache.get_seq_length():]  # generate does not feed its last token back
        if missing:
            prefill(model, torch.tensor([missing], device=model.device), cache)
        self.tokens = everything
        return answer

    def rollback(self, server: str) -> None:
        """Drop what ``server``'s cache holds past `tokens` (e.g. an answer the caller decoded and will feed back
        later as part of the next turn)."""
        cache = self._caches[server]
        if cache.get_seq_length() > len(self.tokens):
            rollback(cache, len(self.tokens))
