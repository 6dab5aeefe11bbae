"""What one vLLM instance knows of its model family: its own model's name and identity, the other models' identities
and the mappers that bring their K/V into its own cache format.

Configured by the connector's ``kv_connector_extra_config`` (the same family part on every instance)::

    {"store_url": "redis://127.0.0.1:6379/0",
     "model": "small",                                # this instance's model, by its family name
     "mappers": {"small->large": "/mappers/small-to-large", "large->small": "/mappers/large-to-small"},
     "tenant": "default",                             # a request without a tenant (optional)
     "ttl_s": null}                                   # entries' lifetime (optional; capacity is the server's LRU)

Identities come from the mapper manifests' fingerprints, so every instance names a model alike: this instance's
model (loaded once with transformers from vLLM's model path) is checked against each manifest that names it
(`PairingCheck`, MapperMismatchError otherwise: a mapper fitted for another model is refused at start), and the
other models are named by the fingerprints their mappers recorded. A model without mappers is named by its own
fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.geometry import model_fingerprint
from kvhandoff.vllm.store import model_identity


@dataclass(frozen=True)
class FamilyConfig:
    store_url: str
    model: str
    mappers: dict[tuple[str, str], str] = field(default_factory=dict)
    tenant: str = "default"
    ttl_s: int | None = None

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
        return cls(str(extra["store_url"]), str(extra["model"]), mappers, str(extra.get("tenant") or "default"),
                   int(ttl) if ttl else None)

    @property
    def incoming(self) -> dict[str, str]:
        """{other model: folder of its mapper into this model}."""
        return {source: folder for (source, target), folder in self.mappers.items() if target == self.model}


@dataclass(frozen=True)
class FamilyIdentities:
    own: str                              # this model's identity
    others: dict[str, str]                # {other model: identity} (those with a mapper into this one)
    geometry: tuple[int, int, int]        # this model's (layers, kv_heads, head_dim)
    sources: dict[str, tuple[int, int, int]]  # {other model: its (layers, kv_heads, head_dim)}


def _geometry(fingerprint: dict) -> tuple[int, int, int]:
    geometry = fingerprint["geometry"]
    return geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"]


def resolve_identities(config: FamilyConfig, model_path: str, dtype: torch.dtype) -> FamilyIdentities:
    """Every family model's identity, this model checked against each mapper manifest that names it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    own_fp = model_fingerprint(model)
    recorded = None
    others, sources = {}, {}
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
    del model
    own = model_identity(recorded or own_fp)
    return FamilyIdentities(own, others, _geometry(own_fp), sources)
