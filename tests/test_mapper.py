import json

import pytest
import torch

from kvhandoff import FitConfig, Mapper, fit_mapper, prefill
from kvhandoff.errors import MapperFormatError, MapperMismatchError

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


def test_dense_and_gathered_paths_agree():
    source, target = tiny_model("llama", layers=3), tiny_model("llama", layers=2, seed=2)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k="all"), progress=False)
    assert mapper._dense
    gathered = Mapper(mapper.weight, mapper.bias, mapper.selected, mapper.manifest)
    gathered._dense = False
    gathered._flat_weight = gathered.weight.reshape(-1, *gathered.weight.shape[2:])
    cache, _ = prefill(source, torch.randint(0, 128, (1, 9)))
    a, b = mapper.transfer(cache), gathered.transfer(cache)
    assert torch.allclose(a.layers[1].values, b.layers[1].values, atol=1e-5)


def test_transfer_with_position_ids_offsets_rope():
    source = tiny_model("qwen2", layers=2)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(8), FitConfig(ridge_lambda=1e-6), progress=False)
    ids = torch.randint(0, 128, (1, 12))
    positions = torch.arange(5, 17)[None]
    out = source(input_ids=ids, position_ids=positions, use_cache=True)
    own = target(input_ids=ids, position_ids=positions, use_cache=True).cache
    mapped = mapper.transfer(out.cache, position_ids=positions)
    assert torch.allclose(mapped.layers[0].keys, own.layers[0].keys, atol=1e-3)


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


def test_joint_input_mapper_dense_and_gathered_paths_agree_and_survive_a_reload(tmp_path):
    source, target = tiny_model("qwen2", layers=3), tiny_model("qwen2", layers=2, head_dim=32, seed=2)
    dense = fit_mapper(source, target, random_batches(4), FitConfig(source_inputs="kv"), progress=False)
    assert dense._dense and dense.joint_inputs and dense.weight.shape[2] == 2 * 3 * 2 * 16
    gathered = Mapper(dense.weight, dense.bias, dense.selected, dense.manifest)
    gathered._dense = False
    gathered._flat_weight = gathered.weight.reshape(-1, *gathered.weight.shape[2:])
    cache, _ = prefill(source, torch.randint(0, 128, (2, 9)))
    a, b = dense.transfer(cache), gathered.transfer(cache)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)
    dense.save(tmp_path / "joint")
    loaded = Mapper.load(tmp_path / "joint", source_model=source, target_model=target)
    c = loaded.transfer(cache)
    assert loaded.joint_inputs and all(torch.equal(x.values, y.values) for x, y in zip(a.layers, c.layers, strict=True))
    # the values now depend on the source keys too: zeroing the V-block weights changes the mapped keys
    k_only = Mapper(dense.weight.clone(), dense.bias, dense.selected, dense.manifest)
    k_only.weight[:, :, dense.weight.shape[2] // 2:] = 0
    k_only = Mapper(k_only.weight, dense.bias, dense.selected, dense.manifest)
    assert not torch.allclose(k_only.transfer(cache).layers[0].keys, a.layers[0].keys)
