"""Conditions (who prefills the context) and the scoring every task shares.

A :class:`Condition` turns ``context_ids[:-1]`` into a KV cache and names the model that reads on from it:

- ``target``:   the target prefills; the target reads on.
- ``source``:   the source prefills; the source reads on (the source model standalone).
- ``transfer``: the source prefills, ``mapper.transfer`` maps the cache; the target reads on. With
  ``mapped="history"`` (:class:`TransferHistory`) only the item's few-shot history (its shared prefix) is
  mapped and the target prefills the new turn (the question) itself: a switch at a turn boundary.

The reading model then consumes the last context token (whose logits predict the first continuation token)
and the continuation. Multiple-choice items prefill each distinct context once per condition and score every
choice from that cache, rolling it back with ``cache.crop`` between choices.

Few-shot prefixes shared across items (``shared_prefix`` of MMLU and GSM8K items) are prefilled once per
condition and kept in a small LRU (:class:`PrefixCache`, keyed by token ids): each item starts from a deep copy
and prefills only its own tokens. ``target``/``source`` reuse the model's own prefix cache; ``transfer`` reuses
the *source's* and maps the whole extended source cache as before. Reuse needs token-level agreement
(``context_ids[:len(prefix_ids)] == prefix_ids``); otherwise the context is prefilled in full.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import feed, model_device, prefill, rollback
from kvhandoff.model.loading import end_of_text_ids
from kvhandoff.runtime.handoff import check_context, handoff_cache, map_for_target
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff_lab.evaluation.tasks import GenItem, MCItem, cut_at_stop, encode, encode_pair

#: prefilled few-shot prefixes kept per condition (MMLU has 57 subject prefixes, GSM8K one)
PREFIX_CACHE_ENTRIES = 4


class PrefixCache:
    """Prefilled shared prefixes, keyed by their token ids, least recently used dropped beyond ``max_entries``
    (0 = keep none). Callers get deep copies; the stored caches are never extended."""

    def __init__(self, max_entries: int = PREFIX_CACHE_ENTRIES) -> None:
        if max_entries < 0:
            raise ConfigError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self.hits = self.misses = self.mismatches = 0  # mismatches: contexts not starting with the prefix ids

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prefix_ids: Sequence[int]) -> bool:
        return tuple(prefix_ids) in self._entries

    def keys(self) -> list[tuple[int, ...]]:
        """Stored prefixes, least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def copy_of(self, prefix_ids: Sequence[int], build: Callable[[], Any]):
        """A private copy of the cache of ``prefix_ids`` (``build()`` makes it on a miss)."""
        key = tuple(int(i) for i in prefix_ids)
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return copy.deepcopy(self._entries[key])
        self.misses += 1
        cache = build()
        if self.max_entries == 0:
            return cache
        self._entries[key] = cache
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return copy.deepcopy(cache)

    def prefill(self, model, input_ids: torch.Tensor, prefix_len: int):
        """``model``'s cache of ``input_ids`` [1, T]: a copy of the cached first ``prefix_len`` tokens, extended
        by the rest (a plain prefill when ``prefix_len`` is 0)."""
        input_ids = input_ids.to(model_device(model))
        if not 0 <= prefix_len <= input_ids.shape[1]:
            raise ConfigError(f"prefix_len {prefix_len} outside 0..{input_ids.shape[1]}")
        if prefix_len == 0:
            return prefill(model, input_ids)[0]
        cache = self.copy_of(input_ids[0, :prefix_len].tolist(), lambda: prefill(model, input_ids[:, :prefix_len])[0])
        if input_ids.shape[1] > prefix_len:
            prefill(model, input_ids[:, prefix_len:], cache)
        return cache


