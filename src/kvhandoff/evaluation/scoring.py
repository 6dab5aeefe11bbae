"""Conditions (who prefills the context) and the scoring every task shares.

A :class:`Condition` turns ``context_ids[:-1]`` into a KV cache and names the model that reads on from it:

- ``target``:   the target prefills; the target reads on.
- ``source``:   the source prefills; the source reads on (the source model standalone).
- ``transfer``: the source prefills, ``mapper.transfer`` maps the cache; the target reads on.

The reading model then consumes the last context token (whose logits predict the first continuation token)
and the continuation. Multiple-choice items prefill each distinct context once per condition and score every
choice from that cache, rolling it back with ``cache.crop`` between choices.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.evaluation.tasks import GenItem, MCItem


class Condition:
    """How the context cache is made (:meth:`prefill`) and which model reads on from it (``reader``)."""

    name: str
    reader: Any

    def prefill(self, input_ids: torch.Tensor):
        """A cache for ``input_ids`` [1, T] that ``reader`` can continue from."""
        raise NotImplementedError


class Standalone(Condition):
    """A model on its own: it prefills the context and reads on."""

    def __init__(self, name: str, model) -> None:
        self.name, self.model, self.reader = name, model, model

    def prefill(self, input_ids: torch.Tensor):
        from kvhandoff.handoff import prefill

        return prefill(self.model, input_ids.to(model_device(self.model)))[0]


class Transfer(Condition):
    """The source prefills, the mapper converts the cache, the target reads on.

    exact_prefix: the target recomputes that many leading positions itself (``kvhandoff.handoff``'s
    attention-sink patch); 0 = a purely mapped cache; None = the mapper's own setting.
    """

    def __init__(self, name: str, source_model, target_model, mapper, exact_prefix: int | None = None) -> None:
        if exact_prefix is None:
            exact_prefix = getattr(mapper, "exact_prefix", 0)
        if exact_prefix < 0:
            raise ConfigError(f"exact_prefix must be >= 0, got {exact_prefix}")
        self.name, self.source, self.reader, self.mapper = name, source_model, target_model, mapper
        self.exact_prefix = exact_prefix

    def prefill(self, input_ids: torch.Tensor):
        from kvhandoff.handoff import handoff_cache

        return handoff_cache(self.source, self.reader, self.mapper, input_ids, self.exact_prefix)


def patch_prefix(cache, target_model, input_ids: torch.Tensor, exact_prefix: int | None):
    """``kvhandoff.handoff.patch_exact_prefix`` on the target's device (a no-op for 0 or None)."""
    from kvhandoff.handoff import patch_exact_prefix

    return patch_exact_prefix(cache, target_model, input_ids.to(model_device(target_model)), exact_prefix)


def transfer_cache(mapper, cache, source_model, target_model):
    """``mapper.transfer(cache)``, asking for the target's dtype when it differs from the source's."""
    src_dtype, tgt_dtype = getattr(source_model, "dtype", None), getattr(target_model, "dtype", None)
    if tgt_dtype is not None and src_dtype != tgt_dtype:
        return mapper.transfer(cache, dtype=tgt_dtype)
    return mapper.transfer(cache)


def standard_conditions(
    source_model, target_model, mapper, exact_prefix: int | None = None
) -> dict[str, Condition]:
    """The three conditions of one direction, in the order they are evaluated: target, source, transfer."""
    return {
        "target": Standalone("target", target_model),
        "source": Standalone("source", source_model),
        "transfer": Transfer("transfer", source_model, target_model, mapper, exact_prefix),
    }


# -- low-level cache helpers ----------------------------------------------------------------------------------


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def feed(model, cache, ids: Sequence[int]) -> torch.Tensor:
    """Run ``ids`` through ``model`` on top of ``cache`` (extended in place); float32 log-probs [len(ids), V]."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model_device(model))
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    if out.cache is not cache:  # transformers extends the cache in place; be strict about it
        raise RuntimeError("the model returned a new cache object instead of extending the given one")
    return out.logits[0].float().log_softmax(-1)


def _crop_is_exact(cache) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def rollback(cache, length: int) -> None:
    """Drop cached positions beyond ``length``."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot roll a cache of {cache.get_seq_length()} tokens back to {length}")
    if extra:
        cache.crop(-extra)  # transformers 5: a negative count of tokens to remove


@dataclass
class OpenContext:
    """A condition's cache holding the whole context, and the log-probs of the token after it."""

    reader: Any
    cache: Any
    length: int
    next_logprobs: torch.Tensor  # [V], float32


