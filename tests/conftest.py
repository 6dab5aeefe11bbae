"""Tiny randomly initialised models of the real architectures, an exactly related pair builder, and a tiny pair on
disk as the workflow names it."""

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

from kvhandoff.config import CalibrationSpec

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
    qk_scale: float = 4.0,
    attn_implementation: str | None = "eager",
    **overrides,
):
    """A tiny random model of `family` (hidden 64). overrides go to the config (vocab_size, max_position_embeddings,
    tie_word_embeddings, rope_parameters, ...); qk_scale multiplies the q/k weights (random init gives near-uniform
    attention; larger q/k weights make attention, and RoPE, matter); attn_implementation None: transformers' default.
    """
    config_cls, model_cls, extra = FAMILIES[family]
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config = config_cls(**{**settings, **extra, **overrides})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if qk_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(qk_scale)
                layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model


#: tiny_model settings of the byte-level evaluation tests: ByteTokenizer's vocabulary, long contexts, plain init
BYTE_MODEL = {"vocab_size": 260, "max_position_embeddings": 8192, "qk_scale": 1.0, "attn_implementation": None}


class ByteTokenizer:
    """UTF-8 bytes as token ids (byte + offset), no download, exactly invertible; called like a Hugging Face
    tokenizer (one text or a list of texts) or through `encode`. bos (if any) is prepended when special tokens
    are asked for. Default: ids 0–255, EOS 256, no BOS (models of vocab ≥ 260, see BYTE_MODEL)."""

    name_or_path = "byte-tokenizer"

    def __init__(self, offset: int = 0, eos: int | None = 256, bos: int | None = None) -> None:
        self.offset, self.eos_token_id, self.bos_token_id = offset, eos, bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        special = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return special + [b + self.offset for b in text.encode("utf-8")]

    def __call__(self, text, add_special_tokens: bool = True) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        data = bytes(int(i) - self.offset for i in ids if 0 <= int(i) - self.offset < 256)
        return data.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        vocab = {f"<0x{i:02X}>": i + self.offset for i in range(256)}
        for name, token in (("<eos>", self.eos_token_id), ("<bos>", self.bos_token_id)):
            if token is not None:
                vocab[name] = token
        return vocab


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
    end <|endoftext|> and the turn start <|im_start|> (where a run reused at another offset may start) are other
    special tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    chat = Qwen2Tokenizer(vocab=dict(tiny_tokenizer().get_vocab()), merges=[("h", "e")], eos_token="<|im_end|>",
                          unk_token=None, pad_token="<|endoftext|>")
    chat.add_special_tokens({"additional_special_tokens": [AddedToken("<|endoftext|>", special=True),
                                                            AddedToken("<|im_start|>", special=True)]})
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


# -- exactly related pairs of different geometry and RoPE ---------------------------------------------------------
#
# Each builder returns a model whose outputs equal its input's and whose content-space K/V (keys before RoPE, after
# k_norm; values) are an exact linear function of its input's, layer by layer; `exact_pair` combines one with
# `exactly_related`, so the map between the pair is exact but not the identity.


def _blank_like(model, **changes):
    """A freshly initialised model of `model`'s class and config, with `changes` to the config."""
    data = model.config.to_dict()
    data.pop("layer_types", None)  # derived from num_hidden_layers
    config = type(model.config).from_dict({**data, **changes})
    config._attn_implementation = "eager"
    return type(model)(config).eval()


def _copy_outer(dst, src):
    """Embeddings, final norm and LM head."""
    for name in ("embed_tokens", "norm"):
        getattr(dst.model, name).load_state_dict(getattr(src.model, name).state_dict())
    dst.lm_head.load_state_dict(src.lm_head.state_dict())


@torch.no_grad()
def with_identity_layers(model, before=(1,)):
    """`model` with an extra identity layer inserted before each layer in `before`: its o_proj and MLP down_proj are
    zero (the residual stream passes unchanged), and its norm/q/k/v weights copy the layer whose input it sees, so its
    K/V equal that layer's exactly."""
    layers = model.model.layers
    plan = [(i, identity) for i in range(len(layers)) for identity in ((True, False) if i in before else (False,))]
    grown = _blank_like(model, num_hidden_layers=len(plan))
    _copy_outer(grown, model)
    for dst, (i, identity) in zip(grown.model.layers, plan, strict=True):
        dst.load_state_dict(layers[i].state_dict())
        if identity:
            for linear in (dst.self_attn.o_proj, dst.mlp.down_proj):
                linear.weight.zero_()
                if linear.bias is not None:
                    linear.bias.zero_()
    return grown


@torch.no_grad()
def with_duplicated_kv_heads(model):
    """`model` with twice the KV heads: KV head g becomes heads 2g and 2g+1 (copies), so query head h, in group
    h // (group/2), still reads a copy of its KV head h // group; q and o_proj are unchanged. Needs group ≥ 2."""
    cfg = model.config
    assert cfg.num_attention_heads // cfg.num_key_value_heads >= 2
    state = model.state_dict()
    for name, tensor in list(state.items()):
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            state[name] = tensor.unflatten(0, (cfg.num_key_value_heads, -1)).repeat_interleave(2, 0).flatten(0, 1)
    doubled = _blank_like(model, num_key_value_heads=2 * cfg.num_key_value_heads)
    doubled.load_state_dict(state)
    return doubled


