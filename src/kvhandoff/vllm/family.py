"""What one vLLM instance knows of its model family: its own model's name and identity, the other models' identities
and the mappers that bring their K/V into its own cache format.

Configured by the connector's ``kv_connector_extra_config`` (the same family part on every instance)::

    {"store_url": "redis://127.0.0.1:6379/0",
     "model": "small",                                # this instance's model, by its family name
     "mappers": {"small->large": "/mappers/small-to-large", "large->small": "/mappers/large-to-small"},
     "tenant": "default",                             # a request without a tenant (optional)
     "ttl_s": null,                                   # entries' lifetime (optional; capacity is the server's LRU)
     "recompute": null,                               # one recompute policy for every pair, e.g. "recent:10%"
                                                      # (optional; also "min_retention" / "min_speedup")
     "map_dtype": null,                               # the map's dtype: "float32" or "bfloat16" (optional;
                                                      # default: the instance's model dtype)
     "load_step_dtype": null,                         # the load step's model copies' dtype (as map_dtype)
     "exact_prefix": null,                            # the leading positions a switch takes from the target's
                                                      # own K/V (optional; default: each mapper's setting)
     "models": {"small": "/models/small"}}            # transformers folders of the other models (optional): the
                                                      # load step recomputes scattered positions with them

Each incoming pair's recompute policy is resolved as `kvhandoff serve` resolves it (`runtime.switch.pair
.served_recompute`): the named one, else the one recorded with the pair's mapper (chosen again under min_retention /
min_speedup), else the default — under what the instance can do (`FamilyConfig.capabilities`). vLLM computes a
contiguous run of positions after those a connector loads, so without more a switch recomputes the mapped prefix's
latest positions (rule ``recent``, `VLLM_CAPABILITIES`); when ``models`` names the source model, the connector holds
copies of the source and the target and recomputes the positions any rule picks in its load step
(`kvhandoff.vllm.load_step`, `VLLM_LOAD_STEP_CAPABILITIES`: the pair's recorded ``turn_attention`` is served as
recorded). A recorded policy the instance cannot serve gives way to the default, said in the log. The exact prefix
(the attention sinks a switch takes from the target's own K/V) is recomputed in the load step, or else comes from
the model's opening entries: every save of its own K/V also stores its first positions', and a mapped load puts them
in place of the mapped ones.

Identities come from the mapper manifests' fingerprints, so every instance names a model alike: this instance's
model (loaded once with transformers from vLLM's model path) is checked against each manifest that names it
(`PairingCheck`, MapperMismatchError otherwise: a mapper fitted for another model is refused at start), and the
other models are named by the fingerprints their mappers recorded. A model without mappers is named by its own
fingerprint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.geometry import model_fingerprint
from kvhandoff.runtime import policy
from kvhandoff.runtime.policy import RecomputePolicy, budget_count
from kvhandoff.runtime.seam import Capabilities
from kvhandoff.runtime.switch.pair import ServedRecompute, SwitchSettings, served_recompute
from kvhandoff.vllm.layout import as_cache, as_rows
from kvhandoff.vllm.load_step import VLLM_CAPABILITIES, recomputed_in_load_step, vllm_capabilities
from kvhandoff.vllm.store import model_identity

logger = logging.getLogger("kvhandoff.vllm")

#: the dtypes a connector maps in (``map_dtype``)
MAP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class FamilyConfig:
    store_url: str
    model: str
    mappers: dict[tuple[str, str], str] = field(default_factory=dict)
    tenant: str = "default"
    ttl_s: int | None = None
    switch: SwitchSettings = field(default_factory=SwitchSettings)
    map_dtype: torch.dtype | None = None
    models: dict[str, str] = field(default_factory=dict)  # {family model: transformers folder} for the load step
    load_step_dtype: torch.dtype | None = None

    @classmethod
    def from_extra(cls, extra: dict) -> FamilyConfig:
        if not extra.get("store_url") or not extra.get("model"):
            raise ConfigError("the kvhandoff connector needs kv_connector_extra_config with 'store_url' and 'model'")
        mappers = {}
        for pair, folder in (extra.get("mappers") or {}).items():
            source, sep, target = str(pair).partition("->")
            if not sep or not source or not target or source == target:
                raise ConfigError(f"mapper pair {pair!r}: name it 'SOURCE->TARGET'")
            mappers[(source.strip(), target.strip())] = str(folder)
        ttl = extra.get("ttl_s")
        switch = SwitchSettings(exact_prefix=extra.get("exact_prefix"), recompute=extra.get("recompute"),
                                min_retention=extra.get("min_retention"), min_speedup=extra.get("min_speedup"),
                                guard=False)
        map_dtype, load_step_dtype = extra.get("map_dtype"), extra.get("load_step_dtype")
        for key, value in (("map_dtype", map_dtype), ("load_step_dtype", load_step_dtype)):
            if value is not None and value not in MAP_DTYPES:
                raise ConfigError(f"{key} must be one of {', '.join(MAP_DTYPES)} (or null: the instance's dtype), "
                                  f"got {value!r}")
        models = extra.get("models") or {}
        if not isinstance(models, dict) or not all(isinstance(folder, str) and folder for folder in models.values()):
            raise ConfigError("models must map family model names to their transformers folders, e.g. "
                              f"{{\"small\": \"/models/small\"}}, got {models!r}")
        return cls(str(extra["store_url"]), str(extra["model"]), mappers, str(extra.get("tenant") or "default"),
                   int(ttl) if ttl else None, switch, MAP_DTYPES.get(map_dtype), {str(k): v for k, v in models.items()},
                   MAP_DTYPES.get(load_step_dtype))

    @property
    def incoming(self) -> dict[str, str]:
        """{other model: folder of its mapper into this model}."""
        return {source: folder for (source, target), folder in self.mappers.items() if target == self.model}

    def capabilities(self, source: str) -> Capabilities:
        """What a switch from ``source`` into this instance can recompute: every rule when ``models`` names the
        source (the load step holds it and the target), else what vLLM computes itself."""
        return vllm_capabilities(source in self.models)

    @property
    def load_step_models(self) -> dict[str, str]:
        """{model: folder} the worker's load step loads: the incoming sources ``models`` names (the target's own
        copy comes from vLLM's model folder unless named too); empty when no source is named."""
        sources = {name: folder for name, folder in self.models.items() if name in self.incoming}
        if not sources:
            return {}
        return {**sources, **({self.model: self.models[self.model]} if self.model in self.models else {})}


