"""Handoff: the source prefills, the mapper converts its cache, the target decodes on."""

from __future__ import annotations

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper import Mapper


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, cache=None):
    """Run `model` over `input_ids` [batch, tokens]; return (cache, logits of the last position [batch, vocab])."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1]


def _check_ids(input_ids: torch.Tensor, minimum: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] < minimum:
        raise ConfigError(
            f"input_ids must be [batch, tokens] with at least {minimum} token(s), got {tuple(input_ids.shape)}"
        )


def handoff_cache(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor):
    """The target's cache for all of `input_ids`, built from the source's prefill (no target prefill)."""
    _check_ids(input_ids, 1)
    source_cache, _ = prefill(source_model, input_ids)
    return mapper.transfer(source_cache, dtype=target_model.dtype)


@torch.inference_mode()
def handoff_generate(source_model, target_model, mapper: Mapper, input_ids: torch.Tensor, **generate_kwargs):
    """Source prefills all but the last token; the mapped cache goes to the target, which generates.

    generate_kwargs go to `target_model.generate` (max_new_tokens, do_sample, temperature, ...).
    Returns the full sequences [batch, tokens + new], as `generate` does.
    """
    _check_ids(input_ids, 2)
    cache = handoff_cache(source_model, target_model, mapper, input_ids[:, :-1])
    attention_mask = torch.ones_like(input_ids)
    return target_model.generate(
        input_ids=input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs
    )