def open_context(condition: Condition, context_ids: Sequence[int]) -> OpenContext:
    """Prefill ``context_ids[:-1]`` with the condition, then let its reader consume the last context token."""
    if len(context_ids) < 2:
        raise ConfigError("a context needs at least 2 tokens (the prefill covers all but the last)")
    with torch.inference_mode():
        cache = condition.prefill(torch.tensor([list(context_ids[:-1])], dtype=torch.long))
        if cache.get_seq_length() != len(context_ids) - 1:
            raise RuntimeError(
                f"condition {condition.name!r} returned a cache of {cache.get_seq_length()} tokens for a "
                f"{len(context_ids) - 1}-token prefill"
            )
        logprobs = feed(condition.reader, cache, context_ids[-1:])[-1]
    return OpenContext(condition.reader, cache, len(context_ids), logprobs)


def continuation_logprobs(
    condition: Condition, context_ids: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Per-token log-probs of each continuation given the context, from one prefill of the context."""
    if any(len(c) == 0 for c in continuations):
        raise ConfigError("every continuation needs at least one token")
    state = open_context(condition, context_ids)
    exact = _crop_is_exact(state.cache)
    results = []
    with torch.inference_mode():
        for cont in continuations:
            first = state.next_logprobs[cont[0]].reshape(1)
            if len(cont) == 1:
                results.append(first)
                continue
            cache = state.cache if exact else copy.deepcopy(state.cache)
            logprobs = feed(state.reader, cache, cont[:-1])
            rest = logprobs[torch.arange(len(cont) - 1), torch.tensor(list(cont[1:]))]
            results.append(torch.cat([first, rest.to(first.device)]))
            if exact:
                rollback(state.cache, state.length)
    return results


def score_continuations(
    condition: Condition, context_ids: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[float]:
    """Summed log-likelihood of each continuation given the shared context (one prefill per call)."""
    return [float(lp.double().sum()) for lp in continuation_logprobs(condition, context_ids, continuations)]


# -- tokenisation ---------------------------------------------------------------------------------------------


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing context spaces move to the continuation; the continuation's tokens are
    ``encode(context + continuation)`` minus the context's token count."""
    n_spaces = len(context) - len(context.rstrip(" "))
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    context_ids = encode(tokenizer, context)
    whole = encode(tokenizer, context + continuation)
    return context_ids, whole[len(context_ids) :]


# -- generation -----------------------------------------------------------------------------------------------


def eos_token_ids(tokenizer, model=None) -> set[int]:
    ids: set[int] = set()
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    candidates.append(getattr(generation_config, "eos_token_id", None))
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list | tuple):
            ids.update(int(x) for x in c)
    return ids


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    positions = [text.find(s) for s in stop if s and s in text]
    if not positions:
        return text, False
    return text[: min(positions)], True


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
            text, stopped = _cut_at_stop(tokenizer.decode(generated), stop)
            if stopped or step == max_new_tokens - 1:
                break
            logprobs = feed(state.reader, state.cache, [token])[-1]
    if not generated:
        text = ""
    return text, generated


def generate_greedy(
    condition: Condition, tokenizer, context_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = ()
) -> str:
    """Greedy continuation of ``context_ids`` under the condition, cut at the first stop string."""
    return greedy_from(open_context(condition, context_ids), tokenizer, max_new_tokens, stop)[0]


# -- items ----------------------------------------------------------------------------------------------------


def evaluate_mc_item(condition: Condition, tokenizer, item: MCItem) -> dict[str, Any]:
    """Log-likelihood of every choice; choices sharing a context share its prefill."""
    groups: dict[str, list[int]] = {}
    for i, choice in enumerate(item.choices):
        groups.setdefault(choice.context, []).append(i)
    lls: list[float] = [0.0] * len(item.choices)
    for context, indices in groups.items():
        pairs = [encode_pair(tokenizer, context, item.choices[i].continuation) for i in indices]
        context_ids = pairs[0][0]
        scores = score_continuations(condition, context_ids, [cont for _, cont in pairs])
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
    output = generate_greedy(condition, tokenizer, encode(tokenizer, item.context), max_new_tokens, item.stop)
    return {"id": item.id, "output": output, "gold": item.answer}


def evaluate_item(condition: Condition, tokenizer, item: MCItem | GenItem, max_new_tokens: int = 256) -> dict:
    if isinstance(item, MCItem):
        return evaluate_mc_item(condition, tokenizer, item)
    return evaluate_gen_item(condition, tokenizer, item, max_new_tokens)
