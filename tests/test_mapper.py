import copy
import json
from pathlib import Path

import pytest
import torch

from kvhandoff import FitConfig, Mapper, fit_mapper, prefill
from kvhandoff.errors import (
    ConfigError,
    ContextTooLongError,
    MapperFormatError,
    MapperMismatchError,
    NonFiniteError,
)
from kvhandoff.files import backup_of
from kvhandoff.mapper.dense import DenseMapper

from conftest import exactly_related, random_batches, tiny_model


@pytest.fixture(scope="module")
def fitted():
    source = tiny_model("qwen2", layers=3)
    target = tiny_model("qwen2", layers=4, head_dim=32, seed=7)
    mapper = fit_mapper(source, target, random_batches(3), FitConfig(top_k=2), progress=False)
    return source, target, mapper


def test_save_load_transfer_identical(fitted, tmp_path):
    source, target, mapper = fitted
    mapper.save(tmp_path / "m")
    loaded = Mapper.load(tmp_path / "m", source_model=source, target_model=target)
    cache, _ = prefill(source, torch.randint(0, 128, (2, 25)))
    a, b = mapper.transfer(cache), loaded.transfer(cache)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["config"]["top_k"] == 2 and manifest["selected_layers"] == mapper.selected.tolist()
    assert len(manifest["fit_metrics"]["r2_k_per_target_layer"]) == 4
    assert manifest["source_fingerprint"]["geometry"]["num_layers"] == 3


def test_transfer_with_position_ids_offsets_rope():
    source = tiny_model("qwen2", layers=2)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(8), FitConfig(ridge_lambda=1e-6), progress=False)
    ids = torch.randint(0, 128, (1, 12))
    positions = torch.arange(5, 17)[None]
    out = source(input_ids=ids, position_ids=positions, use_cache=True)
    own = target(input_ids=ids, position_ids=positions, use_cache=True).cache
    mapped = mapper.transfer(out.cache, position_ids=positions)
    assert torch.allclose(mapped.layers[0].keys, own.layers[0].keys, atol=1e-4, rtol=0)


def test_wrong_pair_is_refused(fitted, tmp_path):
    _, target, mapper = fitted
    mapper.save(tmp_path / "m")
    with pytest.raises(MapperMismatchError, match="different source model"):
        Mapper.load(tmp_path / "m", source_model=target)
    with pytest.raises(MapperMismatchError, match="different target model"):
        Mapper.load(tmp_path / "m", target_model=tiny_model("qwen2", layers=4, head_dim=32, seed=99))
    cache, _ = prefill(target, torch.randint(0, 128, (1, 5)))
    with pytest.raises(MapperMismatchError, match="fitted for 3 × 2 × 16"):
        mapper.transfer(cache)


def test_truncated_edited_and_newer_files_are_refused(fitted, tmp_path):
    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    tensors = path / "mapper.safetensors"
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(MapperFormatError, match="truncated or was edited"):
        Mapper.load(path)
    tensors.write_bytes(data[:-4] + b"\x00\x00\x80\x7f")
    with pytest.raises(MapperFormatError, match="truncated or was edited"):
        Mapper.load(path)
    tensors.write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(MapperFormatError, match="version 99"):
        Mapper.load(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(MapperFormatError, match="not valid JSON"):
        Mapper.load(path)
    with pytest.raises(MapperFormatError, match="not a saved mapper"):
        Mapper.load(tmp_path / "nowhere")


def test_resave_replaces_atomically_and_keeps_no_temp(fitted, tmp_path):
    _, _, mapper = fitted
    mapper.save(tmp_path / "m")
    mapper.save(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert Mapper.load(tmp_path / "m").num_parameters() == mapper.num_parameters()


def test_mapper_files_hold_no_pickle(fitted, tmp_path):
    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "mapper.safetensors"]
    assert b"\x80\x04" not in (path / "mapper.safetensors").read_bytes()[:8]


def _rewrite_manifest(path, edit):
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["config"].update(exact_prefix=m["config"]["exact_prefix"] + 1),
        lambda m: m["config"].update(source_inputs="kv"),
        lambda m: m.update(source_max_position_embeddings=2 * m["source_max_position_embeddings"]),
        lambda m: m.update(target_max_position_embeddings=m["target_max_position_embeddings"] - 1),
        lambda m: m["target_fingerprint"]["geometry"]["rope"].update(
            parameters=json.dumps({"rope_type": "default", "rope_theta": 500.0})),
        lambda m: m["source_fingerprint"]["geometry"]["rope"].update(rope_theta=1.0),
        lambda m: m["calibration"].update(tokens_in_statistics=1),
        lambda m: m.update(tensor_sha256="0" * 64),
    ],
    ids=["exact_prefix", "source_inputs", "source_max_pos", "target_max_pos", "target_rope", "source_rope",
         "calibration", "tensor_sha256"],
)
def test_edited_manifest_fields_are_refused(fitted, tmp_path, edit):
    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    Mapper.load(path)  # the untouched copy loads
    _rewrite_manifest(path, edit)
    with pytest.raises(MapperFormatError, match="does not match its checksum"):
        Mapper.load(path)


