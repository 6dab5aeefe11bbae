"""Shared helpers of the evaluation tests: stand-in mappers, short items, a reference log-prob. (The byte-level
tokenizer and the tiny models are conftest's `ByteTokenizer` and `tiny_model(..., **BYTE_MODEL)`.)"""

from __future__ import annotations

import torch


class IdentityMapper:
    """A stand-in mapper for source == target: hands the cache over unchanged (a handoff through it is exact
    under a plan that recomputes nothing)."""

    def __init__(self) -> None:
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls

    def transfer(self, source_cache, position_ids=None, dtype=None):
        self._calls += 1
        return source_cache


class NoisyMapper:
    """A stand-in mapper that perturbs the values (transfer then differs from target)."""

    def __init__(self, scale: float = 0.5, seed: int = 0) -> None:
        self.scale, self.seed = scale, seed

    def transfer(self, source_cache, position_ids=None, dtype=None):
        from transformers import DynamicCache

        gen = torch.Generator().manual_seed(self.seed)
        out = DynamicCache()
        for i, layer in enumerate(source_cache.layers):
            noise = torch.randn(layer.values.shape, generator=gen) * self.scale
            out.update(layer.keys.clone(), layer.values + noise, i)
        return out


def short_items(task: str, n: int = 1, among: int = 40):
    """The ``n`` items with the shortest contexts among the first ``among`` (keeps byte-level tests fast)."""
    from kvhandoff_lab.evaluation.tasks import MCItem, load_items

    def length(item):
        return max(len(c.context) for c in item.choices) if isinstance(item, MCItem) else len(item.context)

    return sorted(load_items(task)[:among], key=length)[:n]


def full_sequence_logprob(model, context_ids: list[int], continuation_ids: list[int]) -> float:
    """Reference: one forward pass over context + continuation from scratch, no cache reuse."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(context_ids)
    positions = torch.arange(n - 1, n - 1 + len(continuation_ids))
    return float(logprobs[positions, torch.tensor(continuation_ids)].double().sum())
