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
