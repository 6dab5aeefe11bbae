import pytest
import torch

from _mapper_support import SRC, TGT, hand_manifest, random_tensor
from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError, MapperFormatError, NonFiniteError
from kvhandoff.mapper.blocks import BlockMapper
from kvhandoff.mapper.mapper import Mapper


def _blocks(seed: int = 0):
    """Two groups: the K of target layer t from the K of source layer t % 2 (8 → 4 columns), and the V of every
    target layer from the whole source row (32 → 4)."""
    k_inputs = torch.stack([SRC.layer_indices(0, [t % 2]) for t in range(TGT.num_layers)])
    v_inputs = torch.arange(SRC.width).expand(TGT.num_layers, -1)
    outputs = [torch.stack([TGT.layer_indices(m, [t]) for t in range(TGT.num_layers)]) for m in (0, 1)]
    inputs = [k_inputs, v_inputs]
    weights = [random_tensor(TGT.num_layers, i.shape[1], TGT.layer_width, seed=seed + g) for g, i in enumerate(inputs)]
    biases = [random_tensor(TGT.num_layers, TGT.layer_width, seed=seed + 10 + g) for g in range(2)]
    return weights, biases, inputs, outputs


def _mapper(config: FitConfig | None = None, **changes) -> BlockMapper:
    weights, biases, inputs, outputs = _blocks()
    parts = {"weights": weights, "biases": biases, "inputs": inputs, "outputs": outputs, **changes}
    return BlockMapper(parts["weights"], parts["biases"], parts["inputs"], parts["outputs"],
                       torch.tensor([[0, 1]] * TGT.num_layers), hand_manifest("blocks", config=config))


def test_each_block_writes_its_columns_from_its_columns_and_the_size_is_counted():
    mapper = _mapper()
    weights, biases, inputs, outputs = _blocks()
    x = random_tensor(7, SRC.width, seed=5)
    expected = torch.empty(7, TGT.width)
    for w, b, i, o in zip(weights, biases, inputs, outputs, strict=True):
        for block in range(w.shape[0]):
            expected[:, o[block]] = x[:, i[block]] @ w[block] + b[block]
    assert torch.allclose(mapper.map_feature_rows(x), expected, atol=1e-5)
    parameters = sum(w.numel() + b.numel() for w, b in zip(weights, biases, strict=True))
    assert mapper.num_parameters() == parameters
    assert mapper.nbytes() == 4 * parameters + 8 * sum(t.numel() for t in [*inputs, *outputs])
    assert mapper.flops_per_token() == sum(2 * w.numel() + b.numel() for w, b in zip(weights, biases, strict=True))


def test_a_saved_block_mapper_loads_as_one_and_half_storage_rounds_only_the_weights(tmp_path):
    mapper = _mapper(FitConfig(storage_dtype="float16"))
    stored = mapper.stored()
    assert torch.equal(stored.weights[0], mapper.weights[0].half().float())
    assert torch.equal(stored.biases[1], mapper.biases[1])
    loaded = Mapper.load(stored.save(tmp_path / "m"))
    assert type(loaded) is BlockMapper and loaded.manifest.storage["parameters"] == mapper.num_parameters()
    x = random_tensor(5, SRC.width, seed=6)
    assert torch.equal(loaded.map_feature_rows(x), stored.map_feature_rows(x))


def test_blocks_that_do_not_cover_every_target_column_once_or_do_not_fit_are_refused():
    _, _, inputs, outputs = _blocks()
    twice = [outputs[0], outputs[0]]
    with pytest.raises(MapperFormatError, match="exactly once"):
        _mapper(outputs=twice)
    with pytest.raises(MapperFormatError, match="do not fit"):
        _mapper(inputs=[inputs[0][:, :4], inputs[1]])
    with pytest.raises(MapperFormatError, match="reads columns outside"):
        _mapper(inputs=[inputs[0] + SRC.width, inputs[1]])
    with pytest.raises(MapperFormatError, match="as many weight, bias, input and output groups"):
        _mapper(biases=[_blocks()[1][0]])
    with pytest.raises(MapperFormatError, match="lacks tensors"):
        BlockMapper.from_tensors({"selected": torch.zeros(3, 2, dtype=torch.long)}, hand_manifest("blocks"))


def test_to_casts_every_group_and_the_map_is_not_refined_end_to_end():
    mapper = _mapper()
    x = random_tensor(4, SRC.width, seed=7)
    reference = mapper.map_feature_rows(x)
    mapper.to(dtype=torch.float64)
    assert mapper.dtype == torch.float64 and all(w.dtype == torch.float64 for w in mapper.weights)
    assert all(i.dtype == torch.long for i in mapper.inputs)
    assert torch.allclose(mapper.map_feature_rows(x), reference, atol=1e-5)
    with pytest.raises(ConfigError, match="not refined end to end"):
        mapper.map_tensors()


def test_a_nan_block_is_never_saved(tmp_path):
    weights = _blocks()[0]
    weights[1] = weights[1].clone()
    weights[1][2, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"blocks\.1\.weight holds NaN/Inf"):
        _mapper(weights=weights).save(tmp_path / "m")
    assert not (tmp_path / "m").exists()
