import pytest
import torch
from transformers import LlamaConfig

from kvhandoff.errors import UnsupportedModelError
from kvhandoff.model.rope import (
    TABLE_STEP,
    RopeTable,
    apply_rope,
    rope_frequencies,
    rotate,
    rotate_half,
    scaled_cos_sin,
    strip_rope,
)

from conftest import LLAMA31_ROPE, tiny_model

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": LLAMA31_ROPE,
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "partial_rotary": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


def config_for(params):
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters=dict(params),
    )


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_strip_inverts_apply(case):
    config = config_for(ROPE_CASES[case])
    inv_freq, scaling = rope_frequencies(config, seq_len=600)
    keys = torch.randn(3, 2, 2, 600, 32)  # [layers, batch, heads, tokens, dim]
    positions = torch.arange(600).expand(2, 600)
    roundtrip = strip_rope(apply_rope(keys, positions, inv_freq, scaling), positions, inv_freq, scaling)
    assert torch.allclose(roundtrip, keys, atol=2e-5, rtol=1e-5)


def test_yarn_has_attention_scaling_and_partial_rotary_passes_rest_through():
    _, scaling = rope_frequencies(config_for(ROPE_CASES["yarn"]))
    assert scaling != 1.0
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16)  # 16 rotary dims out of 32
    keys = torch.randn(1, 1, 5, 32)
    rotated = apply_rope(keys, torch.arange(5), inv_freq)
    assert torch.equal(rotated[..., 16:], keys[..., 16:])
    assert not torch.allclose(rotated[..., 1:, :16], keys[..., 1:, :16])
    assert torch.equal(strip_rope(rotated, torch.arange(5), inv_freq)[..., 16:], keys[..., 16:])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("case", ["default", "linear", "llama3", "yarn", "partial_rotary"])
def test_frequencies_are_the_models_own(family, case):
    """Bit for bit the model's rotary embedding: a default-type config's partial_rotary_factor is ignored by every
    supported family (all dims rotate), so kvhandoff ignores it too."""
    model = tiny_model(family, head_dim=32, rope_parameters=dict(ROPE_CASES[case]))
    inv_freq, scaling = rope_frequencies(model.config)
    assert torch.equal(inv_freq, model.model.rotary_emb.inv_freq)
    assert scaling == model.model.rotary_emb.attention_scaling


def test_apply_matches_transformers_rotary_embedding():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = config_for(ROPE_CASES["llama3"])
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(40)[None]
    keys = torch.randn(1, 2, 40, 32)
    cos, sin = rotary(keys, positions)
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    inv_freq, scaling = rope_frequencies(config)
    assert torch.allclose(apply_rope(keys, positions, inv_freq, scaling), expected, atol=1e-6)


def test_dynamic_frequencies_depend_on_length():
    config = config_for(ROPE_CASES["dynamic"])
    short, _ = rope_frequencies(config, seq_len=100)
    long, _ = rope_frequencies(config, seq_len=2000)
    assert not torch.allclose(short, long)


def test_unknown_rope_type_is_refused():
    config = config_for(ROPE_CASES["default"])
    config.rope_parameters = {"rope_type": "mystery", "rope_theta": 1.0}
    with pytest.raises(UnsupportedModelError, match="unknown rope type 'mystery'"):
        rope_frequencies(config)


def test_rotate_is_the_rotate_half_formula_bit_for_bit():
    x, cos, sin = torch.randn(3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    assert torch.equal(rotate(x, cos, sin), x * cos + rotate_half(x) * sin)
    assert torch.equal(rotate(x, cos, sin, inverse=True), x * cos - rotate_half(x) * sin)


@pytest.mark.parametrize("case", ["default", "dynamic", "yarn", "partial_rotary"])
def test_a_rope_table_holds_the_rows_apply_rope_computes(case):
    config = config_for(ROPE_CASES[case])
    table = RopeTable(config)
    positions = torch.tensor([[3, 7, 40], [0, 1, 2]])
    cos, sin, scaling = table.lookup(positions, 3, torch.device("cpu"))
    inv_freq, expected_scaling = rope_frequencies(config, seq_len=41)
    want_cos, want_sin = scaled_cos_sin(positions, inv_freq, expected_scaling)
    assert scaling == expected_scaling and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    keys = torch.randn(2, 1, 3, 32)
    rotary = cos.shape[-1]
    rotated = rotate(keys[..., :rotary], cos[:, None], sin[:, None])
    assert torch.equal(rotated, apply_rope(keys, positions, inv_freq, scaling)[..., :rotary])
    first, _, _ = table.lookup(None, 5, torch.device("cpu"))
    assert torch.equal(first, cos_at(config, torch.arange(5)[None], seq_len=5))


def test_a_length_free_table_grows_in_steps_and_a_length_dependent_one_follows_the_length():
    free, dynamic = RopeTable(config_for(ROPE_CASES["llama3"])), RopeTable(config_for(ROPE_CASES["dynamic"]))
    assert free.length_free and not dynamic.length_free
    cpu = torch.device("cpu")
    free.lookup(None, 10, cpu)
    kept = free.lookup(None, TABLE_STEP, cpu)[0]
    assert free.lookup(None, 7, cpu)[0].data_ptr() == kept.data_ptr()  # no rebuild below the table's length
    assert free.lookup(None, TABLE_STEP + 1, cpu)[0].shape[1] == TABLE_STEP + 1
    short = dynamic.lookup(None, 100, cpu)[0]
    long = dynamic.lookup(None, 900, cpu)[0]
    assert not torch.allclose(short, long[:, :100])  # dynamic scaling: other frequencies at another length


def cos_at(config, positions, seq_len):
    inv_freq, scaling = rope_frequencies(config, seq_len=seq_len)
    return scaled_cos_sin(positions, inv_freq, scaling)[0]
