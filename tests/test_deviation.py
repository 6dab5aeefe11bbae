"""The per-position deviation scores: nil on the model's own cache; layer 0's blind to a changed context, layer 1's
(`blend_scores`) not."""

from __future__ import annotations

import torch

from kvhandoff.model.cache import cache_of
from kvhandoff.runtime.deviation import blend_scores, deviation_scores, layer0_kv

from conftest import tiny_model


def test_own_rows_score_nil_and_a_changed_context_shows_at_layer_one_only():
    model = tiny_model("qwen2", layers=3)
    ids = torch.tensor([[5, 9, 17, 33, 2, 71, 8, 44, 90, 3]])
    with torch.inference_mode():
        own = model(ids, use_cache=True).past_key_values
        other = model(torch.tensor([[60, 61, 62, *ids[0, 3:].tolist()]]), use_cache=True).past_key_values
    assert deviation_scores(model, own, ids).max() < 1e-10 and blend_scores(model, own, ids).max() < 1e-10
    keys, values = layer0_kv(model, ids)
    assert torch.allclose(keys, own.layers[0].keys, atol=1e-5) and torch.allclose(values, own.layers[0].values,
                                                                                   atol=1e-5)
    # the same tokens 3.. after another beginning: layer 0's rows equal (same token, same position), layer 1's not
    mixed = cache_of((torch.cat([mine.keys[:, :, :3], theirs.keys[:, :, 3:]], dim=2),
                      torch.cat([mine.values[:, :, :3], theirs.values[:, :, 3:]], dim=2))
                     for mine, theirs in zip(own.layers, other.layers, strict=True))
    assert deviation_scores(model, mixed, ids)[0, 3:].max() < 1e-10
    assert blend_scores(model, mixed, ids)[0, 3:].min() > 1e-6
