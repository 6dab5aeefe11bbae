import pytest
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

from kvhandoff.errors import UnsupportedModelError
from kvhandoff.model.geometry import model_fingerprint, read_geometry, signatures_match

from conftest import LLAMA31_ROPE, tiny_model


def test_reads_each_supported_family(family):
    geometry = read_geometry(tiny_model(family, layers=3))
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (3, 2, 16)
    assert geometry.has_k_norm == (family == "qwen3")
    assert geometry.qkv_bias == (family == "qwen2")
    assert geometry.rope.rope_type == "default" and geometry.rope.rotary_dim == 16


def test_llama31_rope_scaling_is_read():
    model = tiny_model(
        "llama",
        rope_parameters=LLAMA31_ROPE,
    )
    rope = read_geometry(model).rope
    assert rope.rope_type == "llama3" and rope.rope_theta == 500000.0


# a minimal decoder shape shared by the configs of refused architectures below
SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


def test_gemma3_mixed_attention_is_refused():
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        read_geometry(Gemma3ForCausalLM(config))


def test_sliding_window_qwen2_is_refused():
    config = Qwen2Config(**SMALL, num_hidden_layers=2, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=16, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        read_geometry(Qwen2ForCausalLM(config))


def test_sliding_window_mistral_is_refused():
    with pytest.raises(UnsupportedModelError, match="sliding_window=32"):
        read_geometry(tiny_model("mistral", sliding_window=32))


def test_unknown_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' is not supported"):
        read_geometry(model)


def test_mla_is_refused_with_reason():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **SMALL,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_key_value_heads=2,
        n_routed_experts=2,
        num_experts_per_tok=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
    )
    with pytest.raises(UnsupportedModelError, match="MLA"):
        read_geometry(DeepseekV3ForCausalLM(config))


def test_fingerprint_tells_apart_shapes_and_checkpoints_but_not_dtype():
    a, b = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    fa, fb = model_fingerprint(a), model_fingerprint(b)
    assert fa["weights_hash"] == fb["weights_hash"]
    assert not signatures_match(fa["weight_signature"], fb["weight_signature"])
    assert signatures_match(fa["weight_signature"], model_fingerprint(a.bfloat16())["weight_signature"])
    assert fa["weights_hash"] != model_fingerprint(tiny_model("qwen2", layers=3))["weights_hash"]
