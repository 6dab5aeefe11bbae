"""Reuse at another offset: the rows a cache holds for a run of tokens, placed where the run sits in another prompt
(after another beginning: other instructions, another tool list), and what the target recomputes there.

Keys carry their positions (RoPE): `reposition_keys` strips the old rotation and applies the new one, exact for every
rope type `kvhandoff.model.rope` supports up to float rounding; values carry none. The run's rows were computed
attending to the old beginning, so they deviate from what the new beginning gives: `reuse_run` builds the target's
cache of [new beginning ‖ run] as a `MappedCache` whose pending positions are the new beginning (an exact prefix,
copied from the plan's prefix store when it holds it) and the run positions the plan's recompute policy picks —
the rows that deviate most (`deviation`, CacheBlend), the run's first tokens (`sinks`, EPIC), the latest ones
(`recent`), the positions the source attends to while it reads the new turn on the conversation that holds the run
(`turn_attention`, its read placed by `moved_read`), or a mix — recomputed in the target's next forward with the
tokens after the run. The run's rows may be the target's own or mapped from another model of the family; either way
they are approximate until recomputed.
"""

from __future__ import annotations

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_of
from kvhandoff.model.rope import apply_rope, rope_frequencies, strip_rope
from kvhandoff.runtime import policy
from kvhandoff.runtime.handoff import MappedCache, check_context
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy, SelectionInfo
from kvhandoff.runtime.seam import CacheFactory, as_kv_cache, new_cache


def reposition_keys(keys: torch.Tensor, old_start: int, new_start: int, config) -> torch.Tensor:
    """Keys [batch, kv_heads, tokens, head_dim] rotated for positions old_start… moved to new_start… (the model
    ``config``'s RoPE: stripped at the old positions, applied at the new ones, in float32; the keys' dtype kept)."""
    if old_start < 0 or new_start < 0:
        raise ConfigError(f"positions start at 0 or later, got old_start {old_start}, new_start {new_start}")
    tokens = keys.shape[-2]
    if old_start == new_start or tokens == 0:
        return keys
    old = torch.arange(old_start, old_start + tokens, device=keys.device)
    new = torch.arange(new_start, new_start + tokens, device=keys.device)
    # frequencies for the contexts the rows live in (they differ only for length-dependent rope types)
    old_freq, old_scaling = rope_frequencies(config, seq_len=old_start + tokens)
    new_freq, new_scaling = rope_frequencies(config, seq_len=new_start + tokens)
    content = strip_rope(keys.float(), old, old_freq.to(keys.device), old_scaling)
    return apply_rope(content, new, new_freq.to(keys.device), new_scaling).to(keys.dtype)


def repositioned(rows, old_start: int, new_start: int, config):
    """A `DynamicCache` of ``rows`` (a cache of one run: every layer's keys and values) with the keys moved from
    positions old_start… to new_start…; values as they are."""
    layers = as_kv_cache(rows).export().layers
    return cache_of((reposition_keys(layer.keys, old_start, new_start, config), layer.values) for layer in layers)


#: what the target recomputes of a run reused at another offset when nothing else is named (chosen on dev items:
#: docs/RESULTS.md, "Reuse at another offset")
DEFAULT_OFFSET_RECOMPUTE = policy.parse("turn_attention:20%")


def check_offset_policy(recompute: RecomputePolicy, source_read: bool = False) -> RecomputePolicy:
    """``recompute`` when it can pick the positions of a run reused at another offset, else ConfigError. A policy
    ranking by the source's attention needs its read of the new turn on the conversation that holds the run
    (``source_read``: the caller gives it, `moved_read`); one ranking by the source's last queries never has one."""
    if recompute.needs_source_attention or (recompute.ranks_by_source_turn_read and not source_read):
        raise ConfigError(f"recompute policy {recompute.spec!r} ranks by the source's attention, which this reuse "
                          "at another offset does not have: name one that ranks by the target alone (e.g. "
                          "'blend:10%', 'deviation:10%', 'sinks:10%', 'recent:10%'), or give the source's read of "
                          "the new turn on the conversation that holds the run", field="offset_recompute")
    return recompute


def moved_read(scores: torch.Tensor, old_start: int, begin: int) -> torch.Tensor:
    """The attention a read paid the positions of the conversation that holds a run (``scores`` [batch, old_start +
    R]: its old beginning, then the run), moved to the prompt the run is reused in ([batch, begin + R]): the run's
    scores follow the new beginning, over which the old beginning's total is spread evenly — the run's positions
    rank as they did, and the share of the read on them (`policy.history_reliance`) stays what it was."""
    if scores.dim() != 2 or not 0 <= old_start < scores.shape[1] or begin < 0:
        raise ConfigError(f"a read [batch, old_start + run] with old_start in 0..{scores.shape[-1] - 1} and begin "
                          f">= 0, got {tuple(scores.shape)}, old_start {old_start}, begin {begin}")
    run = scores[:, old_start:]
    if not begin:
        return run.clone()
    spread = scores[:, :old_start].sum(dim=1, keepdim=True) / begin
    return torch.cat([spread.expand(-1, begin), run], dim=1)


