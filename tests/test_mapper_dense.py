import torch

from kvhandoff import FitConfig, Mapper, fit_mapper, prefill
from kvhandoff.mapper.dense import DenseMapper

from conftest import random_batches, tiny_model


def test_dense_and_gathered_paths_agree():
    source, target = tiny_model("llama", layers=3), tiny_model("llama", layers=2, seed=2)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k="all"), progress=False)
    assert mapper._dense
    gathered = DenseMapper(mapper.weight, mapper.bias, mapper.selected, mapper.manifest)
    gathered._dense = False
    gathered._flat_weight = gathered.weight.reshape(-1, *gathered.weight.shape[2:])
    cache, _ = prefill(source, torch.randint(0, 128, (1, 9)))
    a, b = mapper.transfer(cache), gathered.transfer(cache)
    assert torch.allclose(a.layers[1].values, b.layers[1].values, atol=1e-5)


def test_joint_input_mapper_dense_and_gathered_paths_agree_and_survive_a_reload(tmp_path):
    source, target = tiny_model("qwen2", layers=3), tiny_model("qwen2", layers=2, head_dim=32, seed=2)
    dense = fit_mapper(source, target, random_batches(4), FitConfig(source_inputs="kv"), progress=False)
    assert dense._dense and dense.joint_inputs and dense.weight.shape[2] == 2 * 3 * 2 * 16
    gathered = DenseMapper(dense.weight, dense.bias, dense.selected, dense.manifest)
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
    k_only = DenseMapper(dense.weight.clone(), dense.bias, dense.selected, dense.manifest)
    k_only.weight[:, :, dense.weight.shape[2] // 2:] = 0
    k_only = DenseMapper(k_only.weight, dense.bias, dense.selected, dense.manifest)
    assert not torch.allclose(k_only.transfer(cache).layers[0].keys, a.layers[0].keys)
