import json

import pytest
import torch

from kvhandoff import FitConfig, Mapper, fit_mapper, prefill
from kvhandoff.errors import ConfigError
from kvhandoff.fit.compact import head_groups
from kvhandoff.fit.pipeline import mapper_from_statistics
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.blocks import BlockMapper
from kvhandoff.mapper.lowrank import LowRankMapper
from kvhandoff.model.capture import FeatureLayout

from conftest import exactly_related, random_batches, tiny_model, with_duplicated_kv_heads

#: fitted as exactly as float64 statistics of float32 captures allow
EXACT = {"ridge_lambda": 1e-10, "token_stride": 1}
SRC, TGT = FeatureLayout(3, 2, 8), FeatureLayout(4, 2, 16)


def _rows(src: FeatureLayout, rows: int = 1500, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, src.width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 3


def _head_aligned_rows(src: FeatureLayout, tgt: FeatureLayout, cross: bool = False):
    """Rows whose target KV head h (of every layer, K and V) is an exact linear function of source KV head h of
    every source layer (cross: of the other head)."""
    x = _rows(src)
    grid = x.view(-1, 2, src.num_layers, src.num_kv_heads, src.head_dim)
    gen = torch.Generator().manual_seed(1)
    y = torch.empty(x.shape[0], 2, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim, dtype=torch.float64)
    for m in range(2):
        for t in range(tgt.num_layers):
            for h in range(tgt.num_kv_heads):
                read = grid[:, m, :, (1 - h) if cross else h].reshape(x.shape[0], -1)
                y[:, m, t, h] = read @ torch.randn(read.shape[1], tgt.head_dim, generator=gen, dtype=torch.float64)
    return x, y.reshape(x.shape[0], -1) + 1


def _fit(x, y, config: FitConfig, src=SRC, tgt=TGT) -> Mapper:
    stats = CalibrationStats.from_rows(src, tgt, x, y, kv_cross=config.joint_inputs)
    return mapper_from_statistics(stats, config, {}, {})


def _close(mapper: Mapper, x, y, tolerance: float = 1e-3) -> bool:
    error = (mapper.map_feature_rows(x.float()).double() - y).pow(2).mean()
    return bool(error / y.var(0).mean() < tolerance)


def test_head_aligned_maps_fit_a_head_aligned_relation_exactly_and_have_the_computed_size():
    x, y = _head_aligned_rows(SRC, TGT)
    mapper = _fit(x, y, FitConfig(heads="aligned", ridge_lambda=1e-10))
    assert isinstance(mapper, BlockMapper) and mapper.manifest.method == "blocks"
    assert mapper.manifest["fit_metrics"]["r2_k_mean"] > 0.9999 and mapper.manifest["fit_metrics"]["r2_v_mean"] > 0.9999
    assert _close(mapper, x, y, 1e-6)
    # per (K|V, target layer, target head): all source layers' head h (3 × 8 inputs) → 16 outputs, plus the bias
    blocks = 2 * TGT.num_layers * TGT.num_kv_heads
    assert mapper.num_parameters() == blocks * (SRC.num_layers * SRC.head_dim * TGT.head_dim + TGT.head_dim)
    assert mapper.flops_per_token() == blocks * (2 * SRC.num_layers * SRC.head_dim * TGT.head_dim + TGT.head_dim)
    full = _fit(x, y, FitConfig(ridge_lambda=1e-10))
    assert mapper.num_parameters() < full.num_parameters() / 1.9


def test_head_aligned_maps_cannot_fit_a_relation_across_heads():
    x, y = _head_aligned_rows(SRC, TGT, cross=True)
    assert _fit(x, y, FitConfig(heads="aligned", ridge_lambda=1e-10)).manifest["fit_metrics"]["r2_k_mean"] < 0.2
    assert _fit(x, y, FitConfig(ridge_lambda=1e-10)).manifest["fit_metrics"]["r2_k_mean"] > 0.9999


def test_head_groups_when_counts_divide_and_an_error_when_they_do_not():
    assert head_groups(2, 2, True) == [[0], [1]]
    assert head_groups(4, 2, True) == [[0, 1], [2, 3]]
    assert head_groups(2, 4, True) == [[0], [0], [1], [1]]
    assert head_groups(3, 2, False) == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ConfigError, match="divide one another"):
        head_groups(3, 2, True)