def test_mapper_of_an_older_format_is_refused_with_re_fit(fitted, tmp_path):
    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    for version in (1, 2, 3):
        _rewrite_manifest(path, lambda m, v=version: m.update(format_version=v))
        with pytest.raises(MapperFormatError, match=f"version {version} was written by an older kvhandoff.*re-fit"):
            Mapper.load(path)


def test_transfer_refuses_a_cache_with_nan_or_inf_naming_the_layer(fitted):
    source, _, mapper = fitted
    cache, _ = prefill(source, torch.randint(0, 128, (1, 9)))
    for layer in cache.layers:  # prefill's tensors are inference tensors: edit copies
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    cache.layers[2].keys[0, 1, 4, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layer\(s\) \[2\]"):
        mapper.transfer(cache)
    cache.layers[2].keys[0, 1, 4, 0] = 0.0
    cache.layers[0].values[0, 0, 0, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"layer\(s\) \[0\]"):
        mapper.transfer(cache)


def test_a_nan_mapper_is_never_saved(fitted, tmp_path):
    _, _, mapper = fitted
    weight = mapper.weight.clone()
    weight[1, 2, 0, 0] = float("nan")
    broken = DenseMapper(weight, mapper.bias, mapper.selected, mapper.manifest)
    with pytest.raises(NonFiniteError, match=r"target layer\(s\) \[2\]"):
        broken.save(tmp_path / "m")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_transfer_refuses_positions_past_the_target_window():
    source = tiny_model("qwen2", layers=2, max_position_embeddings=64)
    target = tiny_model("qwen2", layers=3, head_dim=32, seed=7, max_position_embeddings=64)
    mapper = fit_mapper(source, target, random_batches(2, tokens=32), FitConfig(), progress=False)
    assert mapper.manifest.target_max_position_embeddings == 64
    cache, _ = prefill(source, torch.randint(0, 128, (1, 20)))
    mapper.transfer(cache, position_ids=torch.arange(44, 64))  # the last positions of the window: fine
    with pytest.raises(ContextTooLongError, match="65 tokens exceeds the target's max_position_embeddings"):
        mapper.transfer(cache, position_ids=torch.arange(45, 65))
    long_cache, _ = prefill(source, torch.randint(0, 128, (1, 65)))
    with pytest.raises(ContextTooLongError, match="65 tokens"):
        mapper.transfer(long_cache)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_caches_and_mappers_stay_close_to_the_float32_path(fitted, dtype, tolerance):
    """A cache from a half-precision source maps to the target's dtype; its keys and values stay within
    `tolerance` (relative Frobenius error) of the float32 path's, for a float32 mapper and for one cast by `to`."""
    source, _, mapper = fitted
    ids = torch.randint(0, 128, (2, 30))
    reference = mapper.transfer(prefill(source, ids)[0])
    half_cache, _ = prefill(copy.deepcopy(source).to(dtype), ids)
    assert half_cache.layers[0].keys.dtype == dtype
    half_mapper = copy.deepcopy(mapper).to(dtype=dtype)
    assert half_mapper.dtype == dtype and half_mapper.weight.dtype == dtype and mapper.dtype == torch.float32
    for candidate in (mapper, half_mapper):
        mapped = candidate.transfer(half_cache, dtype=dtype)
        for got, want in zip(mapped.layers, reference.layers, strict=True):
            assert got.keys.dtype == got.values.dtype == dtype
            assert _relative_error(got.keys, want.keys) < tolerance
            assert _relative_error(got.values, want.values) < tolerance


def test_to_moves_and_casts_the_map_and_refuses_a_non_float_dtype(fitted):
    source, _, mapper = fitted
    cache, _ = prefill(source, torch.randint(0, 128, (1, 11)))
    reference = mapper.transfer(cache)
    double = copy.deepcopy(mapper).to("cpu", torch.float64)
    assert double.device == torch.device("cpu") and double.weight.dtype == double.bias.dtype == torch.float64
    mapped = double.transfer(cache)
    assert mapped.layers[0].keys.dtype == torch.float32  # the cache's dtype, as before
    for got, want in zip(mapped.layers, reference.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)
    with pytest.raises(ConfigError, match="floating dtype"):
        copy.deepcopy(mapper).to(dtype=torch.int64)


def test_an_exception_while_saving_leaves_the_old_mapper_loadable_and_unchanged(fitted, tmp_path, monkeypatch):
    import kvhandoff.mapper.storage as storage_module

    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def failing_save_file(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(storage_module, "save_file", failing_save_file)
    other = DenseMapper(mapper.weight * 2, mapper.bias, mapper.selected, mapper.manifest)
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging folder left behind
    assert torch.equal(Mapper.load(path).weight, mapper.weight)


def test_a_crash_between_the_two_renames_loads_the_good_copy(fitted, tmp_path):
    _, _, mapper = fitted
    path = mapper.save(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    path.rename(backup_of(path))  # the old copy moved aside, the new one never arrived
    loaded = Mapper.load(path)
    assert torch.equal(loaded.weight, mapper.weight)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before and not backup_of(path).exists()


def test_models_are_fingerprinted_once_per_mapper(fitted, monkeypatch):
    import kvhandoff.mapper.pairing as mapper_module

    source, target, mapper = fitted
    fresh = DenseMapper(mapper.weight, mapper.bias, mapper.selected, mapper.manifest)
    calls = []
    real = mapper_module.model_fingerprint
    monkeypatch.setattr(mapper_module, "model_fingerprint",
                        lambda model, tok=None: calls.append(model) or real(model, tok))
    for _ in range(3):
        fresh.check_models(source, target)
    assert calls == [source, target]
    with pytest.raises(MapperMismatchError, match="different target model"):
        fresh.check_models(target_model=source)
    with pytest.raises(MapperMismatchError, match="different target model"):
        fresh.check_models(target_model=source)  # a refused model is not remembered as verified
    assert calls == [source, target, source, source]


def test_a_lazy_load_reads_the_tensors_at_first_use_and_then_is_the_eager_mapper(fitted, tmp_path):
    source, target, mapper = fitted
    folder = mapper.save(tmp_path / "m")
    lazy = Mapper.load(folder, source_model=source, target_model=target, lazy=True)
    assert lazy.pending and lazy.nbytes() == 0
    assert lazy.num_parameters() == mapper.num_parameters() == lazy.manifest.storage["parameters"]
    assert lazy.manifest.storage["file_bytes"] == (folder / "mapper.safetensors").stat().st_size
    cache, _ = prefill(source, torch.randint(0, 128, (1, 12)))
    got, want = lazy.transfer(cache), mapper.transfer(cache)
    assert not lazy.pending and lazy.nbytes() == mapper.nbytes()
    for a, b in zip(got.layers, want.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_lazy_load_checks_the_file_size_at_once_and_its_checksum_at_first_use(fitted, tmp_path):
    _, _, mapper = fitted
    folder = mapper.save(tmp_path / "m")
    tensors = folder / "mapper.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0xFF  # same size, other bytes: only the checksum can tell
    tensors.write_bytes(bytes(data))
    lazy = Mapper.load(folder, lazy=True)
    for _ in range(2):  # and again at the next use
        with pytest.raises(MapperFormatError, match="does not match the checksum"):
            lazy.map_feature_rows(torch.zeros(1, mapper.source.width))
    tensors.write_bytes(bytes(data[:-9]))
    with pytest.raises(MapperFormatError, match="truncated or was edited"):
        Mapper.load(folder, lazy=True)


def test_every_method_loads_with_the_frame_alone_and_an_unknown_one_is_refused():
    """The variants register themselves within `kvhandoff.mapper`: no fitting code is needed to load any mapper."""
    import subprocess
    import sys

    from kvhandoff.mapper.mapper import mapper_class

    code = ("import sys; from kvhandoff.mapper.mapper import MAPPER_METHODS; "
            "print(sorted(MAPPER_METHODS), 'kvhandoff.fit.mlp' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.split() == ["['blocks',", "'lowrank',", "'mlp',", "'ridge',", "'synthetic']", "False"]
    assert mapper_class("ridge") is DenseMapper
    with pytest.raises(MapperFormatError, match="unknown method 'quantum'"):
        mapper_class("quantum")


def test_selected_layers_that_differ_from_the_manifest_are_refused(fitted):
    _, _, mapper = fitted
    with pytest.raises(MapperFormatError, match="differ from its manifest's selected_layers"):
        DenseMapper(mapper.weight, mapper.bias, mapper.selected.flip(1), mapper.manifest)