class Condition:
    """How the context cache is made (:meth:`prefill`) and which model reads on from it (``reader``).

    ``prefixes``: the condition's :class:`PrefixCache`, or None when it does not reuse shared prefixes.
    """

    name: str
    reader: Any
    prefixes: PrefixCache | None = None

    def prefill(self, input_ids: torch.Tensor, prefix_len: int = 0):
        """A cache for ``input_ids`` [1, T] that ``reader`` can continue from; the first ``prefix_len`` tokens
        are a shared prefix whose prefill may come from ``prefixes`` (only passed when ``prefixes`` is set)."""
        raise NotImplementedError

    def read_context(self, context_ids: torch.Tensor, prefix_len: int = 0):
        """(cache of all of ``context_ids`` [1, T], float32 log-probs of the token after it [V]): `prefill` of all
        but the last token, then ``reader`` reads the last."""
        input_ids = context_ids[:, :-1]
        cache = self.prefill(input_ids, prefix_len) if prefix_len else self.prefill(input_ids)
        if cache.get_seq_length() != input_ids.shape[1]:
            raise RuntimeError(
                f"condition {self.name!r} returned a cache of {cache.get_seq_length()} tokens for a "
                f"{input_ids.shape[1]}-token prefill"
            )
        return cache, feed(self.reader, cache, context_ids[0, -1:].tolist())[-1]


class Standalone(Condition):
    """A model on its own: it prefills the context and reads on.

    prefix_entries: shared prefixes kept prefilled (:class:`PrefixCache`; 0 = no reuse).
    """

    def __init__(self, name: str, model, prefix_entries: int = PREFIX_CACHE_ENTRIES) -> None:
        self.name, self.model, self.reader = name, model, model
        self.prefixes = PrefixCache(prefix_entries) if prefix_entries else None

    def prefill(self, input_ids: torch.Tensor, prefix_len: int = 0):
        if prefix_len and self.prefixes is not None:
            return self.prefixes.prefill(self.model, input_ids, prefix_len)
        return prefill(self.model, input_ids.to(model_device(self.model)))[0]


class Transfer(Condition):
    """The source prefills, the mapper converts the cache, the target reads on.

    exact_prefix: the target recomputes that many leading positions itself (``kvhandoff.runtime.handoff``'s
    attention-sink patch); 0 = a purely mapped cache; None = the mapper's own setting.
    prefix_entries: shared prefixes kept prefilled by the *source* (0 = no reuse); the extended source cache
    is mapped as a whole, as without reuse.
    recompute: the selective-recompute policy of every handoff (a `RecomputePolicy`; None = `DEFAULT_RECOMPUTE`).
    Both make up the handoffs' `HandoffPlan` (``plan``).
    """

    def __init__(
        self,
        name: str,
        source_model,
        target_model,
        mapper,
        exact_prefix: int | None = None,
        prefix_entries: int = PREFIX_CACHE_ENTRIES,
        recompute: RecomputePolicy | None = None,
    ) -> None:
        if exact_prefix is None:
            exact_prefix = getattr(mapper, "exact_prefix", 0)
        if exact_prefix < 0:
            raise ConfigError(f"exact_prefix must be >= 0, got {exact_prefix}")
        self.name, self.source, self.reader, self.mapper = name, source_model, target_model, mapper
        self.plan = HandoffPlan(exact_prefix, DEFAULT_RECOMPUTE if recompute is None else recompute)
        self.exact_prefix, self.recompute = exact_prefix, self.plan.recompute
        self.prefixes = PrefixCache(prefix_entries) if prefix_entries else None

    def prefill(self, input_ids: torch.Tensor, prefix_len: int = 0):

        source_cache = None
        if prefix_len and self.prefixes is not None:
            source_cache = self.prefixes.prefill(self.source, input_ids, prefix_len)
        return handoff_cache(self.source, self.reader, self.mapper, input_ids, self.plan, source_cache)

    def read_context(self, context_ids: torch.Tensor, prefix_len: int = 0):
        """All but the last token mapped; the target recomputes the exact prefix (and the recompute policy's picks)
        in the forward that reads the last token (`MappedCache.read`): one target forward."""
        check_context(context_ids.shape[1], self.reader, self.mapper)
        source_cache = None
        if prefix_len and self.prefixes is not None:
            source_cache = self.prefixes.prefill(self.source, context_ids[:, :-1], prefix_len)
        mapped = map_for_target(self.source, self.reader, self.mapper, context_ids[:, :-1], self.plan, source_cache)
        logits = mapped.read(self.reader, context_ids[:, -1:])
        # the engine's own cache: the scoring reads on from every condition's cache alike (feed, crop, deep copies
        # of transformers caches), the standalone conditions' being the models' own
        return mapped.cache.native, logits[0, -1].float().log_softmax(-1)