@pytest.mark.parametrize("direction", ["more_kv_heads", "fewer_kv_heads"])
def test_grouped_heads_hand_off_an_exact_pair_of_different_kv_head_counts(direction):
    """Duplicated KV heads: target head h is a copy of source head h // 2 (or, the other way, source head 2h):
    the grouped head-aligned map expresses it exactly, and the mapped cache is the target's own."""
    base = tiny_model("qwen2", layers=3)
    source, target = (base, with_duplicated_kv_heads(base))
    if direction == "fewer_kv_heads":
        source, target = target, source
    mapper = fit_mapper(source, target, random_batches(), FitConfig(heads="aligned", **EXACT), progress=False)
    assert isinstance(mapper, BlockMapper)
    assert min(mapper.manifest["fit_metrics"]["r2_per_head"]["K"][0]) > 0.9999
    ids = torch.randint(0, 128, (1, 30))
    mapped = mapper.transfer(prefill(source, ids)[0])
    own, _ = prefill(target, ids)
    for got, want in zip(mapped.layers, own.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-3) and torch.allclose(got.values, want.values, atol=1e-3)


def test_k_per_target_layer_takes_one_source_layer_for_a_layer_by_layer_pair():
    source = tiny_model("qwen2", layers=3)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(), FitConfig(k_tolerance=1e-4, **EXACT), progress=False)
    record = mapper.manifest["fit_metrics"]["compact"]
    assert record["k_per_target_layer"] == [1, 1, 1]
    assert mapper.manifest.source_layers_per_target_layer is None  # every layer reads one: not ragged
    assert [list(row) for row in mapper.manifest.selected_layers] == [[0], [1], [2]]
    assert mapper.manifest["fit_metrics"]["r2_v_mean"] > 0.9999
    width = 2 * 16  # KV heads × head dim, both models
    assert mapper.num_parameters() == 2 * 3 * (width * width + width)


def test_k_per_target_layer_reads_more_layers_where_the_relation_needs_them(tmp_path):
    """Target layer 0 reads source layers 0 and 2, the others one layer each: k = 2, 1, 1 (ragged, recorded)."""
    x = _rows(SRC)
    grid = x.view(-1, 2, SRC.num_layers, SRC.layer_width)
    gen = torch.Generator().manual_seed(2)
    reads = [[0, 2], [1], [2], [0]]
    blocks = []
    for m in range(2):
        for layers in reads:
            read = grid[:, m, layers].reshape(x.shape[0], -1)
            blocks.append(read @ torch.randn(read.shape[1], TGT.layer_width, generator=gen, dtype=torch.float64))
    y = torch.cat(blocks, 1)
    mapper = _fit(x, y, FitConfig(k_tolerance=1e-3, ridge_lambda=1e-10))
    assert mapper.manifest["fit_metrics"]["compact"]["k_per_target_layer"] == [2, 1, 1, 1]
    assert [sorted(r) for r in mapper.manifest.source_layers_per_target_layer] == [[0, 2], [1], [2], [0]]
    assert _close(mapper, x, y, 1e-6)
    inputs = sum(len(r) for r in reads) * SRC.layer_width
    assert mapper.num_parameters() == 2 * (inputs * TGT.layer_width + TGT.num_layers * TGT.layer_width)
    loaded = Mapper.load(mapper.save(tmp_path / "m"))
    assert torch.equal(loaded.map_feature_rows(x[:9].float()), mapper.map_feature_rows(x[:9].float()))


def _low_rank_rows(rank: int):
    """Rows whose target K (V) of every layer reads one rank-`rank` projection of all source layers' K (V)."""
    x = _rows(SRC)
    gen = torch.Generator().manual_seed(3)
    parts = []
    for m in range(2):
        xm = x[:, m * SRC.modality_width : (m + 1) * SRC.modality_width]
        down = torch.randn(SRC.modality_width, rank, generator=gen, dtype=torch.float64)
        parts.append(xm @ down @ torch.randn(rank, TGT.modality_width, generator=gen, dtype=torch.float64))
    return x, torch.cat(parts, 1)


def test_low_rank_fits_a_rank_r_relation_exactly_and_a_lower_rank_does_not():
    x, y = _low_rank_rows(5)
    mapper = _fit(x, y, FitConfig(rank=5, ridge_lambda=1e-10))
    assert isinstance(mapper, LowRankMapper) and mapper.rank == 5
    assert _close(mapper, x, y, 1e-6)
    assert mapper.manifest["fit_metrics"]["r2_k_mean"] > 0.9999
    assert mapper.num_parameters() == 2 * (SRC.modality_width * 5 + 5 * TGT.modality_width + TGT.modality_width)
    assert mapper.flops_per_token() == 2 * 2 * (SRC.modality_width * 5 + 5 * TGT.modality_width) + TGT.width
    assert _fit(x, y, FitConfig(rank=4, ridge_lambda=1e-10)).manifest["fit_metrics"]["r2_k_mean"] < 0.999


