import pytest
import torch

from kvhandoff.model import attention
from kvhandoff.model.attention import received_attention


def _reference(queries, keys, positions, scaling):
    """Each query's softmax over the keys it may see, written out one query and head at a time."""
    group = queries.shape[1] // keys.shape[1]
    received = torch.zeros(queries.shape[0], keys.shape[2])
    for b in range(queries.shape[0]):
        for h in range(queries.shape[1]):
            for i, p in enumerate(positions.tolist()):
                logits = keys[b, h // group, : p + 1] @ queries[b, h, i] * scaling
                received[b, : p + 1] += logits.softmax(-1)
    return received


@pytest.mark.parametrize("chunk", [2, 256])
def test_received_attention_is_each_querys_causal_softmax_summed(monkeypatch, chunk):
    monkeypatch.setattr(attention, "QUERY_CHUNK", chunk)
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 12, 8)
    positions = torch.tensor([3, 6, 7, 10, 11])
    got = received_attention(queries, keys, positions, 0.5)
    torch.testing.assert_close(got, _reference(queries, keys, positions, 0.5), rtol=1e-5, atol=1e-5)
    # every head of every query hands out a whole unit, none of it to keys after the query
    torch.testing.assert_close(got.sum(1), torch.full((2,), 4.0 * 5))
    assert torch.all(got >= 0)
    late = received_attention(queries[:, :, :1], keys, positions[:1], 0.5)
    assert torch.all(late[:, 4:] == 0)