class TransferHistory(Transfer):
    """The mapped cache holds the item's few-shot history (its shared prefix) only; the target prefills the rest
    of the context, the new turn, on top of it.

    This is a model switch at a turn boundary: the new turn has not been read by any model yet, so the target
    reads it itself at the cost of a prefill of the turn alone. Each history is prefilled by the source, mapped
    and patched once and kept in the prefix cache, so every item sharing it starts from a copy of the same
    mapped cache. Items without a history (``prefix_len`` 0) are refused.
    """

    def __init__(self, name: str, source_model, target_model, mapper, exact_prefix: int | None = None,
                 prefix_entries: int = PREFIX_CACHE_ENTRIES, recompute: RecomputePolicy | None = None) -> None:
        super().__init__(name, source_model, target_model, mapper, exact_prefix, prefix_entries, recompute)
        self.prefixes = PrefixCache(prefix_entries)  # the history boundary is needed even without reuse

    # the history's patched cache is kept and copied for every item sharing it, so its exact prefix is recomputed
    # once per history; the item's own tokens and its last token are read as by a standalone model
    read_context = Condition.read_context

    def prefill(self, input_ids: torch.Tensor, prefix_len: int = 0):

        if not prefix_len:
            raise ConfigError(
                "mapped='history' needs items with a few-shot history whose tokens begin the context (MMLU, "
                "GSM8K); use mapped='all' for zero-shot tasks"
            )
        history = input_ids[:, :prefix_len]
        cache = self.prefixes.copy_of(
            history[0].tolist(),
            lambda: handoff_cache(self.source, self.reader, self.mapper, history, self.plan),
        )
        if input_ids.shape[1] > prefix_len:
            prefill(self.reader, input_ids[:, prefix_len:].to(model_device(self.reader)), cache)
        return cache


#: what the transfer condition maps: "all" — the whole context; "history" — the few-shot history only, the
#: target prefills the new turn (:class:`TransferHistory`)
MAPPED_PARTS = ("all", "history")


def check_mapped(mapped: str) -> str:
    """``mapped`` if it is one of `MAPPED_PARTS`; else a ConfigError that names them."""
    if mapped not in MAPPED_PARTS:
        raise ConfigError(f"mapped must be one of {', '.join(MAPPED_PARTS)}, got {mapped!r}")
    return mapped


def standard_conditions(
    source_model, target_model, mapper, exact_prefix: int | None = None, mapped: str = "all",
    recompute: RecomputePolicy | None = None,
) -> dict[str, Condition]:
    """The three conditions of one direction, in the order they are evaluated: target, source, transfer
    (recompute: the transfer's selective-recompute policy, None = `DEFAULT_RECOMPUTE`)."""
    transfer = Transfer if check_mapped(mapped) == "all" else TransferHistory
    return {
        "target": Standalone("target", target_model),
        "source": Standalone("source", source_model),
        "transfer": transfer("transfer", source_model, target_model, mapper, exact_prefix, recompute=recompute),
    }


# -- low-level cache helpers ----------------------------------------------------------------------------------


def _crop_is_exact(cache) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


