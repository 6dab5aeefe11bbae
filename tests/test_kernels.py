import pytest
import torch
from torch.profiler import profile

from kvhandoff.model.kernels import (
    SMALL_BATCH_ROWS,
    small_batch_kernels_available,
    small_batch_linear,
    use_small_batch_kernels,
)

from conftest import tiny_model

pytestmark = pytest.mark.skipif(not small_batch_kernels_available(), reason="this torch build has no oneDNN")


def ran_onednn(work) -> bool:
    with profile() as prof:
        work()
    return any("_linear_pointwise" in event.name for event in prof.events())


def test_small_batch_linear_uses_onednn_inside_its_row_range_and_matches_linear():
    layer = torch.nn.Linear(64, 96)
    low, high = SMALL_BATCH_ROWS
    with torch.inference_mode():
        for rows in (1, low - 1, low, 16, high, high + 1):
            x = torch.randn(1, rows, 64)
            expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert (small_batch_linear(layer, x) - expected).abs().max() <= 1e-5
            assert ran_onednn(lambda x=x: small_batch_linear(layer, x)) == (low <= rows <= high)
        half = torch.nn.Linear(64, 96).to(torch.bfloat16)
        assert not ran_onednn(lambda: small_batch_linear(half, torch.randn(8, 64, dtype=torch.bfloat16)))


def test_gradients_take_torchs_linear():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(8, 16, requires_grad=True)
    assert not ran_onednn(lambda: small_batch_linear(layer, x).sum().backward())
    assert x.grad is not None and layer.weight.grad is not None


def test_a_routed_model_reads_a_few_tokens_as_before_and_can_be_restored():
    model = tiny_model("qwen2", layers=2)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    ids = torch.randint(0, 128, (1, 6))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        assert use_small_batch_kernels(model) == len(linears) and use_small_batch_kernels(model) == 0
        assert (model(input_ids=ids).logits - reference).abs().max() <= 1e-5
        assert ran_onednn(lambda: model(input_ids=ids))
        assert use_small_batch_kernels(model, enabled=False) == len(linears)
        assert not ran_onednn(lambda: model(input_ids=ids))


def test_layers_routed_by_something_else_or_not_float32_are_left_alone():
    model = tiny_model("llama", layers=2)
    hooked = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    hooked.forward = lambda x: torch.nn.functional.linear(x, hooked.weight, hooked.bias)  # e.g. a device hook
    count = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert use_small_batch_kernels(model) == count - 1
    assert use_small_batch_kernels(model, enabled=False) == count - 1 and "forward" in hooked.__dict__
    assert use_small_batch_kernels(tiny_model("qwen2", layers=2).to(torch.bfloat16)) == 0
