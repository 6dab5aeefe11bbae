import torch

from kvhandoff.model.cache import prefill
from kvhandoff.model.capture import cache_to_content, capture_content_kv

from conftest import tiny_model


def test_capture_shapes_and_matches_stripped_cache(family):
    model = tiny_model(family, layers=3)
    ids = torch.randint(0, 128, (2, 33))
    content = capture_content_kv(model, ids, with_queries=True)
    assert content.keys.shape == (3, 2, 2, 33, 16) and content.values.shape == (3, 2, 2, 33, 16)
    assert content.queries.shape == (3, 2, 4, 33, 16)
    cache, _ = prefill(model, ids)
    stripped = cache_to_content(cache, model.config)
    assert torch.allclose(stripped.keys, content.keys, atol=1e-4)
    assert torch.equal(stripped.values, content.values)


def test_capture_is_before_rope_and_leaves_no_hooks():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 128, (1, 10))
    content = capture_content_kv(model, ids)
    cache, _ = prefill(model, ids)
    # position 0 has no rotation; later positions differ from the cache
    assert torch.allclose(content.keys[0, :, :, 0], cache.layers[0].keys[:, :, 0], atol=1e-6)
    assert not torch.allclose(content.keys[0, :, :, 5], cache.layers[0].keys[:, :, 5], atol=1e-3)
    assert all(not layer.self_attn.k_proj._forward_hooks for layer in model.model.layers)


def test_qwen3_keys_are_taken_after_k_norm():
    model = tiny_model("qwen3")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight.fill_(3.0)
    content = capture_content_kv(model, torch.randint(0, 128, (1, 8)))
    rms = content.keys[0].pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.full_like(rms, 3.0), atol=1e-2)


def test_all_finite_is_exact_where_the_sum_overflows():
    from kvhandoff.model.capture import all_finite

    x = torch.randn(3, 4, 5)
    assert all_finite(x) and all_finite(torch.arange(5))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 3] = bad
        assert not all_finite(y)
    both = x.clone()
    both[0, 0, 0], both[2, 3, 4] = float("inf"), float("-inf")  # the sum is NaN, not ±Inf
    assert not all_finite(both)
    assert all_finite(torch.full((4,), 3e38))  # finite values whose float32 sum overflows
    assert all_finite(torch.full((4,), 6e4, dtype=torch.float16)) and all_finite(torch.full((2,), 1e300,
                                                                                            dtype=torch.float64))
