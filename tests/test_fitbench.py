import json

import pytest

from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import collect_statistics, estimate_memory, feature_layout, mapper_from_statistics
from kvhandoff_lab import fitbench
from kvhandoff_lab.fitbench import describe_fit_cost, measure_fit_cost, parse_status, run_fit_bench

from conftest import random_batches, tiny_model


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", layers=2), tiny_model("llama", layers=3, head_dim=8, seed=4)


def test_the_memory_fields_of_proc_status_are_read_in_bytes():
    text = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nRssAnon:\t 1000 kB\nRssFile:\t 24 kB\nThreads:\t3\n"
    assert parse_status(text) == {"VmHWM": 2048 * 1024, "VmRSS": 1024 * 1024, "RssAnon": 1000 * 1024,
                                  "RssFile": 24 * 1024}


def test_forward_only_and_fit_steps_alternate_which_runs_first(models, monkeypatch):
    calls = []
    forward, fit_step = fitbench.time_forward_only, fitbench.time_fit_step
    monkeypatch.setattr(fitbench, "time_forward_only", lambda *a: calls.append("forward") or forward(*a))
    monkeypatch.setattr(fitbench, "time_fit_step", lambda *a: calls.append("fit") or fit_step(*a))
    result = measure_fit_cost(*models, random_batches(3), progress=False)
    # the warm-up forward and the forward-only window whose peak is the forwards' own come first
    assert calls[2:] == ["forward", "fit", "fit", "forward", "forward", "fit"]
    assert [row["window"] for row in result["windows"]] == [0, 1, 2]


@pytest.mark.parametrize(("config", "target_gram"), [(FitConfig(), False), (FitConfig(top_k=1, source_inputs="kv"),
                                                                              True)])
def test_the_bench_measures_the_fits_own_pass_and_solve(models, config, target_gram):
    windows = random_batches(2)
    result = measure_fit_cost(*models, windows, config, target_gram, project_windows=120, progress=False)
    summary, memory = result["summary"], result["memory"]
    assert len(result["windows"]) == summary["windows"] == 2
    for row in result["windows"]:
        assert row["fit_step_s"] == row["capture_s"] + row["sums_s"] and row["forward_only_s"] > 0
    assert summary["statistics_pass_s"] == pytest.approx(summary["capture_s"] + summary["sums_s"])
    assert summary["pass_ratio"] == pytest.approx(summary["statistics_pass_s"] / summary["forward_only_s"])
    assert summary["fit_ratio"] == pytest.approx((summary["statistics_pass_s"] + summary["solve_s"])
                                                 / summary["forward_only_s"])
    per_window = summary["forward_only_s"] / 2
    assert summary["projected_fit_ratio"] == pytest.approx(summary["pass_ratio"] + summary["solve_s"]
                                                           / (per_window * 120))
    # the statistics and the mapper are the fit's: the same rows, sums of the shapes' estimate, the same maps
    stats = collect_statistics(*models, windows, config, progress=False, target_gram=target_gram)
    assert result["settings"]["statistics_rows"] == stats.count
    estimate = estimate_memory(stats.source, feature_layout(models[1]), config, target_gram=target_gram)
    assert memory["statistics_bytes"] == estimate.statistics_bytes == memory["estimate"]["statistics_bytes"]
    assert memory["mapper_bytes"] == mapper_from_statistics(stats, config, {}, {}).nbytes()
    assert memory["fit_peak_bytes"] == max(memory["pass_peak_bytes"], memory["solve_peak_bytes"])
    assert all(isinstance(memory[key], int) for key in ("baseline_rss_bytes", "forward_peak_bytes"))
    assert result["settings"]["target_gram"] is target_gram and result["settings"]["config"] == config.to_dict()


def test_the_result_is_written_and_described(models, tmp_path):
    result = run_fit_bench(*models, random_batches(1), tmp_path, description={"note": "tiny"}, progress=False)
    assert json.loads((tmp_path / "bench-fit.json").read_text()) == json.loads(json.dumps(result))
    assert result["description"] == {"note": "tiny"}
    lines = describe_fit_cost(result)
    assert lines[0].startswith("1 windows of 96 tokens") and "projected to 120 windows" in lines[1]
    assert "peak memory above the loaded models" in lines[2]


def test_what_may_make_the_peaks_read_low_is_said():
    result = {"settings": {"tokens_per_window": 8, "torch_threads": 1},
              "summary": {"windows": 1, "forward_only_s": 1.0, "statistics_pass_s": 1.1, "capture_s": 1.05,
                          "sums_s": 0.05, "solve_s": 0.2, "pass_ratio": 1.1, "fit_ratio": 1.3, "project_windows": 120,
                          "projected_fit_ratio": 1.1},
              "memory": {"forward_peak_bytes": 0, "pass_peak_bytes": 2**30, "solve_peak_bytes": 2**30,
                         "statistics_bytes": 2**29, "estimate": {"peak_bytes": 2**30}, "peak_reset": False,
                         "file_backed_bytes": {"before": 2**31, "after": 2**30}}}
    notes = describe_fit_cost(result)[3:]
    assert "1.00 GiB of file-backed pages" in notes[0] and "could not be reset" in notes[1]


def test_no_windows_is_refused(models):
    with pytest.raises(ConfigError, match="at least one calibration window"):
        measure_fit_cost(*models, [], progress=False)
