"""A switch's scattered recompute inside vLLM: the positions a recompute policy picks among a mapped prefix are
recomputed through the target's layers in the connector's load step, before the rows go into vLLM's paged cache.

vLLM computes only a contiguous run of positions after those a connector loads, so a policy that picks positions
anywhere in the history (``turn_attention``: those the source attends to while it reads the new turn) cannot be left
to vLLM. `LoadStepRecompute` holds `transformers` copies of the family's models (in the instance's dtype unless the
config names one: bf16 matmuls run on AMX; loaded once, from the folders the connector's ``models`` names and vLLM's
own model folder) and does, for one load:
the source reads the new turn on its own stored rows when the rule ranks by that read, the rule picks its positions
on the mapped rows (`RecomputePolicy.positions`), and the target recomputes them and the exact prefix
(`KVCache.recompute`, the runtime's sparse forward) with vLLM's own rows of the positions its prefix cache already
held. It costs a copy of the models' weights in the worker's memory and a forward of the picked positions there.

Rows are the store's layout, [layers, 2, tokens, kv_heads, head_dim] (keys after RoPE). Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import RecomputePolicy, SelectionInfo
from kvhandoff.runtime.seam import Capabilities, Pending, TransformersCache
from kvhandoff.vllm.layout import as_cache, as_rows

#: the rules vLLM recomputes itself: the latest positions of a loaded prefix (it computes every position after the
#: last one a connector loads, and none before it)
VLLM_RULES = ("recent",)
#: the rules the load step recomputes (`LoadStepRecompute`): every rule that ranks positions with the models' layers
LOAD_STEP_RULES = ("sinks", "deviation", "blend", "source_attention", "turn_attention", "target_turn_attention",
                   "mix")
#: a vLLM instance whose connector has no model copies: only what vLLM computes itself
VLLM_CAPABILITIES = Capabilities(engine="vLLM", recompute_rules=VLLM_RULES)
#: a vLLM instance whose connector holds the pair's models (``models``): the load step recomputes the rest
VLLM_LOAD_STEP_CAPABILITIES = Capabilities(engine="vLLM (connector with model copies)",
                                           recompute_rules=VLLM_RULES + LOAD_STEP_RULES)


def vllm_capabilities(with_models: bool) -> Capabilities:
    """What a vLLM instance's switches can recompute: every load-step rule when its connector holds the models
    (``with_models``), else what vLLM computes itself."""
    return VLLM_LOAD_STEP_CAPABILITIES if with_models else VLLM_CAPABILITIES


def recomputed_in_load_step(recompute: RecomputePolicy) -> bool:
    """Whether a switch under ``recompute`` has its positions recomputed in the connector's load step (else vLLM
    computes the latest ones itself, or nothing is recomputed)."""
    return recompute.active and recompute.rule in LOAD_STEP_RULES


@dataclass(frozen=True)
class LoadStep:
    """One mapped load's recompute: the prompt's token ids, the positions ``start``..``tokens`` − 1 mapped (those
    before ``start`` are the target's own, from vLLM's cache), the target's ``exact_prefix`` and the policy."""

    prompt: tuple[int, ...]
    tokens: int
    start: int
    exact_prefix: int
    recompute: RecomputePolicy

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.tokens < len(self.prompt):
            raise ConfigError(f"a load step maps positions {self.start}..{self.tokens - 1} of a prompt of "
                              f"{len(self.prompt)} tokens")

    @property
    def new_turn(self) -> tuple[int, ...]:
        """What the target reads after the loaded prefix (vLLM computes it): the turn a ``turn_attention`` rule
        ranks by."""
        return self.prompt[self.tokens:]


class LoadStepRecompute:
    """The family's models as `transformers` copies, by name (the target's among them), and the recompute of one
    mapped load (`recompute`)."""

    def __init__(self, models: dict) -> None:
        self.models = dict(models)

    @classmethod
    def load(cls, folders: dict[str, str], dtype: torch.dtype = torch.float32) -> LoadStepRecompute:
        """The models of ``folders`` ({name: transformers folder}) loaded in ``dtype``."""
        from kvhandoff.model.loading import load_model

        models = {}
        for name, folder in folders.items():
            try:
                models[name], _ = load_model(str(folder), dtype)
            except Exception as error:
                raise ConfigError(f"the connector's models[{name!r}] = {folder!r} could not be loaded ({error}); "
                                  "give a transformers folder of that model") from error
        return cls(models)

    def recompute(self, step: LoadStep, target: str, source: str, mapped: torch.Tensor, source_rows: torch.Tensor,
                  own: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The mapped rows ``mapped`` [Lt, 2, tokens, Ht, Dt] of ``source``'s stored ``source_rows`` into ``target``
        with the exact prefix and the positions ``step.recompute`` picks among the mapped ones recomputed by the
        target; ``own``: the target's rows of positions 0..start − 1 (vLLM's cache), put in first. Returns (the
        rows in the target copy's dtype, the positions recomputed)."""
        for name in (target, source):
            if name not in self.models:
                raise ConfigError(f"the load step has no model {name!r} (the connector's 'models' names "
                                  f"{', '.join(sorted(self.models)) or 'none'})")
        target_model, source_model = self.models[target], self.models[source]
        cache = TransformersCache(as_cache(mapped[:, :, : step.tokens], target_model.dtype))
        if own is not None and step.start:
            cache.write(0, as_cache(own[:, :, : step.start], target_model.dtype))
        ids = torch.tensor([step.prompt[: step.tokens]], dtype=torch.long)
        first = max(step.start, min(step.exact_prefix, step.tokens))
        prefix = torch.arange(step.start, first).unsqueeze(0)
        picked = prefix[:, :0]
        if step.recompute.active and first < step.tokens:
            source_cache = TransformersCache(as_cache(source_rows[:, :, : step.tokens], source_model.dtype))
            info = SelectionInfo(start=first, new_turn=step.new_turn)
            picked = step.recompute.positions(target_model, cache.export(), ids, info, source_model, source_cache)
        positions = torch.cat([prefix, picked.to(prefix.dtype)], dim=1)
        if positions.numel():
            cache.recompute(target_model, Pending(ids, positions))
        return as_rows(cache.export()), int(positions.numel())
