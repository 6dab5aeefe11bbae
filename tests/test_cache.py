import math

import pytest
import torch

from kvhandoff.model.cache import cache_copy, cache_of, cache_view, feed, kl_divergence, model_device, prefill, rollback

from conftest import tiny_model


def _layers(count: int = 2, tokens: int = 5):
    return [(torch.arange(2 * 3 * tokens * 4, dtype=torch.float32).view(2, 3, tokens, 4) + 100 * i,
             -torch.arange(2 * 3 * tokens * 4, dtype=torch.float32).view(2, 3, tokens, 4) - 100 * i)
            for i in range(count)]


def test_cache_of_holds_the_given_tensors_without_copies():
    layers = _layers()
    cache = cache_of(layers)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 5
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        assert layer.keys is keys and layer.values is values and layer.is_initialized
    assert cache.layers[1].keys[1, 2, 4, 3] == 100 + (1 * 3 * 5 * 4 + 2 * 5 * 4 + 4 * 4 + 3)


def test_cache_copy_owns_its_tensors():
    layers = _layers(tokens=6)
    cache = cache_of(layers)
    copied = cache_copy(cache)
    assert copied.get_seq_length() == 6
    for mine, (keys, values) in zip(copied.layers, layers, strict=True):
        assert torch.equal(mine.keys, keys) and torch.equal(mine.values, values) and mine.keys is not keys
    copied.layers[0].keys[0, 0, 0, 0] = -7.0
    rollback(copied, 2)
    assert layers[0][0][0, 0, 0, 0] == 0.0 and cache.get_seq_length() == 6  # the original is as it was


def test_cache_view_is_a_view_of_the_positions():
    layers = _layers(tokens=6)
    cache = cache_of(layers)
    view = cache_view(cache, 2, 5)
    assert view.get_seq_length() == 3
    assert torch.equal(view.layers[1].values, layers[1][1][:, :, 2:5])
    view.layers[0].keys[0, 0, 0, 0] = -1.0  # writes reach the original: no copy
    assert layers[0][0][0, 0, 2, 0] == -1.0
    assert cache_view(cache, 4).get_seq_length() == 2


def test_rollback_drops_positions_past_the_length():
    layers = _layers(tokens=7)
    cache = cache_of([(k.clone(), v.clone()) for k, v in layers])
    rollback(cache, 7)
    assert cache.get_seq_length() == 7
    rollback(cache, 3)
    assert cache.get_seq_length() == 3
    assert torch.equal(cache.layers[1].keys, layers[1][0][:, :, :3])
    with pytest.raises(ValueError, match="cannot roll a cache of 3 tokens back to 4"):
        rollback(cache, 4)


def test_kl_divergence_exact_values():
    own = torch.tensor([[0.5, 0.5], [1.0, 0.0]]).clamp_min(1e-30).log()
    mapped = torch.tensor([[0.25, 0.75], [0.5, 0.5]]).log()
    kl = kl_divergence(own, mapped)
    expected_first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl.shape == (2,)
    assert kl[0].item() == pytest.approx(expected_first, abs=1e-7)
    assert kl[1].item() == pytest.approx(math.log(2.0), abs=1e-7)
    assert kl_divergence(mapped, mapped).abs().max().item() == 0.0


def test_prefill_and_feed_extend_one_cache_and_match_a_full_pass():
    model = tiny_model("qwen2", layers=2)
    assert model_device(model) == torch.device("cpu") and model_device(object()) == torch.device("cpu")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    cache, last = prefill(model, ids[:, :6])
    assert cache.get_seq_length() == 6 and last.shape == (1, model.config.vocab_size)
    logprobs = feed(model, cache, ids[0, 6:].tolist())
    assert cache.get_seq_length() == 9 and logprobs.shape == (3, model.config.vocab_size)
    with torch.no_grad():
        full = model(input_ids=ids).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(logprobs, full[6:], atol=1e-5, rtol=1e-5)


def test_the_input_device_is_the_token_embeddings():
    model = tiny_model()
    model.model.embed_tokens.to("meta")  # the embedding elsewhere than the first parameters of the rest
    assert model_device(model) == torch.device("meta")
    assert next(model.model.layers.parameters()).device == torch.device("cpu")
