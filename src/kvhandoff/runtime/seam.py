"""The cache seam: the one interface through which the runtime reads a source's K/V and writes mapped K/V into a
target's cache, shaped after vLLM's KV connector (`KVConnectorBase_V1`, docs/ENGINES.md section 3.1).

`KVCache` is the interface; `TransformersCache` implements it on a `transformers` `DynamicCache` (the sparse forward
of `kvhandoff.runtime.recompute`), `kvhandoff.runtime.llama_cpp.backend.LlamaCppCache` on a sequence of a llama.cpp
context. Another engine's cache (a vLLM KV connector's paged blocks) would implement the same methods; the handoff
never learns which cache it holds. Rows travel between caches and the mapper as a `DynamicCache` of [batch,
kv_heads, positions, head_dim] tensors per layer: what `Mapper.transfer` reads and returns.

A model's fresh cache comes from a `CacheFactory`, ``factory(model)``: the side that runs ``model`` makes it (the
source's engine its prefill's cache, the target's engine the cache the mapped rows go into), so a source and a target
in different engines or contexts each get their own kind. `new_cache` is the default factory: the model's own
engine's cache where the model makes one, else a `TransformersCache`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.nn import functional
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvhandoff.model.cache import cache_copy, cache_of, cache_view, model_device, rollback
from kvhandoff.runtime.recompute import (
    TurnRead,
    read_turn,
    recompute_and_read,
    recompute_positions,
    takes_custom_mask,
)


@dataclass(frozen=True)
class Pending:
    """What the next forward on a cache recomputes: the positions [batch, n] (sorted rows) of the cached tokens
    ``input_ids`` [batch, T], whose mapped K/V the target's own replace."""

    input_ids: torch.Tensor
    positions: torch.Tensor

    def __bool__(self) -> bool:
        return bool(self.positions.numel())