@pytest.mark.parametrize("projection", ["rrr", "pca"])
def test_low_rank_at_full_rank_is_the_full_ridge_map(projection):
    x, y = _head_aligned_rows(SRC, TGT, cross=True)
    y = y + 0.5 * torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    full = _fit(x, y, FitConfig())
    low = _fit(x, y, FitConfig(rank=SRC.modality_width, projection=projection))
    assert torch.allclose(low.map_feature_rows(x[:50].float()), full.map_feature_rows(x[:50].float()), atol=1e-3)
    assert low.manifest["fit_metrics"]["r2_v_mean"] == pytest.approx(full.manifest["fit_metrics"]["r2_v_mean"])


def test_reduced_rank_beats_principal_components_at_equal_rank():
    """PCA keeps the source's high-variance directions whatever the target reads; reduced-rank ridge keeps the
    directions the target needs."""
    x, y = _low_rank_rows(3)
    x[:, :4] *= 30  # loud source directions the target does not read
    rrr = _fit(x, y, FitConfig(rank=3, ridge_lambda=1e-8)).manifest["fit_metrics"]["r2_k_mean"]
    pca = _fit(x, y, FitConfig(rank=3, ridge_lambda=1e-8, projection="pca")).manifest["fit_metrics"]["r2_k_mean"]
    assert rrr > 0.9999 > pca


@pytest.mark.parametrize("config", [
    FitConfig(heads="aligned"), FitConfig(k_tolerance=0.01, top_k=2), FitConfig(rank=4),
    FitConfig(rank=4, projection="pca", storage_dtype="float16"), FitConfig(storage_dtype="bfloat16"),
    FitConfig(heads="aligned", k_tolerance=0.05, source_inputs="kv", storage_dtype="float16"),
])
def test_manifests_round_trip_and_the_saved_mapper_is_the_fitted_one(config, tmp_path):
    x, y = _head_aligned_rows(SRC, TGT)
    mapper = _fit(x, y, config)
    folder = mapper.save(tmp_path / "m")
    loaded = Mapper.load(folder)
    assert type(loaded) is type(mapper) and loaded.manifest == mapper.manifest
    assert loaded.manifest.config == config
    rows = x[:20].float()
    assert torch.equal(loaded.map_feature_rows(rows), mapper.map_feature_rows(rows))
    storage = json.loads((folder / "manifest.json").read_text())["storage"]
    assert storage["parameters"] == mapper.num_parameters() == loaded.num_parameters()
    assert storage["weight_dtype"] == config.storage_dtype
    assert storage["file_bytes"] == (folder / "mapper.safetensors").stat().st_size


def test_half_storage_halves_the_weights_and_stays_close():
    x, y = _low_rank_rows(6)
    full = _fit(x, y, FitConfig(rank=6))
    for dtype in ("float16", "bfloat16"):
        half = _fit(x, y, FitConfig(rank=6, storage_dtype=dtype))
        assert half.dtype == torch.float32  # stored in half, computed in float32
        assert torch.equal(half.projection, half.projection.to(getattr(torch, dtype)).float())
        rows = x[:100].float()
        error = (half.map_feature_rows(rows) - full.map_feature_rows(rows)).pow(2).mean() / y.var(0).mean()
        assert 0 < float(error) < 1e-4


@pytest.mark.parametrize(("settings", "message"), [
    ({"rank": 8, "top_k": 4}, "needs top_k='all'"),
    ({"rank": 8, "heads": "aligned"}, "needs top_k='all'"),
    ({"rank": -1}, "rank must be"),
    ({"heads": "some"}, "heads must be one of"),
    ({"k_tolerance": 1.5}, "R² margin"),
    ({"k_tolerance": 0.1, "top_k": "heldout", "ridge_lambda": "heldout"}, "use one of them"),
    ({"projection": "svd", "rank": 4}, "projection must be"),
    ({"storage_dtype": "int8"}, "storage_dtype must be"),
    ({"heads": "aligned", "ridge_lambda": "gcv"}, "one fixed ridge λ"),
])
def test_compact_settings_are_validated(settings, message):
    with pytest.raises(ConfigError, match=message):
        FitConfig(**settings)


def test_a_rank_past_the_widths_and_unaligned_head_counts_are_refused():
    x, y = _low_rank_rows(2)
    with pytest.raises(ConfigError, match="exceeds"):
        _fit(x, y, FitConfig(rank=SRC.modality_width + 1, projection="pca"))
    src = FeatureLayout(3, 3, 8)
    with pytest.raises(ConfigError, match="divide one another"):
        _fit(_rows(src), y, FitConfig(heads="aligned"), src=src)


def test_default_settings_leave_manifests_and_cache_keys_as_they_were():
    config = FitConfig()
    assert not config.compact
    for name in ("heads", "k_tolerance", "rank", "projection", "storage_dtype"):
        assert name not in config.to_dict() and name not in config.key_dict()
    assert FitConfig(rank=8).key_dict()["rank"] == 8
