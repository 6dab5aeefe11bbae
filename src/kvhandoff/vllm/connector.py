"""`KVHandoffConnector`: a vLLM v1 KV connector (vLLM 0.32.0, CPU build) that makes a switch between the models of
a family a cache hit in another model's format, each model in its own vLLM instance, the K/V travelling through a
Valkey/Redis store (`kvhandoff.vllm.store`).

- Save: once a request's prefill has computed its prompt's full blocks, its own K/V of those blocks go to the store
  under (tenant, this model's identity, hash of the prefix's token ids). A request that loaded mapped rows — or
  whose prefix vLLM's local prefix cache served from mapped rows — is never saved: mapped rows are not the model's
  own K/V.
- Load: for a new request, the longest full-block prefix held under this model's identity (a cache hit of its own
  K/V, e.g. from another instance of the same model); else under another family model's identity: those rows are
  mapped with the pair's `Mapper` (keys after RoPE → the target's) and loaded, but for the latest positions the
  pair's recompute policy gives back to vLLM (`mapped_load_end`; the policy resolved in `kvhandoff.vllm.family`).
  A policy that picks positions anywhere (``turn_attention``) is recomputed in the load step instead, by the
  connector's copies of the models (`kvhandoff.vllm.load_step`; the family config's ``models``), the prefix loaded
  whole. vLLM computes the rest (at least the prompt's last token).
- Every entry is checked against what its key promises (model, tenant, prefix, length, shape, checksum) before any
  token is promised to vLLM; a refused entry is logged (logger ``kvhandoff.vllm``) and the request is prefilled by
  vLLM itself. The worker checks it again when it loads; a failure there is reported as load errors (run with
  ``kv_load_failure_policy="recompute"`` so that vLLM recomputes those blocks).
- Tenant of a request: ``kv_transfer_params["tenant"]`` if given, else its ``cache_salt`` (which also keeps vLLM's
  own prefix cache apart per tenant), else the configured default. Recompute policy of a request's switch:
  ``kv_transfer_params["recompute"]`` if given and servable here (e.g. "none": the whole prefix mapped), else the
  pair's; a refused one is logged. ``kv_transfer_params["save"]`` false: the request's K/V are not saved.
- Each load's log line says what it loaded, for which tenant, and the seconds its steps took (store, map, write).

Use::

    KVTransferConfig(kv_connector="KVHandoffConnector", kv_connector_module_path="kvhandoff.vllm.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store_url": ..., "model": ..., "mappers": {...}})

(`kvhandoff.vllm.family` documents the extra config.) Limits: loads and saves are synchronous, one KV-cache group,
full attention (Qwen2/Llama-like), CPU paged-cache layouts only (`kvhandoff.vllm.layout`); without ``models`` a
recompute policy recomputes the latest positions only (vLLM cannot recompute positions inside a loaded prefix).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context

from kvhandoff.mapper.mapper import Mapper
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.vllm.family import (
    FamilyConfig,
    mapped_load_end,
    mapped_rows,
    request_recompute,
    resolve_identities,
    tenant_of,
)
from kvhandoff.vllm.layout import block_slots, read_blocks, write_rows
from kvhandoff.vllm.load_step import LoadStep, LoadStepRecompute, recomputed_in_load_step
from kvhandoff.vllm.store import (
    EntryRefused,
    Expected,
    KVStore,
    decode_entry,
    encode_entry,
    entry_key,
    opening_prefix,
    prefix_hashes,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvhandoff.vllm")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
#: how many (tenant, prefix hash) of mapped loads the scheduler remembers, to keep them from being saved as own
_MAPPED_MEMORY = 65536


@contextlib.contextmanager
def _timed(seconds: dict, step: str):
    """Add the seconds the block takes to ``seconds[step]`` (the load's steps, in its log line)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds[step] = seconds.get(step, 0.0) + time.perf_counter() - began


def _setup_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s kvhandoff.vllm[%(process)d]: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _remember(memory: OrderedDict, item) -> None:
    """Remember ``item`` as the most recent, forgetting the oldest past `_MAPPED_MEMORY`."""
    memory[item] = None
    memory.move_to_end(item)
    while len(memory) > _MAPPED_MEMORY:
        memory.popitem(last=False)


def _attention_layers(forward_context: ForwardContext) -> list[tuple[str, Any]]:
    """The forward's attention layers that hold a paged cache, by layer index."""
    layers = [(name, layer) for name, layer in forward_context.no_compile_layers.items()
              if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)]
    return sorted(layers, key=lambda item: _layer_index(item[0]))


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else -1


