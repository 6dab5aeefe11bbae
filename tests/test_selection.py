import pytest
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import collect_statistics
from kvhandoff.fit.selection import layer_r2_matrix, parse_ks, resolve_k, select_layers

from conftest import exactly_related, random_batches, tiny_model


def test_related_pair_selects_the_diagonal():
    source = tiny_model("llama", layers=4)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(4), progress=False)
    r2 = layer_r2_matrix(stats, 1e-6)
    assert r2.shape == (2, 4, 4)
    assert torch.equal(select_layers(r2, 1)[:, 0], torch.arange(4))
    assert (r2.diagonal(dim1=1, dim2=2) > 0.999).all()
    assert select_layers(r2, "all").shape == (4, 4)


def test_select_layers_orders_and_clamps():
    r2 = torch.tensor([[[0.1, 0.9, 0.5]]]).expand(2, 1, 3)
    assert select_layers(r2, 2).tolist() == [[1, 2]]
    assert select_layers(r2, 10).tolist() == [[0, 1, 2]]
    assert resolve_k("all", 24) == 24
    with pytest.raises(ConfigError, match="top_k"):
        resolve_k(0, 3)


def test_parse_ks_accepts_integers_and_all_and_names_the_option():
    assert parse_ks(" 1, 4 ,all") == [1, 4, "all"]
    for bad in ("0", "1,x", "-2", ","):
        with pytest.raises(ConfigError, match="--sweep-ks"):
            parse_ks(bad, "--sweep-ks")


def test_k_values_go_through_the_one_validator():
    assert parse_ks("1, 4,all") == [1, 4, "all"] and resolve_k("all", 5) == 5 and resolve_k(9, 5) == 5
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ConfigError, match="--ks"):
            parse_ks(bad)
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="top_k must be a positive integer"):
            resolve_k(bad, 5)
