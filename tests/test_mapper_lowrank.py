import pytest
import torch

from _mapper_support import SRC, TGT, hand_manifest, random_tensor
from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError, MapperFormatError
from kvhandoff.mapper.lowrank import LowRankMapper
from kvhandoff.mapper.mapper import Mapper

RANK = 3
SELECTED = torch.tensor([[0, 1]] * TGT.num_layers)


def _mapper(config: FitConfig | None = None) -> LowRankMapper:
    projection = random_tensor(2, SRC.modality_width, RANK, seed=1)
    weight = random_tensor(2, RANK, TGT.modality_width, seed=2)
    bias = random_tensor(2, TGT.modality_width, seed=3)
    return LowRankMapper(projection, weight, bias, SELECTED, hand_manifest("lowrank", config=config))


def test_each_modality_reads_one_shared_projection_and_the_size_is_counted():
    mapper = _mapper()
    x = random_tensor(6, SRC.width, seed=4)
    expected = torch.cat([x[:, m * SRC.modality_width:(m + 1) * SRC.modality_width] @ mapper.projection[m]
                          @ mapper.weight[m] + mapper.bias[m] for m in (0, 1)], dim=1)
    assert mapper.rank == RANK
    assert torch.allclose(mapper.map_feature_rows(x), expected, atol=1e-5)
    assert mapper.num_parameters() == 2 * (SRC.modality_width * RANK + RANK * TGT.modality_width + TGT.modality_width)
    assert mapper.flops_per_token() == 2 * 2 * (SRC.modality_width * RANK + RANK * TGT.modality_width) + TGT.width


def test_tensors_of_other_shapes_are_refused():
    with pytest.raises(MapperFormatError, match="expected"):
        LowRankMapper(random_tensor(2, SRC.modality_width, RANK), random_tensor(2, RANK + 1, TGT.modality_width),
                      random_tensor(2, TGT.modality_width), SELECTED, hand_manifest("lowrank"))
    with pytest.raises(MapperFormatError, match=r"lacks tensors \['projection'\]"):
        LowRankMapper.from_tensors({"weight": torch.zeros(1), "bias": torch.zeros(1), "selected": SELECTED},
                                   hand_manifest("lowrank"))


def test_to_and_a_save_load_round_trip_keep_the_map(tmp_path):
    mapper = _mapper(FitConfig(storage_dtype="bfloat16"))
    x = random_tensor(5, SRC.width, seed=5)
    loaded = Mapper.load(mapper.save(tmp_path / "m"))
    assert type(loaded) is LowRankMapper and loaded.projection.dtype == torch.float32
    assert torch.equal(loaded.map_feature_rows(x), mapper.stored().map_feature_rows(x))
    double = _mapper().to(dtype=torch.float64)
    assert double.dtype == double.projection.dtype == double.bias.dtype == torch.float64
    assert torch.allclose(double.map_feature_rows(x), _mapper().map_feature_rows(x), atol=1e-5)
    with pytest.raises(ConfigError, match="not refined end to end"):
        double.map_tensors()