def held_read(model, held_rows, new_turn, cache_factory: CacheFactory = new_cache) -> torch.Tensor:
    """The attention ``model`` pays each position of a conversation that holds a run (``held_rows``: its rows from
    position 0 through the run's end) while it reads ``new_turn`` (the tokens after the run in the prompt it is
    reused in) [1, held positions]: what `moved_read` places for a policy that ranks by it (`turn_attention`)."""
    new_turn = [int(token) for token in new_turn]
    if not new_turn:
        raise ConfigError("held_read needs the new turn's tokens (at least one)")
    cache = cache_factory(model)
    cache.append(as_kv_cache(held_rows).export())
    return cache.read_turn(model, torch.tensor([new_turn], device=cache.device)).scores


def mapped_run(mapper, source_rows, old_start: int, dtype: torch.dtype | None = None):
    """``source_rows`` (the source's cache of a run at positions old_start…) in the target's format at the same
    positions (`Mapper.transfer`), ready for `reuse_run`."""
    tokens = as_kv_cache(source_rows).export().layers[0].keys.shape[-2]
    positions = torch.arange(old_start, old_start + tokens)
    return mapper.transfer(source_rows, positions.to(mapper.device), dtype=dtype)


def reuse_run(target_model, beginning_ids: torch.Tensor, run_ids: torch.Tensor, run_rows, old_start: int,
              plan: HandoffPlan | None = None, selection_info: SelectionInfo | None = None, *,
              cache_factory: CacheFactory = new_cache, beginning_rows=None) -> MappedCache:
    """The target's cache of ``beginning_ids`` [batch, B] then ``run_ids`` [batch, R], the run's rows taken from
    ``run_rows`` (a cache of the R run tokens, keys rotated for positions old_start…, e.g. exported from a cached
    conversation where the run followed another beginning) and moved to positions B…; pending (recomputed in the
    target's next forward, `MappedCache.read`): the beginning (exact prefix; the plan's store copies it in when it
    holds it) and the run positions the plan's recompute policy picks. ``plan``'s exact_prefix is ignored: the
    beginning is the exact prefix. A policy that ranks by attention reads it from ``selection_info`` (e.g. the
    source's read of the new turn on the conversation that holds the run, `moved_read`). ``beginning_rows``: the
    target's own exact rows of the beginning's first positions (e.g. a prefix cache's), copied in and not
    recomputed. Refused: ids that are not [batch, tokens], rows of another length or batch, a context past the
    target's window, a policy with nothing to rank by (`check_offset_policy`)."""
    plan = plan or DEFAULT_PLAN
    for name, ids in (("beginning_ids", beginning_ids), ("run_ids", run_ids)):
        if ids.dim() != 2:
            raise ConfigError(f"{name} must be [batch, tokens], got {tuple(ids.shape)}")
    if beginning_ids.shape[0] != run_ids.shape[0] or run_ids.shape[1] == 0:
        raise ConfigError(f"a run of at least one token after a beginning of the same batch, got run "
                          f"{tuple(run_ids.shape)} after {tuple(beginning_ids.shape)}")
    check_offset_policy(plan.recompute,
                        source_read=selection_info is not None and selection_info.source_attention is not None)
    rows = repositioned(run_rows, old_start, beginning_ids.shape[1], target_model.config)
    keys = rows.layers[0].keys
    if keys.shape[0] != run_ids.shape[0] or keys.shape[-2] != run_ids.shape[1]:
        raise ConfigError(f"run_rows hold {keys.shape[-2]} positions of a batch of {keys.shape[0]}; run_ids are "
                          f"{tuple(run_ids.shape)}")
    input_ids = torch.cat([beginning_ids, run_ids], dim=1)
    check_context(input_ids.shape[1], target_model)
    cache = cache_factory(target_model)
    if cache.length:
        raise ConfigError(f"the cache factory made a cache of {cache.length} positions; a reused run's starts empty")
    begin = beginning_ids.shape[1]
    if begin:  # placeholders the exact prefix's recompute (or the store's copy) overwrites
        cache.append(cache_of((torch.zeros_like(layer.keys[..., :1, :]).expand(-1, -1, begin, -1).contiguous(),
                               torch.zeros_like(layer.values[..., :1, :]).expand(-1, -1, begin, -1).contiguous())
                              for layer in rows.layers))
    cache.append(rows)
    known = 0
    if beginning_rows is not None:
        known = as_kv_cache(beginning_rows).length
        if known > begin:
            raise ConfigError(f"beginning_rows hold {known} positions; the beginning has {begin}")
        if known:
            cache.write(0, beginning_rows)
    mapped = MappedCache.from_mapped(cache, target_model, input_ids.to(cache.device), None,
                                     HandoffPlan(begin, plan.recompute, plan.prefix_store), selection_info)
    if known and mapped.pending.numel():  # every row's first columns are the exact prefix 0..begin-1, sorted
        mapped.pending = mapped.pending[:, mapped.pending[0] >= known]
    return mapped
