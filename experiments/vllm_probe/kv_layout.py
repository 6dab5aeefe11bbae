"""Logical K/V <-> vLLM CPU paged cache (one layer: [num_blocks, kv_heads, block_size, 2*head_dim]).

Layout (vLLM 0.32.0 CPU_ATTN, found with cpu_attn_reshape_and_cache, checked by layout_probe.py):
view the layer as [num_blocks, kv_heads, 2*block_size, head_dim] and chunk dim 2: the first block_size
rows (block_size*head_dim elements) of each (block, head) slab hold K, the last block_size rows hold V.
  isa "vec"/"vec16" (x86 without AMX, Arm, ...): K slab = K^T, [head_dim, block_size]; V slab = V, [block_size, head_dim]
  isa "amx" (bf16 and block_size % 32 == 0, chosen only on CPUs with AMX tiles; the op's amx path runs without AMX too):
      K slab = [block_size/16, head_dim/2, 16 tokens, 2 dims]; V slab = [head_dim/16, block_size/2, 16 dims, 2 tokens]
"""
import torch


def split(kv_layer):
    nb, h, bs, two_hd = kv_layer.shape
    kc, vc = kv_layer.view(nb, h, 2 * bs, two_hd // 2).chunk(2, dim=2)
    return kc, vc  # each [nb, h, bs, hd] views (strided), raw slabs


def read_blocks(kv_layer, block_ids, isa):
    """-> K, V as [len(block_ids)*block_size, kv_heads, head_dim] (token order)."""
    _nb, h, bs, two_hd = kv_layer.shape
    hd = two_hd // 2
    kc, vc = split(kv_layer)
    k = kc[block_ids].reshape(len(block_ids), h, bs * hd)
    v = vc[block_ids].reshape(len(block_ids), h, bs * hd)
    if isa in ("vec", "vec16", "neon"):
        k = k.view(-1, h, hd, bs).permute(0, 3, 1, 2)          # [n, bs, h, hd]
        v = v.view(-1, h, bs, hd).permute(0, 2, 1, 3)
    elif isa == "amx":
        # K slab [bs/16, hd/2, 16, 2]: token = 16a+b, dim = 2c+e;  V slab [hd/16, bs/2, 16, 2]: dim = 16g+f, token = 2i+j
        k = k.view(-1, h, bs // 16, hd // 2, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, bs, h, hd)
        v = v.view(-1, h, hd // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4).reshape(-1, bs, h, hd)
    else:
        raise NotImplementedError(f"CPU attention ISA {isa!r}")
    return k.reshape(-1, h, hd).contiguous(), v.reshape(-1, h, hd).contiguous()


def write_tokens(kv_layer, k, v, slot_mapping, isa):
    """Write K/V [tokens, kv_heads, head_dim] into the given slots with vLLM's own op."""
    from vllm import _custom_ops as ops

    kc, vc = split(kv_layer)
    ops.cpu_attn_reshape_and_cache(k.to(kv_layer.dtype).contiguous(), v.to(kv_layer.dtype).contiguous(), kc, vc,
                                   slot_mapping.to(torch.int64), isa)