@dataclass
class LoadSpec:
    req_id: str
    key: str
    tenant: str
    prefix: str
    identity: str
    tokens: int                       # the stored prefix's length (full blocks)
    start: int                        # positions before it are already in vLLM's cache (its local prefix cache)
    end: int                          # positions start..end-1 are loaded (end < tokens: vLLM recomputes the rest)
    geometry: tuple[int, int, int]    # the stored rows' (layers, kv_heads, head_dim)
    source: str | None = None         # another family model whose rows are mapped; None: this model's own
    block_ids: list[int] = field(default_factory=list)  # the request's blocks for positions start..tokens-1
    hashes: list[str] = field(default_factory=list)     # the hashes of the loaded prefix's full blocks
    opening: Expected | None = None   # this model's own opening entry, put over the mapped rows of its positions
    recompute: RecomputePolicy | None = None  # a policy the load step recomputes; None: vLLM's tail, or none
    prompt: tuple[int, ...] = ()      # the request's prompt (for the load step)
    exact_prefix: int = 0             # the positions the load step recomputes first (this model's exact prefix)
    context_block_ids: list[int] = field(default_factory=list)  # the request's blocks of positions 0..start-1


@dataclass
class SaveSpec:
    req_id: str
    key: str
    tenant: str
    prefix: str
    tokens: int
    block_ids: list[int] = field(default_factory=list)
    opening: tuple[str, int] | None = None  # also save the first positions' rows: (opening prefix, positions)


@dataclass
class KVHandoffMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def _stored_opening(store: KVStore, ids, prompt: list[int], tenant: str, start: int) -> Expected | None:
    """What the model's opening entry of ``prompt`` must hold (``ids``: its `FamilyIdentities`), when the store has
    one and a load from ``start`` covers its positions; None otherwise."""
    size = ids.opening
    if not size or start >= size or len(prompt) <= size:
        return None
    prefix = opening_prefix(prompt[:size])
    found = store.exists([entry_key(tenant, ids.own, prefix)])[0]
    return Expected(ids.own, tenant, prefix, size, ids.geometry) if found else None


def _put_opening(store: KVStore, load: LoadSpec, rows: torch.Tensor) -> None:
    """Put the model's own rows of the load's opening over the mapped ``rows`` (a refused entry: the mapped stay)."""
    if load.opening is None:
        return
    expected = load.opening
    try:
        own = decode_entry(store.get(entry_key(expected.tenant, expected.identity, expected.prefix)), expected)
    except Exception as error:
        logger.warning("opening %s for request %s not used (%s: %s); its positions stay mapped", expected.prefix,
                       load.req_id, type(error).__name__, error)
        load.opening = None
        return
    rows[:, :, : expected.tokens] = own.to(rows.dtype)


class KVHandoffConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _setup_logging()
        self._block_size = vllm_config.cache_config.block_size
        self._family = FamilyConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self._store = KVStore(self._family.store_url, self._family.ttl_s)
        if role == KVConnectorRole.SCHEDULER:
            model_config = vllm_config.model_config
            self._ids = resolve_identities(self._family, model_config.model, model_config.dtype)
            self._loads: dict[str, LoadSpec] = {}
            self._tracking: dict[str, SaveSpec] = {}
            self._tenants: dict[str, str] = {}
            self._unsaved: set[str] = set()  # requests whose kv_transfer_params say "save": false
            self._mapped: OrderedDict[tuple[str, str], None] = OrderedDict()
            self._saved: OrderedDict[str, None] = OrderedDict()
            logger.info("scheduler: model %r (identity %s), store %s, mapped in from %s", self._family.model,
                        self._ids.own, self._family.store_url,
                        {name: ident for name, ident in self._ids.others.items()} or "no other model")
            for source, served in self._ids.recompute.items():
                logger.info("%s", served.describe(source, self._family.model))
        else:
            # the map runs in the instance's dtype unless the config names one: a bf16 GEMM runs on AMX
            self._map_dtype = self._family.map_dtype or vllm_config.model_config.dtype
            self._mappers = {source: Mapper.load(folder).to(dtype=self._map_dtype)
                             for source, folder in self._family.incoming.items()}
            self._layer_names: list[str] = []
            self._save_rows: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            self._invalid: set[int] = set()
            models = self._family.load_step_models
            self._load_step = None
            if models:  # the target's own copy from vLLM's model folder unless the config names one
                models.setdefault(self._family.model, str(vllm_config.model_config.model))
                dtype = self._family.load_step_dtype or vllm_config.model_config.dtype
                self._load_step = LoadStepRecompute.load(models, dtype)
                logger.info("worker: the load step recomputes scattered positions with %s (%s copies)",
                            ", ".join(f"{name} from {folder}" for name, folder in models.items()),
                            str(dtype).removeprefix("torch."))
            logger.info("worker: model %r, store %s, mappers from %s (mapping in %s)", self._family.model,
                        self._family.store_url, sorted(self._mappers) or "no other model",
                        str(self._map_dtype).removeprefix("torch."))

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        bs = self._block_size
        tenant = tenant_of(request, self._family.tenant)
        self._tenants[request.request_id] = tenant
        if (getattr(request, "kv_transfer_params", None) or {}).get("save") is False:
            self._unsaved.add(request.request_id)
        self._loads.pop(request.request_id, None)
        longest = (len(prompt) - 1) // bs  # vLLM computes at least the last prompt token itself
        first = num_computed_tokens // bs + 1
        if longest < first:
            return 0, False
        hashes = prefix_hashes(prompt, bs, longest)
        candidates = [(None, self._ids.own, self._ids.geometry)]
        candidates += [(name, ident, self._ids.sources[name]) for name, ident in self._ids.others.items()]
        try:
            for source, identity, geometry in candidates:
                blocks = list(range(longest, first - 1, -1))
                keys = [entry_key(tenant, identity, hashes[b - 1]) for b in blocks]
                for b, key, found in zip(blocks, keys, self._store.exists(keys), strict=True):
                    if not found:
                        continue
                    expected = Expected(identity, tenant, hashes[b - 1], b * bs, geometry)
                    try:
                        decode_entry(self._store.get(key), expected)
                    except EntryRefused as refusal:
                        logger.warning("refused store entry %s for request %s (%s): %s; vLLM prefills these "
                                       "tokens itself", key, request.request_id,
                                       "own" if source is None else f"from {source}", refusal)
                        continue
                    served = None if source is None else request_recompute(
                        request, self._ids.recompute_policy(source), self._family.capabilities(source))
                    end = b * bs if served is None else mapped_load_end(num_computed_tokens, b * bs, served)
                    if end <= num_computed_tokens:
                        break  # the policy recomputes all of it: a shorter prefix would load less still
                    in_step = served is not None and recomputed_in_load_step(served)
                    self._loads[request.request_id] = LoadSpec(
                        request.request_id, key, tenant, hashes[b - 1], identity, b * bs, num_computed_tokens, end,
                        geometry, source, hashes=hashes[:b],
                        opening=None if source is None or in_step else _stored_opening(
                            self._store, self._ids, prompt, tenant, num_computed_tokens),
                        recompute=served if in_step else None, prompt=tuple(prompt) if in_step else (),
                        exact_prefix=self._ids.opening)
                    return end - num_computed_tokens, False
        except Exception as error:  # the store down or failing: a miss, vLLM prefills
            logger.warning("store %s unavailable for request %s (%s: %s); vLLM prefills", self._family.store_url,
                           request.request_id, type(error).__name__, error)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens == 0:
            self._loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVHandoffMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            blocks = list(new.block_ids[0]) if new.block_ids else []
            tenant = self._tenants.get(new.req_id, self._family.tenant)
            hashes = prefix_hashes(prompt, bs)
            load = self._loads.pop(new.req_id, None)
            if load is not None:
                self._emit_load(meta, load, blocks)
                if load.source is not None:  # mapped rows: never saved as this model's own
                    continue
            if new.req_id in self._unsaved:
                continue
            if not hashes or any((tenant, digest) in self._mapped for digest in hashes):
                continue  # nothing full to save, or vLLM's prefix cache serves mapped rows to this request
            key = entry_key(tenant, self._ids.own, hashes[-1])
            if key in self._saved or (load is not None and load.tokens >= len(hashes) * bs):
                continue
            try:
                if self._store.exists([key])[0]:
                    _remember(self._saved, key)
                    continue
            except Exception as error:
                logger.warning("store unavailable, request %s not saved (%s)", new.req_id, error)
                continue
            size = self._ids.opening
            opening = (opening_prefix(prompt[:size]), size) if size and len(prompt) > size else None
            self._tracking[new.req_id] = SaveSpec(new.req_id, key, tenant, hashes[-1], len(hashes) * bs, blocks,
                                                  opening)
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            load = self._loads.pop(req_id, None)
            if load is not None and req_id in cached.resumed_req_ids:  # a preempted request, loaded again
                self._emit_load(meta, load, list(new_blocks[0]) if new_blocks else [])
            spec = self._tracking.get(req_id)
            if spec is None:
                continue
            if req_id in cached.resumed_req_ids:
                spec.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                spec.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[index], scheduler_output)
        return meta

    def _emit_load(self, meta: KVHandoffMetadata, load: LoadSpec, blocks: list[int]) -> None:
        """Send ``load`` to the worker with the request's blocks for its positions; remember mapped prefixes."""
        bs = self._block_size
        load.block_ids = blocks[load.start // bs: -(-load.end // bs)]
        load.context_block_ids = blocks[: load.start // bs] if load.recompute is not None else []
        meta.loads.append(load)
        if load.source is not None:
            for digest in load.hashes:
                _remember(self._mapped, (load.tenant, digest))

    def _maybe_save(self, meta: KVHandoffMetadata, req_id: str, computed: int, scheduler_output) -> None:
        """Save the tracked request's full blocks in the step that completes them (chunked prefill included)."""
        spec = self._tracking[req_id]
        if computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) < spec.tokens:
            return
        del self._tracking[req_id]
        spec.block_ids = spec.block_ids[: spec.tokens // self._block_size]
        meta.saves.append(spec)
        _remember(self._saved, spec.key)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._loads, self._tracking, self._tenants):
            table.pop(request.request_id, None)
        self._unsaved.discard(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._layer_names = sorted(kv_caches, key=_layer_index)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVHandoffMetadata) or not meta.loads:
            return
        layers = _attention_layers(forward_context)
        for load in meta.loads:
            seconds = {}
            try:
                with _timed(seconds, "store"):
                    rows = decode_entry(self._store.get(load.key),
                                        Expected(load.identity, load.tenant, load.prefix, load.tokens, load.geometry))
                stored = rows
                with _timed(seconds, "map"):
                    if load.source is not None:
                        rows = mapped_rows(self._mappers[load.source], rows, self._map_dtype)
                        _put_opening(self._store, load, rows)
                recomputed = 0
                if load.recompute is not None:
                    with _timed(seconds, "recompute"):
                        rows, recomputed = self._recompute(load, layers, rows, stored)
                rows = rows[:, :, load.start: load.end]
                if rows.shape[0] != len(layers):
                    raise EntryRefused(f"rows of {rows.shape[0]} layers for a model of {len(layers)}")
                with _timed(seconds, "write"):
                    slots = block_slots(load.block_ids, self._block_size)[: load.end - load.start]
                    for index, (_, layer) in enumerate(layers):
                        write_rows(layer.kv_cache, rows[index, 0], rows[index, 1], slots, layer.isa)
            except Exception as error:
                logger.warning("could not load %s for request %s (%s: %s): its blocks are reported as load errors",
                               load.key, load.req_id, type(error).__name__, error)
                self._invalid.update(load.block_ids)
                continue
            what = "own K/V" if load.source is None else f"K/V of {load.source!r} mapped to {self._family.model!r}"
            if load.opening is not None:
                what += f", its first {load.opening.tokens} positions the model's own"
            if load.end < load.tokens:
                what += f", its latest {load.tokens - load.end} positions recomputed by vLLM"
            if load.recompute is not None:
                what += f", {recomputed} positions recomputed in the load step ({load.recompute.spec})"
            logger.info("loaded %d tokens (positions %d..%d) for request %s: %s, tenant %r (%s)",
                        load.end - load.start, load.start, load.end - 1, load.req_id, what, load.tenant,
                        ", ".join(f"{step} {took:.3f} s" for step, took in seconds.items()))

    def _recompute(self, load: LoadSpec, layers, mapped: torch.Tensor,
                   stored: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The load step: the positions ``load``'s policy picks among the mapped ones (and the exact prefix)
        recomputed by the connector's model copies, on vLLM's own rows of the positions before ``load.start``."""
        if self._load_step is None:
            raise EntryRefused(f"recompute {load.recompute.spec} needs the load step's models (the family config's "
                               "'models')")
        own = None
        if load.start:
            parts = [read_blocks(layer.kv_cache, load.context_block_ids, layer.isa) for _, layer in layers]
            own = torch.stack([torch.stack([k[: load.start], v[: load.start]]) for k, v in parts])
        step = LoadStep(load.prompt, load.tokens, load.start, load.exact_prefix, load.recompute)
        return self._load_step.recompute(step, self._family.model, load.source, mapped, stored, own)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVHandoffMetadata) or not meta.saves:
            return
        layer = get_forward_context().no_compile_layers[layer_name]
        for spec in meta.saves:
            k, v = read_blocks(kv_layer, spec.block_ids, layer.isa)
            self._save_rows.setdefault(spec.req_id, {})[layer_name] = (k[: spec.tokens], v[: spec.tokens])

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVHandoffMetadata):
            return
        for spec in meta.saves:
            parts = self._save_rows.pop(spec.req_id, {})
            names = sorted(parts, key=_layer_index)
            if not names or (self._layer_names and names != self._layer_names):
                logger.warning("request %s: K/V of %d of %d layers seen, not saved", spec.req_id, len(names),
                               len(self._layer_names))
                continue
            began = time.perf_counter()
            rows = torch.stack([torch.stack(parts[name]) for name in names])
            _, identity, _ = spec.key.rsplit(":", 2)
            try:
                self._store.put(spec.key, encode_entry(rows, identity=identity, model_name=self._family.model,
                                                       tenant=spec.tenant, prefix=spec.prefix))
                if spec.opening is not None:
                    prefix, size = spec.opening
                    self._store.put(entry_key(spec.tenant, identity, prefix),
                                    encode_entry(rows[:, :, :size].contiguous(), identity=identity,
                                                 model_name=self._family.model, tenant=spec.tenant, prefix=prefix))
            except Exception as error:
                logger.warning("store unavailable, request %s not saved (%s: %s)", spec.req_id,
                               type(error).__name__, error)
                continue
            logger.info("saved %d tokens of own K/V for request %s under %s (%.3f s)", spec.tokens, spec.req_id,
                        spec.key, time.perf_counter() - began)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
