"""Retention, floor-normalised retention, paired bootstrap, token F1 and exact match on hand-made numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import metrics as M


def test_retention_arithmetic():
    assert M.retention(0.6, 0.8) == pytest.approx(0.75)
    assert M.floor_normalised_retention(0.6, 0.8, 0.25) == pytest.approx((0.6 - 0.25) / (0.8 - 0.25))
    assert M.floor_normalised_retention(0.25, 0.8, 0.25) == 0.0  # transfer at chance keeps nothing
    assert math.isnan(M.retention(0.3, 0.0))
    assert math.isnan(M.floor_normalised_retention(0.3, 0.25, 0.25))


def test_summary_on_hand_made_items():
    target = [1, 1, 1, 1, 0, 1, 1, 1, 0, 1]  # 0.8
    transfer = [1, 0, 1, 1, 0, 1, 0, 1, 0, 1]  # 0.6
    source = [0, 0, 1, 0, 0, 1, 0, 1, 0, 1]  # 0.4
    chance = [0.25] * 10
    out = M.summarise_conditions({"target": target, "source": source, "transfer": transfer}, chance,
                                 n_resamples=500, seed=3)
    assert out["n"] == 10 and out["chance"] == 0.25
    assert out["accuracy"]["target"]["value"] == pytest.approx(0.8)
    assert out["accuracy"]["source"]["value"] == pytest.approx(0.4)
    assert out["retention"]["value"] == pytest.approx(0.75)
    assert out["floor_normalised_retention"]["value"] == pytest.approx(0.35 / 0.55)
    lo, hi = out["retention"]["ci"]
    assert lo <= 0.75 <= hi and hi <= 1.0 + 1e-12  # transfer never beats target on any item: ratio ≤ 1
    again = M.summarise_conditions({"target": target, "source": source, "transfer": transfer}, chance,
                                   n_resamples=500, seed=3)
    assert again == out  # seeded


def test_identical_conditions_give_a_degenerate_interval():
    scores = np.array([1, 0, 1, 1, 0, 1, 0, 1])
    out = M.summarise_conditions({"target": scores, "transfer": scores.copy()}, [0.5] * 8, n_resamples=200)
    assert out["retention"] == {"value": 1.0, "ci": [1.0, 1.0]}
    assert out["floor_normalised_retention"]["value"] == 1.0


def test_bootstrap_is_paired():
    # transfer = target on every item: a paired resample keeps the ratio at exactly 1, while
    # independent resamples of the two columns would not
    rng = np.random.default_rng(0)
    target = rng.integers(0, 2, 50).astype(float)
    lo, hi = M.paired_bootstrap({"target": target, "transfer": target, "chance": np.zeros(50)},
                                M._retention_stat, n_resamples=300, seed=1)
    assert lo == hi == 1.0


def test_bootstrap_matches_a_direct_computation():
    x = np.array([0.0, 1.0, 1.0, 0.0, 1.0])
    lo, hi = M.paired_bootstrap({"x": x}, lambda s: float(s["x"].mean()), n_resamples=1000, seed=7)
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 5, size=(1000, 5))
    means = x[idx].mean(axis=1)
    assert (lo, hi) == tuple(np.percentile(means, [2.5, 97.5]))


def test_bootstrap_edge_cases():
    assert all(math.isnan(v) for v in M.paired_bootstrap({"x": []}, lambda s: 0.0))
    with pytest.raises(ConfigError):
        M.paired_bootstrap({"a": [1, 0], "b": [1]}, lambda s: 0.0)
    with pytest.raises(ConfigError):
        M.paired_bootstrap({"a": [1]}, lambda s: 0.0, confidence=1.5)
    nan_stat = M.paired_bootstrap({"target": [0.0, 0.0], "transfer": [1.0, 0.0]}, M._retention_stat)
    assert all(math.isnan(v) for v in nan_stat)  # target 0 on every resample: undefined


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("white", "white", 1.0),
        ("The white kitten.", "white kitten", 1.0),  # articles and punctuation dropped
        ("in a barn", "in a barn near", 2 * (1.0 * (2 / 3)) / (1.0 + 2 / 3)),
        ("no", "yes", 0.0),
        ("", "", 1.0),
        ("", "something", 0.0),
        ("a an the", "", 1.0),  # normalises to empty
    ],
)
def test_token_f1(prediction, reference, expected):
    assert M.token_f1(prediction, reference) == pytest.approx(expected)


def test_max_f1_over_references():
    assert M.max_f1("in a barn", ["in the barn near the house", "in a barn"]) == 1.0
    assert M.max_f1("x", []) == 0.0
    assert M.normalise_text("  The Cat's  hat! ") == "cats hat"


def test_exact_match_normalises_and_takes_any_reference():
    assert M.exact_match(" The Beatles.", ["beatles", "Fab Four"]) == 1.0
    assert M.exact_match("Fab  four!", ["beatles", "Fab Four"]) == 1.0
    assert M.exact_match("the beetles", ["beatles"]) == 0.0
    assert M.exact_match("anything", []) == 0.0
