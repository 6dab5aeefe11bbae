import pytest
import torch

from _mapper_support import ALL_LAYERS, SRC, TGT, hand_manifest, random_tensor
from kvhandoff.errors import MapperFormatError
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.mapper.mlp import MLPMapper, ResidualMLP

INPUT_LAYERS = torch.tensor([[1], [0], [1]])  # the source layer each target layer's MLP reads


def _dense() -> DenseMapper:
    weight = random_tensor(2, TGT.num_layers, SRC.num_layers * SRC.layer_width, TGT.layer_width, seed=1)
    bias = random_tensor(2, TGT.num_layers, TGT.layer_width, seed=2)
    return DenseMapper(weight, bias, torch.tensor(ALL_LAYERS), hand_manifest("ridge"))


def _mlp(trained: bool = True, hidden: int = 6) -> ResidualMLP:
    mlp = ResidualMLP(TGT.num_layers, 2 * SRC.layer_width, hidden, 2 * TGT.layer_width, seed=3)
    if trained:  # a nonzero output layer: the MLP corrects
        torch.nn.init.normal_(mlp.w3, generator=torch.Generator().manual_seed(4))
    return mlp


def _mapper(mlp: ResidualMLP, **manifest_fields) -> MLPMapper:
    base = _dense()
    manifest = hand_manifest("mlp", mlp_input_layers=INPUT_LAYERS.tolist(), **manifest_fields)
    return MLPMapper(base.weight, base.bias, base.selected, manifest, INPUT_LAYERS, mlp)


def test_an_untrained_mlp_adds_nothing_and_a_trained_one_corrects_the_linear_map():
    x = random_tensor(8, SRC.width, seed=5)
    linear = _dense().map_feature_rows(x)
    assert torch.equal(_mapper(_mlp(trained=False)).map_feature_rows(x), linear)
    assert not torch.allclose(_mapper(_mlp()).map_feature_rows(x), linear)


def test_the_size_counts_the_linear_map_and_the_mlps():
    mlp, dense = _mlp(hidden=6), _dense()
    mapper = _mapper(mlp)
    mlp_parameters = sum(t.numel() for t in mlp.tensors().values())
    assert mapper.num_parameters() == dense.num_parameters() + mlp_parameters
    assert mapper.nbytes() == dense.nbytes() + 4 * mlp_parameters
    matmuls = TGT.num_layers * (2 * SRC.layer_width * 6 + 6 * 6 + 6 * 2 * TGT.layer_width)
    biases = TGT.num_layers * (6 + 6 + 2 * TGT.layer_width)
    assert mapper.flops_per_token() == dense.flops_per_token() + 2 * matmuls + biases


def test_a_saved_mlp_mapper_loads_as_one_and_moves_with_to(tmp_path):
    mapper = _mapper(_mlp())
    x = random_tensor(4, SRC.width, seed=6)
    loaded = Mapper.load(mapper.save(tmp_path / "m"))
    assert type(loaded) is MLPMapper and torch.equal(loaded.input_layers, INPUT_LAYERS)
    assert torch.equal(loaded.map_feature_rows(x), mapper.map_feature_rows(x))
    loaded.to(dtype=torch.float64)
    assert loaded.mlp.w1.dtype == loaded.weight.dtype == torch.float64 and loaded.input_layers.dtype == torch.long
    assert torch.allclose(loaded.map_feature_rows(x), mapper.map_feature_rows(x), atol=1e-5)


def test_mlps_that_do_not_fit_the_pair_or_the_manifest_are_refused():
    with pytest.raises(MapperFormatError, match="does not fit a 3-layer target"):
        _mapper(ResidualMLP(TGT.num_layers, SRC.layer_width, 6, 2 * TGT.layer_width))
    base = _dense()
    with pytest.raises(MapperFormatError, match="differ from the manifest's mlp_input_layers"):
        MLPMapper(base.weight, base.bias, base.selected, hand_manifest("mlp", mlp_input_layers=[[0], [0], [0]]),
                  INPUT_LAYERS, _mlp())
    tensors = _mlp().tensors()
    tensors["b1"] = torch.zeros(TGT.num_layers, 1, 7)
    with pytest.raises(MapperFormatError, match="MLP tensor b1 has shape"):
        ResidualMLP.from_tensors(tensors)