@dataclass(frozen=True)
class FamilyIdentities:
    own: str                              # this model's identity
    others: dict[str, str]                # {other model: identity} (those with a mapper into this one)
    geometry: tuple[int, int, int]        # this model's (layers, kv_heads, head_dim)
    sources: dict[str, tuple[int, int, int]]  # {other model: its (layers, kv_heads, head_dim)}
    recompute: dict[str, ServedRecompute] = field(default_factory=dict)  # {other model: its switch's recompute}
    opening: int = 0  # this model's exact prefix: the positions a mapped load takes from its own K/V when stored

    def recompute_policy(self, source: str) -> RecomputePolicy:
        """The recompute policy of a switch from ``source`` into this model."""
        return self.recompute[source].policy


def _geometry(fingerprint: dict) -> tuple[int, int, int]:
    geometry = fingerprint["geometry"]
    return geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"]


def resolve_identities(config: FamilyConfig, model_path: str, dtype: torch.dtype) -> FamilyIdentities:
    """Every family model's identity, this model checked against each mapper manifest that names it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    own_fp = model_fingerprint(model)
    recorded = None
    others, sources, recompute, opening = {}, {}, {}, 0
    for (source, target), folder in config.mappers.items():
        if config.model not in (source, target):
            continue
        side = "target_model" if target == config.model else "source_model"
        mapper = Mapper.load(folder, lazy=True, **{side: model})  # MapperMismatchError unless fitted for it
        manifest = mapper.manifest
        mine = manifest.target_fingerprint if target == config.model else manifest.source_fingerprint
        recorded = recorded or mine
        if target == config.model:
            others[source] = model_identity(manifest.source_fingerprint)
            sources[source] = _geometry(manifest.source_fingerprint)
            recompute[source] = served_recompute(config.switch, manifest.recompute, f"{source} → {target}",
                                                 config.capabilities(source))
            exact = manifest.exact_prefix if config.switch.exact_prefix is None else config.switch.exact_prefix
            opening = max(opening, exact)
    del model
    own = model_identity(recorded or own_fp)
    return FamilyIdentities(own, others, _geometry(own_fp), sources, recompute, opening)


def mapped_load_end(start: int, stored: int, recompute: RecomputePolicy) -> int:
    """Where a mapped load of positions ``start``..``stored``-1 ends: before the latest positions ``recompute`` (a
    ``recent`` policy, its budget a share of the mapped positions) leaves to vLLM; at ``stored`` when nothing is
    recomputed or the load step recomputes (`recomputed_in_load_step`)."""
    if not recompute.active or recomputed_in_load_step(recompute):
        return stored
    return stored - budget_count(recompute.budget, stored - start)


def tenant_of(request, default: str) -> str:
    """A vLLM request's tenant: ``kv_transfer_params["tenant"]``, else its ``cache_salt``, else ``default``."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return str(params.get("tenant") or getattr(request, "cache_salt", None) or default)


def request_recompute(request, pair: RecomputePolicy,
                      capabilities: Capabilities = VLLM_CAPABILITIES) -> RecomputePolicy:
    """The recompute policy of a vLLM request's switch: ``kv_transfer_params["recompute"]`` (a spec the instance's
    ``capabilities`` serve) if given, else the pair's ``pair``; a spec refused is logged and the pair's serves."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if params.get("recompute") is None:
        return pair
    try:
        asked = policy.parse(str(params["recompute"]))
        if not capabilities.serves(asked):
            raise ConfigError(capabilities.refusal(asked))
    except ConfigError as refusal:
        logger.warning("request %s: kv_transfer_params recompute refused (%s); served under the pair's %s",
                       getattr(request, "request_id", "?"), refusal, pair.spec)
        return pair
    return asked


def mapped_rows(mapper: Mapper, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Another model's stored rows [Ls, 2, T, Hs, Ds] mapped into this model's [Lt, 2, T, Ht, Dt] in ``dtype`` (RoPE
    stripped and applied in float32)."""
    return as_rows(mapper.transfer(as_cache(rows), dtype=dtype))