@dataclass
class OpenContext:
    """A condition's cache holding the whole context, and the log-probs of the token after it."""

    reader: Any
    cache: Any
    length: int
    next_logprobs: torch.Tensor  # [V], float32


def reusable_prefix_len(context_ids: Sequence[int], prefix_ids: Sequence[int] | None) -> int:
    """``len(prefix_ids)`` when the context's prefill (``context_ids[:-1]``) starts with exactly those token ids,
    else 0 (tokenisation at the prefix boundary can differ from the prefix's own)."""
    if not prefix_ids:
        return 0
    n = len(prefix_ids)
    if n > len(context_ids) - 1 or list(context_ids[:n]) != list(prefix_ids):
        return 0
    return n


def open_context(
    condition: Condition, context_ids: Sequence[int], prefix_ids: Sequence[int] | None = None
) -> OpenContext:
    """Prefill ``context_ids[:-1]`` with the condition, then let its reader consume the last context token.

    prefix_ids: the token ids of a shared few-shot prefix; when the context starts with them and the condition
    keeps a prefix cache, the prefix's prefill is reused (see the module docstring).
    """
    if len(context_ids) < 2:
        raise ConfigError("a context needs at least 2 tokens (the prefill covers all but the last)")
    prefixes = getattr(condition, "prefixes", None)
    prefix_len = reusable_prefix_len(context_ids, prefix_ids) if prefixes is not None else 0
    if prefix_ids and prefixes is not None and not prefix_len:
        prefixes.mismatches += 1
    with torch.inference_mode():
        cache, logprobs = condition.read_context(torch.tensor([list(context_ids)], dtype=torch.long), prefix_len)
    return OpenContext(condition.reader, cache, len(context_ids), logprobs)


@torch.inference_mode()
def continuation_rows(
    condition: Condition,
    context_ids: Sequence[int],
    continuations: Sequence[Sequence[int]],
    prefix_ids: Sequence[int] | None = None,
) -> Iterator[torch.Tensor]:
    """For each continuation in turn, the reader's float32 log-probs at its positions [len(cont), vocab] (row i:
    the distribution of its token i given the context and the tokens before), from one prefill of the context."""
    state = open_context(condition, context_ids, prefix_ids)
    exact = _crop_is_exact(state.cache)
    for cont in continuations:
        rows = state.next_logprobs.unsqueeze(0)
        if len(cont) > 1:
            cache = state.cache if exact else copy.deepcopy(state.cache)
            rows = torch.cat([rows, feed(state.reader, cache, cont[:-1]).to(rows.device)])
            if exact:
                rollback(state.cache, state.length)
        yield rows


def picked(rows: torch.Tensor, cont: Sequence[int]) -> torch.Tensor:
    """The log-probs of ``cont``'s own tokens in its `continuation_rows` [len(cont)]."""
    return rows[torch.arange(len(cont), device=rows.device), torch.tensor(list(cont), device=rows.device)]


def continuation_logprobs(
    condition: Condition,
    context_ids: Sequence[int],
    continuations: Sequence[Sequence[int]],
    prefix_ids: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs of each continuation given the context, from one prefill of the context."""
    if any(len(c) == 0 for c in continuations):
        raise ConfigError("every continuation needs at least one token")
    rows = continuation_rows(condition, context_ids, continuations, prefix_ids)
    return [picked(row, cont) for row, cont in zip(rows, continuations, strict=True)]


def score_continuations(
    condition: Condition,
    context_ids: Sequence[int],
    continuations: Sequence[Sequence[int]],
    prefix_ids: Sequence[int] | None = None,
) -> list[float]:
    """Summed log-likelihood of each continuation given the shared context (one prefill per call)."""
    logprobs = continuation_logprobs(condition, context_ids, continuations, prefix_ids)
    return [float(lp.double().sum()) for lp in logprobs]


# -- tokenisation ---------------------------------------------------------------------------------------------


# -- generation -----------------------------------------------------------------------------------------------


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end generation: the tokenizer's and the model's EOS, and every end-of-text special token
    the tokenizer has (`kvhandoff.model.loading.end_of_text_ids`; models loaded by `load_model` already list them)."""
    ids = set(end_of_text_ids(tokenizer))
    generation_config = getattr(model, "generation_config", None)
    for c in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list | tuple):
            ids.update(int(x) for x in c)
    return ids