class KVCache(ABC):
    """A model's KV cache of one conversation, as the handoff sees it.

    The lifecycle of a handoff, after vLLM's KV connector:

    1. export (the source; vLLM's ``save_kv_layer``/``wait_for_save``): `export` hands out the rows of positions
       start..end−1 of every layer, which the mapper reads.
    2. import (the target; vLLM's ``start_load_kv``, before the forward): a fresh cache `append` s the mapped rows,
       or an existing one appends the rows it lacks (a catch-up); `write` overwrites rows in place (the exact prefix
       copied from a `PrefixStore`).
    3. the next forward (vLLM's ``get_num_new_matched_tokens``: what was loaded, what the engine still computes):
       `read` recomputes the `Pending` positions and reads the new tokens in one forward; `recompute` does the
       pending positions alone; `generate` runs the engine's decoding loop, its first forward a `read`.
    4. housekeeping: `truncate` (roll back), `copy` (fork a conversation), `storages` (memory held).
    """

    #: whether a model can read the history's last queries again on this cache's exported rows
    #: (`recompute.source_attention_scores`): what ranks positions by attention when no new turn is given
    reads_history_queries: ClassVar[bool] = False

    @property
    @abstractmethod
    def length(self) -> int:
        """Positions cached."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the cached K/V (and the positions that index them) live."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The K/V dtype."""

    @property
    @abstractmethod
    def native(self):
        """The engine's own cache object (what its forward and decoding loop take)."""

    @abstractmethod
    def geometry(self) -> tuple[int, int, int] | None:
        """(layers, KV heads, head dim), or None before anything is cached."""

    @abstractmethod
    def export(self, start: int = 0, end: int | None = None) -> DynamicCache:
        """The rows of positions ``start``..``end`` − 1 (None: to the end) of every layer, as views where the engine
        can (the caller reads them before the cache changes)."""

    @abstractmethod
    def append(self, rows: DynamicCache) -> None:
        """Append ``rows`` (positions length..length + n − 1 of every layer) to the cache."""

    @abstractmethod
    def write(self, start: int, rows: DynamicCache) -> None:
        """Overwrite positions ``start``..``start`` + n − 1 with ``rows``, in place."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Drop cached positions past ``length``."""

    @abstractmethod
    def copy(self) -> KVCache:
        """An independent copy (changing one leaves the other as it was)."""

    @abstractmethod
    def empty(self) -> KVCache:
        """A new, empty cache of this kind, in this cache's engine (e.g. for the target's own prefill of a prefix it
        writes into the cache it holds). A model's first cache comes from a `CacheFactory`, not from another model's
        cache."""

    @abstractmethod
    def storages(self) -> dict[tuple, int]:
        """The memory this cache holds: bytes per storage (storage shared by several caches named alike)."""

    @abstractmethod
    def supports_recompute(self, model) -> bool:
        """Whether ``model`` can recompute positions inside a forward on this cache (else only a prefix, by a
        prefill of its own)."""

    @abstractmethod
    def recompute(self, model, pending: Pending) -> None:
        """``model`` recomputes the pending positions in place (the cache length does not change)."""

    @abstractmethod
    def read(self, model, new_ids: torch.Tensor, logits_to_keep: int = 1,
             pending: Pending | None = None) -> torch.Tensor:
        """``model`` reads ``new_ids`` [batch, N] on top of the cache (which grows by N), recomputing the ``pending``
        positions in the same forward; the logits of the last ``logits_to_keep`` new tokens [batch, keep, vocab]."""

    def read_turn(self, model, new_ids: torch.Tensor, keep: int = 1, lookahead: int = 0) -> TurnRead:
        """``model`` reads ``new_ids`` [batch, N] on top of this cache and forgets them (the cache is left as it
        was): the attention it paid each cached position and the log-probs after the last ``keep`` tokens; with
        ``lookahead``, its greedy answer's attention too (`recompute.read_turn`, what ranks positions for
        `turn_attention`). This default reads on the exported rows with a `transformers` model; an engine that
        runs its models otherwise overrides it."""
        return read_turn(model, self.export(), new_ids, keep, lookahead)

    @classmethod
    def read_batch(cls, model, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """``model`` reads one more token on each of ``caches`` (one conversation each, all of this kind), each
        cache extended by it; the logits after each token [n, vocab]. This default reads them one by one; an engine
        that can batch them into one forward overrides it (a decode step of several requests)."""
        return torch.cat([cache.read(model, torch.tensor([[token]]), 1)[:, -1] for cache, token
                          in zip(caches, tokens, strict=True)])

    @abstractmethod
    def generate(self, model, input_ids: torch.Tensor,
                 first_read: Callable[[torch.Tensor, int], torch.Tensor] | None = None, **generate_kwargs):
        """The engine's decoding loop on this cache for ``input_ids`` [batch, length + N] (the cached tokens, then
        N ≥ 1 new ones); with ``first_read`` its first forward is ``first_read(new_ids, logits_to_keep)`` (a `read`
        that recomputes). Returns the full sequences [batch, length + N + generated]."""


class TransformersCache(KVCache):
    """`KVCache` on a `transformers` `DynamicCache` (``cache``): the engine is the model's own forward and
    ``generate``; positions are recomputed by `kvhandoff.runtime.recompute`'s sparse forward."""

    reads_history_queries: ClassVar[bool] = True

    def __init__(self, cache: DynamicCache | None = None) -> None:
        self.cache = DynamicCache() if cache is None else cache

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def device(self) -> torch.device:
        layers = self.cache.layers
        return layers[0].keys.device if layers and layers[0].keys is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        layers = self.cache.layers
        return layers[0].keys.dtype if layers and layers[0].keys is not None else torch.get_default_dtype()

    @property
    def native(self) -> DynamicCache:
        return self.cache

    def geometry(self) -> tuple[int, int, int] | None:
        layers = self.cache.layers
        if not layers or layers[0].keys is None:
            return None
        _, heads, _, head_dim = layers[0].keys.shape
        return len(layers), heads, head_dim

    def export(self, start: int = 0, end: int | None = None) -> DynamicCache:
        return cache_view(self.cache, start, end)

    def append(self, rows: DynamicCache) -> None:
        if not self.cache.layers:  # a fresh cache takes the rows as they are
            self.cache.layers.extend(rows.layers)
            return
        for own, new in zip(self.cache.layers, rows.layers, strict=True):
            own.keys = torch.cat([own.keys, new.keys.to(own.keys.device, own.keys.dtype)], dim=-2)
            own.values = torch.cat([own.values, new.values.to(own.values.device, own.values.dtype)], dim=-2)

    def write(self, start: int, rows: DynamicCache) -> None:
        for own, new in zip(self.cache.layers, rows.layers, strict=True):
            end = start + new.keys.shape[2]
            own.keys[:, :, start:end] = new.keys.to(own.keys.device)
            own.values[:, :, start:end] = new.values.to(own.values.device)

    def truncate(self, length: int) -> None:
        rollback(self.cache, length)

    def copy(self) -> TransformersCache:
        return TransformersCache(cache_copy(self.cache))

    def empty(self) -> TransformersCache:
        return TransformersCache()

    def storages(self) -> dict[tuple, int]:
        storages = {}
        for layer in self.cache.layers:
            for tensor in (layer.keys, layer.values):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
        return storages

    def supports_recompute(self, model) -> bool:
        return takes_custom_mask(model)

    def recompute(self, model, pending: Pending) -> None:
        recompute_positions(model, self.cache, pending.input_ids, pending.positions)

    @torch.inference_mode()
    def read(self, model, new_ids: torch.Tensor, logits_to_keep: int = 1,
             pending: Pending | None = None) -> torch.Tensor:
        if pending:
            return recompute_and_read(model, self.cache, pending.input_ids, pending.positions, new_ids,
                                      logits_to_keep)
        new_ids = new_ids.to(self.device if self.cache.layers else model_device(model))
        out = model(input_ids=new_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        if out.cache is not self.cache:  # transformers extends the cache in place; a new object would be lost
            self.cache = out.cache
        return out.logits

    @classmethod
    @torch.inference_mode()
    def read_batch(cls, model, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Caches of similar lengths (the longest at most `PAD_FACTOR` × the shortest) are read in one forward each:
        left-padded to the group's longest (the padding masked out, each row at its own positions), each cache then
        appending its row's new K/V. A cache of another kind, or an empty one, is read on its own."""
        if len(caches) == 1 or not all(isinstance(cache, TransformersCache) and cache.length for cache in caches):
            return super().read_batch(model, caches, tokens)
        order = sorted(range(len(caches)), key=lambda index: caches[index].length)
        groups: list[list[int]] = []
        for index in order:
            if groups and caches[index].length <= PAD_FACTOR * caches[groups[-1][0]].length:
                groups[-1].append(index)
            else:
                groups.append([index])
        logits: list[torch.Tensor | None] = [None] * len(caches)
        for group in groups:
            rows = _padded_read(model, [caches[i] for i in group], [tokens[i] for i in group])
            for index, row in zip(group, rows, strict=True):
                logits[index] = row
        return torch.stack(logits)

    @torch.inference_mode()
    def generate(self, model, input_ids: torch.Tensor,
                 first_read: Callable[[torch.Tensor, int], torch.Tensor] | None = None, **generate_kwargs):
        with self._first_forward(model, first_read):
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=self.cache,
                                  **generate_kwargs)

    @contextmanager
    def _first_forward(self, model, first_read):
        """While active, ``model``'s first forward on this cache is ``first_read``; a forward replaced on the model
        instance (accelerate's device hook) is kept and restored."""
        if first_read is None:
            yield
            return
        replaced = model.__dict__.get("forward")

        def restore() -> None:
            if replaced is None:
                model.__dict__.pop("forward", None)
            else:
                model.forward = replaced

        def forward(input_ids=None, cache=None, logits_to_keep=0, **kwargs):
            restore()  # later forwards: the model's own
            if cache is not self.cache or input_ids is None:
                return model.forward(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
            keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep else input_ids.shape[1]
            return CausalLMOutputWithPast(logits=first_read(input_ids, keep), cache=self.cache)

        model.forward = forward
        try:
            yield
        finally:
            restore()


#: how much longer than the shortest cache of a batched decode step the longest may be (the padding it costs)
PAD_FACTOR = 2


def _padded_read(model, caches: list[TransformersCache], tokens: list[int]) -> torch.Tensor:
    """One forward over ``caches`` left-padded to the longest; each cache appends its row's new K/V. The logits
    after each token [n, vocab]."""
    if len(caches) == 1:
        return caches[0].read(model, torch.tensor([tokens], device=caches[0].device).T, 1)[:, -1]
    lengths = torch.tensor([cache.length for cache in caches])
    longest = int(lengths.max())

    def padded(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([functional.pad(t, (0, 0, longest - t.shape[2], 0)) for t in tensors])

    layers = zip(*(cache.cache.layers for cache in caches), strict=True)
    batch = cache_of((padded([layer.keys for layer in rows]), padded([layer.values for layer in rows]))
                     for rows in layers)
    device = caches[0].device
    mask = (torch.arange(longest + 1) >= (longest - lengths)[:, None]).long().to(device)
    out = model(input_ids=torch.tensor(tokens, device=device)[:, None], cache=batch, attention_mask=mask,
                position_ids=lengths[:, None].to(device), use_cache=True, logits_to_keep=1)
    grown = out.cache if out.cache is not None else batch
    for row, cache in enumerate(caches):
        cache.append(cache_of((layer.keys[row:row + 1, :, longest:], layer.values[row:row + 1, :, longest:])
                              for layer in grown.layers))
    return out.logits[:, -1]


def as_kv_cache(cache) -> KVCache:
    """``cache`` behind the seam: a `KVCache` as it is, a `transformers` cache wrapped (`TransformersCache`)."""
    return cache if isinstance(cache, KVCache) else TransformersCache(cache)


#: how the runtime gets a model's fresh, empty cache: ``factory(model)`` → a `KVCache` of the engine that runs
#: ``model`` (what a handoff's target cache, a source's prefill and a session's first turn start from)
CacheFactory = Callable[[Any], KVCache]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do at a switch, read off its models (`capabilities_of`).

    engine: its name in messages. recompute_rules: the recompute rules (`RecomputePolicy.rule`) it serves (None:
    every rule; an engine without access to the model's layers serves only the rules that pick positions without
    them)."""

    engine: str = "transformers"
    recompute_rules: tuple[str, ...] | None = None

    def serves(self, recompute) -> bool:
        """Whether a switch on this backend can serve recompute policy ``recompute`` (a `RecomputePolicy`)."""
        return not recompute.active or self.recompute_rules is None or recompute.rule in self.recompute_rules

    def refusal(self, recompute) -> str:
        """Why ``recompute`` cannot be served here, and the fix (for a policy `serves` refuses)."""
        return (f"recompute {recompute.spec!r}: a {self.engine} target recomputes by the rules "
                f"{', '.join(self.recompute_rules or ())} (the others rank positions with a transformers model's "
                "layers); choose one of those, e.g. recent:5%")


#: what a `transformers` model can do (every recompute rule)
TRANSFORMERS_CAPABILITIES = Capabilities()


def capabilities_of(model) -> Capabilities:
    """The `Capabilities` of the backend that runs ``model``: its ``kvhandoff_capabilities`` where its engine
    declares them (`kvhandoff.runtime.llama_cpp.backend.LlamaCppModel`), else a `transformers` model's."""
    declared = getattr(model, "kvhandoff_capabilities", None)
    return declared if isinstance(declared, Capabilities) else TRANSFORMERS_CAPABILITIES


def new_cache(model=None) -> KVCache:
    """An empty cache for ``model`` in the engine that runs it: the default `CacheFactory`. A model of another engine
    makes its own (its ``new_cache()``, e.g. `kvhandoff.runtime.llama_cpp.backend.LlamaCppModel`); a `transformers`
    model gets a `TransformersCache`."""
    own = getattr(model, "new_cache", None)
    if not callable(own):
        return TransformersCache()
    cache = own()
    if not isinstance(cache, KVCache):
        raise TypeError(f"{type(model).__name__}.new_cache() made a {type(cache).__name__}, not a KVCache")
    return cache


def rows_of(layers) -> DynamicCache:
    """Rows in the seam's exchange format from (keys, values) [batch, kv_heads, positions, head_dim] per layer."""
    return cache_of(layers)
