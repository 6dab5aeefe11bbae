"""What the runtime's tests share: token ids, K/V comparisons and the tiny pairs a mapper is fitted between."""

import torch

from kvhandoff import FitConfig, fit_mapper

from conftest import exactly_related, random_batches, tiny_model

#: a fit that makes the map between exactly related models exact (to round-off)
EXACT_FIT = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)


def ids_of(batch=1, tokens=40, seed=3):
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def max_kv_diff(a, b, positions=slice(None)):
    """The largest difference between two caches' K or V at ``positions``."""
    return max(max((x.keys[:, :, positions] - y.keys[:, :, positions]).abs().max().item(),
                   (x.values[:, :, positions] - y.values[:, :, positions]).abs().max().item())
               for x, y in zip(a.layers, b.layers, strict=True))


def exact_pair():
    """A tiny source, a target exactly related to it, and the exact mapper between them."""
    source = tiny_model("qwen2", layers=3)
    target = exactly_related(source)
    return source, target, fit_mapper(source, target, random_batches(), EXACT_FIT, progress=False)


def inexact_pair():
    """Two unrelated tiny models and a ridge mapper between them: the mapped cache is far from the target's own."""
    source = tiny_model("qwen2", layers=2, seed=0)
    target = tiny_model("qwen2", layers=3, head_dim=32, seed=1)
    return source, target, fit_mapper(source, target, random_batches(count=2), FitConfig(top_k=1), progress=False)