def greedy_from(state: OpenContext, tokenizer, max_new_tokens: int, stop: Sequence[str] = ()) -> tuple[str, list[int]]:
    """Greedy-decode from an open context (the cache grows by the tokens fed). Returns (text cut at the
    first stop string, generated token ids up to and including the one that completed a stop/EOS)."""
    eos = eos_token_ids(tokenizer, state.reader)
    generated: list[int] = []
    logprobs = state.next_logprobs
    text = ""
    with torch.inference_mode():
        for step in range(max_new_tokens):
            token = int(logprobs.argmax())
            if token in eos:
                break
            generated.append(token)
            text, stopped = cut_at_stop(tokenizer.decode(generated), stop)
            if stopped or step == max_new_tokens - 1:
                break
            logprobs = feed(state.reader, state.cache, [token])[-1]
    if not generated:
        text = ""
    return text, generated


def generate_greedy(
    condition: Condition,
    tokenizer,
    context_ids: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[str] = (),
    prefix_ids: Sequence[int] | None = None,
) -> str:
    """Greedy continuation of ``context_ids`` under the condition, cut at the first stop string."""
    return greedy_from(open_context(condition, context_ids, prefix_ids), tokenizer, max_new_tokens, stop)[0]


# -- items ----------------------------------------------------------------------------------------------------


def prefix_ids_of(tokenizer, item: MCItem | GenItem) -> list[int] | None:
    """The token ids of the item's shared few-shot prefix, encoded as contexts are (special tokens included)."""
    prefix = getattr(item, "shared_prefix", None)
    return encode(tokenizer, prefix) if prefix else None


def evaluate_mc_item(condition: Condition, tokenizer, item: MCItem) -> dict[str, Any]:
    """Log-likelihood of every choice; choices sharing a context share its prefill, items sharing a few-shot
    prefix share the prefix's prefill."""
    prefix_ids = prefix_ids_of(tokenizer, item)
    groups: dict[str, list[int]] = {}
    for i, choice in enumerate(item.choices):
        groups.setdefault(choice.context, []).append(i)
    lls: list[float] = [0.0] * len(item.choices)
    for context, indices in groups.items():
        pairs = [encode_pair(tokenizer, context, item.choices[i].continuation) for i in indices]
        context_ids = pairs[0][0]
        scores = score_continuations(condition, context_ids, [cont for _, cont in pairs], prefix_ids)
        for i, score in zip(indices, scores, strict=True):
            lls[i] = score
    return {
        "id": item.id,
        "loglikelihoods": lls,
        "norm_lengths": [c.norm_length for c in item.choices],
        "gold": item.gold,
    }


def evaluate_gen_item(condition: Condition, tokenizer, item: GenItem, max_new_tokens: int = 256) -> dict[str, Any]:
    """Greedy generation for one item (the context is encoded as a whole, special tokens included)."""
    context_ids, prefix_ids = encode(tokenizer, item.context), prefix_ids_of(tokenizer, item)
    output = generate_greedy(condition, tokenizer, context_ids, max_new_tokens, item.stop, prefix_ids)
    return {"id": item.id, "output": output, "gold": item.answer}


def evaluate_item(condition: Condition, tokenizer, item: MCItem | GenItem, max_new_tokens: int = 256) -> dict:
    if isinstance(item, MCItem):
        return evaluate_mc_item(condition, tokenizer, item)
    return evaluate_gen_item(condition, tokenizer, item, max_new_tokens)
