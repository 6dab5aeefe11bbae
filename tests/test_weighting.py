import pytest
import torch

from kvhandoff.errors import StatisticsError
from kvhandoff.fit.weighting import (
    WEIGHT_CAP,
    AttentionRows,
    UniformRows,
    history_weights,
    reader_attention,
    reader_start,
    row_weighting,
)
from kvhandoff.model.capture import capture_content_kv

from conftest import random_batches, tiny_model


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_reader_attention_is_the_models_own_attention_from_the_reader_queries(family):
    """Recomputed from the captured content K/V and queries, the scores equal the eager attention weights of the
    model's own forward, summed over layers, heads and the reader's queries."""
    model = tiny_model(family, layers=3)
    ids = random_batches(1, batch=2, tokens=40)[0]
    with torch.inference_mode():
        out = model(input_ids=ids, output_attentions=True)
    start = reader_start(40)
    reference = sum(att[:, :, start:].sum(dim=(1, 2)) for att in out.attentions)
    got = reader_attention(model, capture_content_kv(model, ids, with_queries=True), start)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(StatisticsError, match="with_queries=True"):
        reader_attention(model, capture_content_kv(model, ids), start)


def test_history_weights_average_one_cap_the_sinks_and_leave_the_reader_at_one():
    received = torch.tensor([[50.0, 1.0, 2.0, 3.0, 0.5, 9.0, 9.0], [0.0] * 7])
    weights = history_weights(received, 5)
    scaled = (received[0, :5] / received[0, :5].mean()).double().clamp(max=WEIGHT_CAP)
    torch.testing.assert_close(weights[0, :5], scaled / scaled.mean())
    assert scaled[0] == WEIGHT_CAP  # the sink, 4.4 times the mean, is capped
    torch.testing.assert_close(weights[0, :5].mean(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.all(weights[0, 5:] == 1) and torch.all(weights[1] == 1)  # the reader, and nothing received: 1


def test_the_reader_is_the_windows_last_quarter():
    assert reader_start(512) == 384 and reader_start(2) == 1 and reader_start(1) == 1


def test_weightings_by_name():
    assert isinstance(row_weighting("uniform"), UniformRows) and isinstance(row_weighting("attention"), AttentionRows)
    assert not UniformRows.needs_queries and AttentionRows.needs_queries
    model = tiny_model("qwen2", layers=2)
    ids = random_batches(1, batch=1, tokens=32)[0]
    content = capture_content_kv(model, ids, with_queries=True)
    assert UniformRows().position_weights(model, content) is None
    weights = AttentionRows().position_weights(model, content)
    assert weights.shape == (1, 32) and weights.dtype == torch.float64
    assert torch.all(weights[:, reader_start(32):] == 1)
    torch.testing.assert_close(weights[:, : reader_start(32)].mean(), torch.tensor(1.0, dtype=torch.float64))
