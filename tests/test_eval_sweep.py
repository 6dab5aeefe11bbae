"""Choosing k on the dev pool."""

from __future__ import annotations

import pytest
import torch

from _eval_support import IdentityMapper, NoisyMapper
from kvhandoff.config import TOP_K_CHOICES
from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import sweep as SW
from kvhandoff_lab.evaluation.runner import select_items

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

TOK = ByteTokenizer()
TASKS = ("arc_challenge", "winogrande")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0, **BYTE_MODEL)


def test_candidates_fit_the_source_model():
    assert SW.sweep_candidates(TOP_K_CHOICES, 2) == [1, "all"]  # 2 == all layers: the same mapper
    assert SW.sweep_candidates((1, 2, 4), 2) == [1, 2]
    assert SW.sweep_candidates((1, 1, 8, "all"), 24) == [1, 8, "all"]
    with pytest.raises(ConfigError):
        SW.sweep_candidates((0,), 4)
    with pytest.raises(ConfigError):
        SW.sweep_candidates((8,), 4)


def test_best_k_wins_and_only_dev_items_are_used(model):
    built: list = []

    def factory(k):
        built.append(k)
        return IdentityMapper() if k == 1 else NoisyMapper(scale=8.0, seed=3)

    out = SW.choose_k(model, model, TOK, candidates=(1, "all"), tasks=TASKS, limit=6, seed=0,
                      mapper_factory=factory)
    assert built == [1, "all"]
    assert out["scores"]["1"] == pytest.approx(sum(out["target"].values()) / 2)  # identity = target
    assert out["candidates"] == ["1", "all"] and set(out["per_task"]["all"]) == set(TASKS)
    expected = 1 if out["scores"]["1"] > out["scores"]["all"] else "all"
    assert out["best_k"] == expected
    assert out["items"] == {"arc_challenge": 6, "winogrande": 6}
    dev = {i.id for t in TASKS for i in select_items(t, 6, 0, "dev")}
    report = {i.id for t in TASKS for i in select_items(t, None, 0, "report")}
    assert not dev & report


def test_ties_go_to_the_larger_k(model):
    out = SW.choose_k(model, model, TOK, candidates=(1, 2), tasks=("winogrande",), limit=3,
                      mapper_factory=lambda k: IdentityMapper())
    assert out["scores"]["1"] == out["scores"]["2"] and out["best_k"] == 2
    out = SW.choose_k(model, model, TOK, candidates=(1, "all"), tasks=("winogrande",), limit=3,
                      mapper_factory=lambda k: IdentityMapper())
    assert out["best_k"] == "all"


def test_the_sweep_is_resumable(model, tmp_path):
    computed: list = []
    kwargs = dict(candidates=(1, 2), tasks=("winogrande",), limit=3, out_dir=tmp_path,
                  mapper_factory=lambda k: NoisyMapper(scale=0.1 * k), on_item=lambda *a: computed.append(a[1]))
    first = SW.choose_k(model, model, TOK, **kwargs)
    assert computed == ["target"] * 3 + ["transfer"] * 6
    computed.clear()
    assert SW.choose_k(model, model, TOK, **kwargs) == first and computed == []


def test_needs_statistics_or_a_factory_and_loglikelihood_tasks(model):
    with pytest.raises(ConfigError, match="statistics"):
        SW.choose_k(model, model, TOK, tasks=TASKS)
    with pytest.raises(ConfigError, match="loglikelihood"):
        SW.choose_k(model, model, TOK, tasks=("gsm8k",), mapper_factory=lambda k: IdentityMapper())


def test_mappers_from_real_statistics(model):
    from kvhandoff.config import FitConfig
    from kvhandoff.fit.pipeline import collect_statistics

    source = tiny_model("qwen2", seed=1, **BYTE_MODEL)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 48), generator=gen) for _ in range(3)]
    stats = collect_statistics(source, model, batches, FitConfig(token_stride=1), False)
    out = SW.choose_k(source, model, TOK, stats, tasks=("winogrande",), limit=2, base_config=FitConfig())
    assert out["candidates"] == ["1", "all"]
    assert out["best_k"] == (1 if out["scores"]["1"] > out["scores"]["all"] else "all")  # ties: the larger k
