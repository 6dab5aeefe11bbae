import pytest
import torch

from kvhandoff import FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import collect_statistics
from kvhandoff.model.geometry import model_fingerprint
from kvhandoff_lab.tuning import HandoffDivergence, sweep

from conftest import exactly_related, random_batches, tiny_model


@pytest.fixture(scope="module")
def setup():
    source = tiny_model("qwen2", layers=3)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(8), progress=False)
    docs = [torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return source, target, stats, HandoffDivergence(source, target, docs, prefix_len=40, continuation_len=16)


def test_sweep_ranks_exact_fit_first_with_zero_divergence(setup):
    source, target, stats, divergence = setup
    rows = sweep(stats, [FitConfig(ridge_lambda=10.0), FitConfig(ridge_lambda=1e-6)], divergence,
                 model_fingerprint(source), model_fingerprint(target), (512, 512), progress=False)
    assert [row["ridge_lambda"] for row in rows] == [1e-6, 10.0]
    best, worst = rows
    assert best["mean_kl"] < 1e-7 and best["top1_agreement"] == 1.0 and abs(best["ppl_ratio"] - 1) < 1e-5
    assert worst["mean_kl"] > best["mean_kl"] and worst["ppl_ratio"] > 1
    assert best["tokens"] == 32 and best["documents"] == 2


def test_sweep_scores_each_exact_prefix(setup):
    source, target, stats, divergence = setup
    rows = sweep(stats, [FitConfig(ridge_lambda=10.0)], divergence, model_fingerprint(source),
                 model_fingerprint(target), (512, 512), exact_prefixes=(0, 40), progress=False)
    by_prefix = {row["exact_prefix"]: row for row in rows}
    assert by_prefix[40]["mean_kl"] < 1e-7 and by_prefix[0]["mean_kl"] > 1e-4  # whole prefix recomputed: own cache


def test_short_documents_are_refused(setup):
    source, target, _, _ = setup
    with pytest.raises(ConfigError, match="no dev document"):
        HandoffDivergence(source, target, [torch.arange(10)], prefix_len=40, continuation_len=16)


def test_source_reference_is_zero_for_a_source_equal_to_the_target():
    model = tiny_model("llama", layers=2)
    docs = [torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(3))]
    reference = HandoffDivergence(model, model, docs, prefix_len=20, continuation_len=8).source_reference()
    assert reference["mean_kl"] < 1e-6 and reference["top1_agreement"] == 1.0


def test_target_tail_covering_the_prefix_gives_zero_divergence():
    from kvhandoff.fit.pipeline import mapper_from_statistics

    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=2, seed=9)
    stats = collect_statistics(source, target, random_batches(2), progress=False)
    docs = [torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    divergence = HandoffDivergence(source, target, docs, prefix_len=40, continuation_len=16)
    mapper = mapper_from_statistics(stats, FitConfig(top_k=1), model_fingerprint(source), model_fingerprint(target),
                                    max_position_embeddings=(512, 512))
    plain = divergence.score(mapper, exact_prefix=0)
    whole = divergence.score(mapper, exact_prefix=1, target_tail=38)  # only token 0 mapped, and it is patched
    assert plain["mean_kl"] > 1e-3 and whole["mean_kl"] < 1e-6 and whole["tokens"] == plain["tokens"]
    partial = divergence.score(mapper, exact_prefix=0, target_tail=8)
    assert whole["mean_kl"] < partial["mean_kl"] < plain["mean_kl"]
    with pytest.raises(ConfigError, match="target_tail"):
        divergence.score(mapper, target_tail=39)


def test_examples_of_any_length_match_the_document_form(setup):
    """A dev set of (prefix, continuation) pairs of different lengths, e.g. few-shot prompts and their answer."""
    from kvhandoff.fit.pipeline import mapper_from_statistics

    source, target, stats, by_documents = setup
    docs = [torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    same = HandoffDivergence.from_examples(source, target, [(d[:40].tolist(), d[40:56].tolist()) for d in docs])
    ragged = HandoffDivergence.from_examples(source, target, [(docs[0][:30].tolist(), docs[0][30:31].tolist()),
                                                              (docs[1][:45].tolist(), docs[1][45:48].tolist())])
    mapper = mapper_from_statistics(stats, FitConfig(ridge_lambda=10.0), model_fingerprint(source),
                                    model_fingerprint(target), max_position_embeddings=(512, 512))
    assert same.score(mapper) == by_documents.score(mapper)
    scored = ragged.score(mapper)
    assert scored["tokens"] == 4 and scored["documents"] == 2 and scored["mean_kl"] > 0
    with pytest.raises(ConfigError, match="target_tail"):
        ragged.score(mapper, target_tail=29)  # the shortest prefix has 30 tokens
    with pytest.raises(ConfigError, match="dev examples"):
        HandoffDivergence.from_examples(source, target, [([1, 2, 3], [])])


def test_config_grid_varies_k_fastest():
    from kvhandoff_lab.tuning import config_grid

    grid = config_grid([1, "all"], [0.01, 0.1], ["own", "kv"], token_stride=2)
    assert len(grid) == 8 and all(c.token_stride == 2 for c in grid)
    assert [(c.top_k, c.ridge_lambda, c.source_inputs) for c in grid[:3]] == [(1, 0.01, "own"), ("all", 0.01, "own"),
                                                                              (1, 0.1, "own")]
    with pytest.raises(ConfigError):
        config_grid([0], [0.01])