@torch.no_grad()
def with_doubled_head_dim(model):
    """`model` with head_dim D = 2d: key/query pair i (dims i, i + d/2) moves to pair 2i (dims 2i, 2i + d), whose
    frequency θ^(-4i/2d) equals θ^(-2i/d); the other q/k dims are zero. Values fill dims 0..d−1 (the rest zero) and
    o_proj gains zero columns. q is scaled by √2 against the softmax scale 1/√D (Qwen3: q_norm weight ÷ √2 and both
    norms' ε halved, so the RMS over D dims with zeros is exactly the RMS over d ÷ √2)."""
    cfg = model.config
    d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    place = torch.cat([2 * torch.arange(d // 2), 2 * torch.arange(d // 2) + d])
    has_norm = hasattr(model.model.layers[0].self_attn, "k_norm")
    q_factor = 1.0 if has_norm else 2**0.5

    def spread(tensor, count, index, factor=1.0):  # [count·d, ...] → [count·2d, ...], source dim j → index[j]
        out = tensor.new_zeros(count, 2 * d, *tensor.shape[1:])
        out[:, index] = factor * tensor.unflatten(0, (count, d))
        return out.flatten(0, 1)

    state = model.state_dict()
    for name, tensor in list(state.items()):
        if ".self_attn.q_proj." in name:
            state[name] = spread(tensor, heads, place, q_factor)
        elif ".self_attn.k_proj." in name:
            state[name] = spread(tensor, kv_heads, place)
        elif ".self_attn.v_proj." in name:
            state[name] = spread(tensor, kv_heads, torch.arange(d))
        elif ".self_attn.o_proj.weight" in name:
            state[name] = spread(tensor.T, heads, torch.arange(d)).T
        elif ".self_attn.q_norm." in name:
            state[name] = spread(tensor, 1, place, 2**-0.5)
        elif ".self_attn.k_norm." in name:
            state[name] = spread(tensor, 1, place)
    wide = _blank_like(model, head_dim=2 * d)
    wide.load_state_dict(state)
    if has_norm:
        for layer in wide.model.layers:
            layer.self_attn.q_norm.variance_epsilon /= 2
            layer.self_attn.k_norm.variance_epsilon /= 2
    return wide


@torch.no_grad()
def attention_only_in_last_layer(model):
    """A copy of `model` whose o_proj is zero in every layer but the last: every layer's input (so its content K/V)
    then does not depend on attention, hence not on RoPE; only the last layer's attention reaches the logits."""
    quiet = copy.deepcopy(model)
    for layer in quiet.model.layers[:-1]:
        layer.self_attn.o_proj.weight.zero_()
    return quiet


@torch.no_grad()
def with_rope(model, rope_parameters: dict):
    """`model`'s weights under other RoPE parameters."""
    other = _blank_like(model, rope_parameters=dict(rope_parameters))
    other.load_state_dict(model.state_dict())
    return other


#: RoPE parameters of the exact RoPE pairs (the tiny models' context is 512, "original" 128)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": LLAMA31_ROPE,
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    # no supported family applies partial rotary: with the default type Llama/Qwen2/Qwen3/Mistral ignore the factor
    # and rotate every dim (other types would fail in their apply_rotary_pos_emb), so kvhandoff must ignore it too
    "partial": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}

GEOMETRY_CHANGES = ("more_layers", "fewer_layers", "more_kv_heads", "fewer_kv_heads", "wider_heads", "narrower_heads")


def exact_pair(change: str, family: str = "qwen2", source_rope: str = "default", target_rope: str = "default"):
    """(source, target) whose content K/V are exactly linear in each other while their geometry or RoPE differ.

    change: one of GEOMETRY_CHANGES (the target has more/fewer layers, KV heads, a wider/narrower head dim: the
    builder above applied to the target, or to the source for "fewer"/"narrower"), or "rope": both models attend
    only in their last layer (`attention_only_in_last_layer`), under `source_rope` / `target_rope` (ROPES names).
    The target is then passed through `exactly_related`, so its cache is not the source's.
    """
    base = tiny_model(family, layers=3)
    grow = {"layers": with_identity_layers, "kv_heads": with_duplicated_kv_heads, "heads": with_doubled_head_dim}
    if change == "rope":
        base = attention_only_in_last_layer(base)
        source, target = with_rope(base, ROPES[source_rope]), with_rope(base, ROPES[target_rope])
    elif change.startswith(("more_", "wider_")):
        source, target = base, grow[change.split("_", 1)[1]](base)
    elif change.startswith(("fewer_", "narrower_")):
        source, target = grow[change.split("_", 1)[1]](base), base
    else:
        raise ValueError(change)
    return source, exactly_related(target)


def pair_guards(settings, mappers) -> dict:
    """Each ordered pair's `GuardPolicy` under ``settings`` (a `SwitchSettings`), as `pair_policies` resolves it."""
    from kvhandoff.runtime.switch.pair import pair_policies

    return {pair: policy.guard for pair, policy in pair_policies(settings, mappers).items()}


def pair_recomputes(settings, mappers) -> dict:
    """Each ordered pair's `ServedRecompute` under ``settings``, as `pair_policies` resolves it."""
    from kvhandoff.runtime.switch.pair import pair_policies

    return {pair: policy.recompute for pair, policy in pair_policies(settings, mappers).items()}


#: a calibration small enough for a tiny pair's fit in a test
TINY_CALIBRATION = CalibrationSpec(num_sequences=3, seq_len=64)


@pytest.fixture
def named_pair(tmp_path, monkeypatch):
    """A tiny pair saved to disk and loaded as a `NamedPair`, its caches under a home of its own."""
    from kvhandoff.workflow import load_named_pair

    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    return load_named_pair(small, large, progress=False)
