"""llama.cpp's sequence state as bytes: written from rows and parsed back bit for bit, in both V layouts and every
float cache type; the refusals name the mismatch."""

import struct

import pytest
import torch

from kvhandoff.runtime.llama_cpp import state
from kvhandoff.runtime.llama_cpp.state import CacheLayout, StateFormatError


def _rows(layers: int = 3, heads: int = 2, head_dim: int = 4, count: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, heads, count, head_dim, generator=gen), torch.randn(1, heads, count, head_dim,
                                                                                  generator=gen))
            for _ in range(layers)]


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_rows_round_trip_through_the_bytes(v_trans, kind):
    code = state.GGML_TYPE_NAMES[kind]
    layout = CacheLayout(3, 2, 4, k_type=code, v_type=code, v_trans=v_trans)
    rows = _rows()
    seq = state.from_rows(rows, torch.arange(7, 12), layout)
    blob = state.write(seq, layout, seq_id=3)
    back = state.parse(blob, layout)
    assert back.positions.tolist() == [7, 8, 9, 10, 11]
    for (keys, values), (keys2, values2) in zip(rows, state.to_rows(back, layout), strict=True):
        dtype = state.GGML_FLOAT_TYPES[code]
        assert torch.equal(keys2, keys.to(dtype).float())
        assert torch.equal(values2, values.to(dtype).float())
    assert state.write(back, layout, seq_id=3) == blob  # bit for bit


def test_the_bytes_follow_the_pinned_layout():
    layout = CacheLayout(1, 1, 2, k_type=0, v_type=0, v_trans=True)
    keys = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    values = torch.tensor([[[[5.0, 6.0], [7.0, 8.0]]]])
    blob = state.write(state.from_rows([(keys, values)], torch.tensor([0, 1]), layout), layout, seq_id=2)
    expected = (struct.pack("<IiI", state.MAGIC, 2, 1) + struct.pack("<I", 2)
                + struct.pack("<iIi", 0, 1, 2) + struct.pack("<iIi", 1, 1, 2) + struct.pack("<II", 1, 1)
                + struct.pack("<iQ", 0, 8) + struct.pack("<4f", 1, 2, 3, 4)
                + struct.pack("<iII", 0, 4, 2) + struct.pack("<4f", 5, 7, 6, 8))  # V transposed: per element, cells
    assert blob == expected


def test_cells_are_sorted_by_position_and_other_streams_are_empty():
    layout = CacheLayout(1, 1, 2, k_type=0, v_type=0, v_trans=False, n_stream=3)
    keys = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
    seq = state.from_rows([(keys, keys)], torch.tensor([1, 0]), layout)
    back = state.parse(state.write(seq, layout), layout)
    assert back.positions.tolist() == [0, 1]
    assert back.keys[0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    empty = state.parse(state.write(state.SeqState(torch.zeros(0, dtype=torch.int64), [torch.zeros(0, 2)],
                                                   [torch.zeros(0, 2)]), layout), layout)
    assert empty.length == 0


def _blob(layout=None):
    layout = layout or CacheLayout(2, 1, 4)
    return state.write(state.from_rows(_rows(2, 1, 4, 3), torch.arange(3), layout), layout), layout


@pytest.mark.parametrize(("other", "named"), [
    (CacheLayout(3, 1, 4), "layer count"),
    (CacheLayout(2, 2, 4), "row size"),
    (CacheLayout(2, 1, 4, k_type=0, v_type=0), "cache type is f16, this context's f32"),
    (CacheLayout(2, 1, 4, v_trans=False), "V layout"),
    (CacheLayout(2, 1, 4, n_stream=4), "stream count"),
])
def test_a_state_of_another_model_or_context_is_refused_by_name(other, named):
    blob, _ = _blob()
    with pytest.raises(StateFormatError, match=named):
        state.parse(blob, other)


def test_other_bytes_are_refused():
    blob, layout = _blob()
    with pytest.raises(StateFormatError, match="magic"):
        state.parse(b"\0" * 16, layout)
    with pytest.raises(StateFormatError, match="truncated"):
        state.parse(blob[:-3], layout)
    with pytest.raises(StateFormatError, match="bytes follow"):
        state.parse(blob + b"\0", layout)


def test_a_quantized_cache_is_refused_with_the_fix():
    with pytest.raises(StateFormatError, match="type_k/type_v"):
        CacheLayout(2, 1, 4, k_type=8)
