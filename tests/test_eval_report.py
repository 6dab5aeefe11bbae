"""Markdown and PNG rendering from one or two result files."""

from __future__ import annotations

import json
import math

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import report as RP


def fake_result(source: str, target: str, retention: float) -> dict:
    def task(display, group, ret):
        return {
            "display": display, "group": group, "primary_metric": "acc", "n": 10, "chance": 0.25,
            "accuracy": {"target": {"value": 0.8, "ci": [0.6, 1.0]}, "source": {"value": 0.5, "ci": [0.2, 0.8]},
                         "transfer": {"value": 0.8 * ret, "ci": [0.5, 0.9]}},
            "retention": {"value": ret, "ci": [ret - 0.1, ret + 0.05]},
            "floor_normalised_retention": {"value": (0.8 * ret - 0.25) / 0.55, "ci": [0.1, 0.9]},
        }

    return {
        "format": "kvhandoff-eval/1",
        "direction": {"source": source, "target": target},
        "seed": 0,
        "bootstrap": {"n_resamples": 1000, "confidence": 0.95},
        "tasks": {"arc_challenge": task("ARC-Challenge", "core", retention),
                  "piqa": task("PIQA", "heldout", retention - 0.05),
                  "gsm8k": {**task("GSM8K", "core", float("nan")), "retention": {"value": float("nan"),
                                                                                  "ci": [float("nan")] * 2}}},
        "summary": {"core": {"tasks": ["ARC-Challenge"], "mean_retention": retention,
                             "mean_floor_normalised_retention": 0.5}},
        "perplexity": {"conditions": {"target": {"perplexity": 10.0, "documents": 4},
                                      "transfer": {"perplexity": 12.5, "documents": 4}},
                       "ratio": 1.25, "prefix_len": 1024, "continuation_len": 1024},
    }


def write(path, obj):
    path.write_text(json.dumps(obj, allow_nan=True))
    return path


def test_one_direction(tmp_path):
    f = write(tmp_path / "forward.json", fake_result("small", "large", 0.9))
    md, png = RP.render_results(f, tmp_path, stem="one")
    text = md.read_text()
    assert "### small → large" in text
    assert "| ARC-Challenge | acc | 10 | 0.250 | 0.500 | 0.800 | 0.720 | 0.900 [0.800, 0.950] |" in text
    assert "| GSM8K |" in text and "– [–, –]" in text  # undefined retention rendered as a dash
    assert "transfer ÷ target = 1.250" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_directions(tmp_path):
    f = write(tmp_path / "forward.json", fake_result("small", "large", 0.9))
    r = write(tmp_path / "reverse.json", fake_result("large", "small", 0.7))
    md, png = RP.render_results([f, r], tmp_path)
    text = md.read_text()
    assert text.index("### small → large") < text.index("### large → small")
    assert md.name == "summary.md" and png.name == "summary.png" and png.stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temporary files renamed away


def test_bad_inputs(tmp_path):
    f = write(tmp_path / "forward.json", fake_result("a", "b", 0.9))
    with pytest.raises(ConfigError, match="one or two"):
        RP.render_results([f, f, f], tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        RP.render_results(bad, tmp_path)
    with pytest.raises(ConfigError, match="not a kvhandoff"):
        RP.render_results(write(tmp_path / "other.json", {"x": 1}), tmp_path)
    assert RP._fmt(math.nan) == "–" and RP._fmt(None) == "–"


def test_perplexity_only_run_has_no_empty_benchmark_table(tmp_path):
    result = {**fake_result("small", "large", 0.9), "tasks": {}, "summary": {}}
    md, _ = RP.render_results(write(tmp_path / "forward.json", result), tmp_path)
    text = md.read_text()
    assert "| Task |" not in text and "transfer ÷ target = 1.250" in text
