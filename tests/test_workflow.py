import pytest

from kvhandoff import FitConfig
from kvhandoff.assets import load_model
from kvhandoff.config import CalibrationSpec
from kvhandoff.workflow import mapper_dir, obtain_mapper, statistics_path

from conftest import save_tiny_pair

CALIBRATION = CalibrationSpec(num_sequences=3, seq_len=64)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    (source, tokenizer), (target, _) = load_model(small, progress=False), load_model(large, progress=False)
    return small, large, source, target, tokenizer


def test_mapper_is_fitted_once_then_reused(pair):
    small, large, source, target, tokenizer = pair
    first, folder, reused = obtain_mapper(small, large, source, target, tokenizer, calibration=CALIBRATION,
                                          progress=False)
    assert not reused and folder == mapper_dir(small, large, FitConfig(), CALIBRATION)
    assert first.manifest["calibration"]["num_tokens"] == 3 * 64
    again, _, reused = obtain_mapper(small, large, source, target, tokenizer, calibration=CALIBRATION,
                                     progress=False)
    assert reused and again.manifest["tensor_sha256"] == first.manifest["tensor_sha256"]


def test_reverse_direction_reuses_the_forward_statistics(pair):
    small, large, source, target, tokenizer = pair
    obtain_mapper(small, large, source, target, tokenizer, calibration=CALIBRATION, progress=False)
    reverse, _, reused = obtain_mapper(large, small, target, source, tokenizer, calibration=CALIBRATION,
                                       progress=False)
    assert not reused and reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert not statistics_path(large, small, FitConfig(), CALIBRATION).exists()
    assert reverse.selected.shape[0] == 2  # the small model is now the target


def test_damaged_cached_mapper_is_refitted_not_reused(pair, capsys):
    small, large, source, target, tokenizer = pair
    _, folder, _ = obtain_mapper(small, large, source, target, tokenizer, calibration=CALIBRATION, progress=False)
    tensors = folder / "mapper.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    mapper, _, reused = obtain_mapper(small, large, source, target, tokenizer, calibration=CALIBRATION)
    assert not reused and mapper.num_parameters() > 0
    assert "not usable" in capsys.readouterr().out


def test_heldout_config_collects_rows_and_reuses_them(pair):
    from kvhandoff.workflow import features_dir

    small, large, source, target, tokenizer = pair
    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    mapper, _, reused = obtain_mapper(small, large, source, target, tokenizer, config, CALIBRATION, progress=False)
    assert not reused and features_dir(small, large, config, CALIBRATION).is_dir()
    assert len(mapper.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 3
    # the reverse direction reads the same pass's rows, flipped
    reverse, _, _ = obtain_mapper(large, small, target, source, tokenizer, config, CALIBRATION, progress=False)
    assert reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert len(reverse.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 2


def test_a_calibration_mix_is_its_own_cache_entry(pair):
    small, large, source, target, tokenizer = pair
    mixed = CalibrationSpec(num_sequences=4, seq_len=64, mix=("prose", "exams"))
    assert statistics_path(small, large, FitConfig(), mixed) != statistics_path(small, large, FitConfig(), CALIBRATION)
    mapper, folder, reused = obtain_mapper(small, large, source, target, tokenizer, calibration=mixed, progress=False)
    assert not reused and folder == mapper_dir(small, large, FitConfig(), mixed)
    assert mapper.manifest["calibration"]["mix"] == {"prose": 2, "exams": 2}
    assert mapper.manifest["calibration"]["num_tokens"] == 4 * 64


def test_a_mix_extends_a_cached_pass_of_its_leading_groups(pair, monkeypatch):
    import torch

    from kvhandoff import workflow
    from kvhandoff.statistics import CalibrationStats

    small, large, source, target, tokenizer = pair
    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    workflow.obtain_statistics(small, large, source, target, tokenizer, FitConfig(), lead, progress=False)
    collected = []
    real_collect = workflow._collect
    monkeypatch.setattr(workflow, "_collect", lambda *a, **k: collected.append(a[6]) or real_collect(*a, **k))
    stats, info = workflow.obtain_statistics(small, large, source, target, tokenizer, FitConfig(), extended,
                                             progress=False)
    # only the new group was run through the models
    assert collected == [CalibrationSpec(num_sequences=1, seq_len=64, mix=("tasks",))]
    assert info["mix"] == {"prose": 1, "exams": 1, "tasks": 1} and info["num_tokens"] == 3 * 64
    assert info["assembled_from"]["new_pass"]["mix"] == ["tasks"]
    assert statistics_path(small, large, FitConfig(), extended).is_file()
    # the same statistics as one pass over the whole mix (sums over disjoint windows add)
    saved = CalibrationStats.load(statistics_path(small, large, FitConfig(), extended))
    whole, whole_info = real_collect(small, large, source, target, tokenizer, FitConfig(), extended, False)
    assert stats.count == saved.count == whole.count and info["token_ids_sha256"] == whole_info["token_ids_sha256"]
    for name in ("sum_x", "sum_xy", "sum_yy"):
        assert torch.allclose(getattr(saved, name), getattr(whole, name), rtol=1e-9, atol=1e-6)


def test_a_pass_with_feature_rows_is_never_assembled(pair):
    small, large, source, target, tokenizer = pair
    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    obtain_mapper(small, large, source, target, tokenizer, config, lead, progress=False)
    mapper, _, _ = obtain_mapper(small, large, source, target, tokenizer, config, extended, progress=False)
    assert "assembled_from" not in mapper.manifest["calibration"]
