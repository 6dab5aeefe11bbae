"""Tiny randomly initialised models of the real architectures, and an exactly related pair builder."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128

# tiny models: one thread avoids oversubscription on shared 2-core machines (≈40× faster here)
torch.set_num_threads(1)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


#: Llama 3.1-style RoPE scaling, shrunk to the tiny models' context length.
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def tiny_model(
    family: str = "qwen2",
    layers: int = 2,
    head_dim: int = 16,
    kv_heads: int = 2,
    heads: int = 4,
    seed: int = 0,
    **overrides,
):
    config_cls, model_cls, extra = FAMILIES[family]
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config = config_cls(**{**settings, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # random init gives near-uniform attention; larger q/k weights make attention (and RoPE) matter
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


@torch.no_grad()
def exactly_related(model, seed: int = 1):
    """A copy of `model` whose content-space K/V are an exact linear function of the original's.

    Per layer: a permutation of KV heads (query groups and o_proj follow), per-frequency-pair scaled
    rotations of every key head compensated in the queries (pure per-dim scales through k_norm/q_norm for
    Qwen3, whose RMSNorm would not commute with a rotation), and an invertible mixing of each value head
    compensated in o_proj. Its outputs equal the original's; its cache does not.
    """
    related = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    cfg = related.config
    head_dim, kv_heads = cfg.head_dim, cfg.num_key_value_heads
    group = cfg.num_attention_heads // kv_heads
    half = head_dim // 2
    for layer in related.model.layers:
        attn = layer.self_attn
        perm = torch.randperm(kv_heads, generator=gen)
        q_perm = torch.cat([torch.arange(g * group, (g + 1) * group) for g in perm.tolist()])

        def rows(linear, order, width):
            w = linear.weight.view(-1, width, linear.weight.shape[1])[order].reshape_as(linear.weight)
            linear.weight.copy_(w)
            if linear.bias is not None:
                linear.bias.copy_(linear.bias.view(-1, width)[order].reshape(-1))

        rows(attn.k_proj, perm, head_dim)
        rows(attn.v_proj, perm, head_dim)
        rows(attn.q_proj, q_perm, head_dim)
        o = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], -1, head_dim)[:, q_perm]
        attn.o_proj.weight.copy_(o.reshape_as(attn.o_proj.weight))

        scale = torch.rand(half, generator=gen) + 0.5
        if hasattr(attn, "k_norm"):  # Qwen3: per-dim scale of both dims of a pair through the norms
            attn.k_norm.weight.mul_(torch.cat([scale, scale]))
            attn.q_norm.weight.div_(torch.cat([scale, scale]))
        else:
            angle = torch.rand(half, generator=gen) * 6.28
            cos, sin = angle.cos(), angle.sin()

            def rotate(linear, heads, factor, cos=cos, sin=sin):
                w = linear.weight.view(heads, head_dim, -1)
                a, b = w[:, :half].clone(), w[:, half:].clone()
                f = factor[None, :, None]
                w[:, :half] = f * (cos[None, :, None] * a - sin[None, :, None] * b)
                w[:, half:] = f * (sin[None, :, None] * a + cos[None, :, None] * b)
                if linear.bias is not None:
                    bb = linear.bias.view(heads, head_dim)
                    a, b = bb[:, :half].clone(), bb[:, half:].clone()
                    bb[:, :half] = factor * (cos * a - sin * b)
                    bb[:, half:] = factor * (sin * a + cos * b)

            rotate(attn.k_proj, kv_heads, scale)
            rotate(attn.q_proj, cfg.num_attention_heads, 1 / scale)

        mix = torch.randn(kv_heads, head_dim, head_dim, generator=gen) / head_dim**0.5 + torch.eye(head_dim)
        v = attn.v_proj.weight.view(kv_heads, head_dim, -1)
        v.copy_(mix @ v)
        if attn.v_proj.bias is not None:
            vb = attn.v_proj.bias.view(kv_heads, head_dim)
            vb.copy_((mix @ vb[..., None])[..., 0])
        inv = torch.linalg.inv(mix)
        o = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], kv_heads, group, head_dim)
        o.copy_(torch.einsum("okgd,kde->okge", o, inv))
    return related


def tiny_tokenizer():
    """A byte-level Qwen2 tokenizer with a 259-token vocabulary, built offline (use models with vocab ≥ 300)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["he"] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab, merges=[("h", "e")], eos_token="<|endoftext|>", unk_token=None, pad_token="<|endoftext|>"
    )


def chat_tokenizer():
    """`tiny_tokenizer` as a chat model's GGUF conversion has it: EOS is the turn end <|im_end|>, and the document
    end <|endoftext|> is another special token."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    chat = Qwen2Tokenizer(vocab=dict(tiny_tokenizer().get_vocab()), merges=[("h", "e")], eos_token="<|im_end|>",
                          unk_token=None, pad_token="<|endoftext|>")
    chat.add_special_tokens({"additional_special_tokens": [AddedToken("<|endoftext|>", special=True)]})
    return chat


def save_tiny_pair(folder, source_layers: int = 2, target_layers: int = 3):
    """Two tiny Qwen2 models with one shared tokenizer saved as local model folders; returns their paths."""
    paths = []
    for name, layers, head_dim, seed in (("small", source_layers, 16, 0), ("large", target_layers, 32, 1)):
        path = folder / name
        tiny_model("qwen2", layers=layers, head_dim=head_dim, seed=seed, vocab_size=300).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        paths.append(str(path))
    return paths


def random_batches(count: int = 6, batch: int = 2, tokens: int = 48, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, tokens), generator=gen) for _ in range(count)]


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
