"""The pair's calibration statistics, cached and reused (kvhandoff.workflow.calibration_passes): a pass for both
directions, attention-weighted passes, a mix extended, changed or unreadable entries collected again."""

import logging

import pytest
import torch

from kvhandoff import FitConfig, fit_mapper, workflow
from kvhandoff.config import CalibrationSpec
from kvhandoff.errors import ConfigError
from kvhandoff.fit.corpus import calibration_batches
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.workflow import load_named_pair, mapper_dir, obtain_mapper
from kvhandoff.workflow.named_pair import statistics_path

from conftest import TINY_CALIBRATION as CALIBRATION
from conftest import tiny_model


def test_reverse_direction_reuses_the_forward_statistics(named_pair):
    obtain_mapper(named_pair, calibration=CALIBRATION, progress=False, both_directions=True)
    assert CalibrationStats.saved_content(statistics_path(named_pair, FitConfig(), CALIBRATION)).target_gram
    reverse, _, reused = obtain_mapper(named_pair.reversed(), calibration=CALIBRATION,
                                       progress=False)
    assert not reused and reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert not statistics_path(named_pair.reversed(), FitConfig(), CALIBRATION).exists()
    assert reverse.selected.shape[0] == 2  # the small model is now the target
    # the same mapper as from a pass of its own in that direction
    windows = calibration_batches(named_pair.tokenizer, CALIBRATION.num_sequences, CALIBRATION.seq_len,
                                  CALIBRATION.seed, CALIBRATION.batch_size, mix=CALIBRATION.mix)
    own = fit_mapper(named_pair.target, named_pair.source, windows, progress=False)
    torch.testing.assert_close(reverse.weight, own.weight, rtol=0, atol=1e-5)


def test_a_pass_for_one_direction_leaves_the_reverse_its_own_pass(named_pair, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff")
    forward, _, _ = obtain_mapper(named_pair, calibration=CALIBRATION)
    assert not CalibrationStats.saved_content(statistics_path(named_pair, FitConfig(), CALIBRATION)).target_gram
    reverse, _, reused = obtain_mapper(named_pair.reversed(), calibration=CALIBRATION)
    assert not reused and "reused_reverse_pass" not in reverse.manifest["calibration"]
    assert statistics_path(named_pair.reversed(), FitConfig(), CALIBRATION).is_file()
    assert "hold no target Gram" in caplog.text
    # asking for both directions later reuses the cached pass of each as it is
    again, _, _ = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False, both_directions=True, refit=True)
    assert torch.equal(again.weight, forward.weight)


def test_attention_weighted_rows_are_a_pass_of_their_own_that_serves_one_direction(named_pair):
    weighted = FitConfig(row_weights="attention")
    obtain_mapper(named_pair, calibration=CALIBRATION, progress=False, both_directions=True)
    mapper, folder, reused = obtain_mapper(named_pair, weighted, CALIBRATION, progress=False)
    assert not reused and folder != mapper_dir(named_pair, FitConfig(), CALIBRATION)
    assert statistics_path(named_pair, weighted, CALIBRATION).is_file()
    assert mapper.manifest["config"]["row_weights"] == "attention"
    # the uniform pass of the other direction holds its Gram, but its rows are not weighted by this target
    reverse, _, _ = obtain_mapper(named_pair.reversed(), weighted, CALIBRATION, progress=False)
    assert "reused_reverse_pass" not in reverse.manifest["calibration"]
    assert statistics_path(named_pair.reversed(), weighted, CALIBRATION).is_file()
    with pytest.raises(ConfigError, match="nor the reverse direction"):
        obtain_mapper(named_pair, weighted, CALIBRATION, progress=False, both_directions=True, refit=True)


@pytest.mark.parametrize(("lead_gram", "both_directions"), [(False, False), (True, True), (False, True)])
def test_a_mix_extends_a_cached_pass_of_its_leading_groups(named_pair, monkeypatch, lead_gram, both_directions):
    from kvhandoff.workflow import calibration_passes

    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    workflow.obtain_statistics(named_pair, FitConfig(), lead, progress=False, both_directions=lead_gram)
    collected = []
    real_collect = calibration_passes._collect
    monkeypatch.setattr(calibration_passes, "_collect", lambda *a, **k: collected.append(a[2]) or real_collect(*a, **k))
    stats, info = workflow.obtain_statistics(named_pair, FitConfig(), extended, progress=False,
                                             both_directions=both_directions)
    # only the new group was run through the models
    assert collected == [CalibrationSpec(num_sequences=1, seq_len=64, mix=("tasks",))]
    assert info["mix"] == {"prose": 1, "exams": 1, "tasks": 1} and info["num_tokens"] == 3 * 64
    assert info["assembled_from"]["new_pass"]["mix"] == ["tasks"]
    assert statistics_path(named_pair, FitConfig(), extended).is_file()
    # the same statistics as one pass over the whole mix (sums over disjoint windows add)
    path = statistics_path(named_pair, FitConfig(), extended)
    # the Gram when both passes sum it
    assert CalibrationStats.saved_content(path).target_gram == (lead_gram and both_directions)
    saved = CalibrationStats.load(path, target_gram=lead_gram and both_directions)
    whole, whole_info = real_collect(named_pair, FitConfig(), extended, False, target_gram=True)
    assert stats.count == saved.count == whole.count and info["token_ids_sha256"] == whole_info["token_ids_sha256"]
    for name, tensor in saved.tensors().items():
        assert torch.allclose(tensor, whole.tensors()[name], rtol=1e-9, atol=1e-6)


def test_a_pass_with_feature_rows_is_never_assembled(named_pair):
    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    obtain_mapper(named_pair, config, lead, progress=False)
    mapper, _, _ = obtain_mapper(named_pair, config, extended, progress=False)
    assert "assembled_from" not in mapper.manifest["calibration"]


def test_a_changed_model_under_the_same_name_never_reuses_old_statistics(named_pair, tmp_path, monkeypatch, caplog):
    from kvhandoff.workflow import calibration_passes


    workflow.obtain_statistics(named_pair, FitConfig(), CALIBRATION, progress=False)
    first = statistics_path(named_pair, FitConfig(), CALIBRATION)
    assert first.is_file()
    # another model saved into the same folder: same name, different weights
    tiny_model("qwen2", layers=3, head_dim=32, seed=7, vocab_size=300).save_pretrained(named_pair.target_spec)
    changed = load_named_pair(named_pair.source_spec, named_pair.target_spec, progress=False)
    assert changed.target_identity != named_pair.target_identity
    assert statistics_path(changed, FitConfig(), CALIBRATION) != first
    collected = []
    real_collect = calibration_passes._collect
    monkeypatch.setattr(calibration_passes, "_collect", lambda *a, **k: collected.append(a[2]) or real_collect(*a, **k))
    _, info = workflow.obtain_statistics(changed, FitConfig(), CALIBRATION, progress=False)
    assert collected == [CALIBRATION] and info["target_identity"] == changed.target_identity
    # an entry whose record names other models (e.g. copied by hand) is stale: rebuilt, with a one-line note
    stale = statistics_path(changed, FitConfig(), CALIBRATION).with_suffix(".json")
    stale.write_text(stale.read_text().replace(changed.target_identity, named_pair.target_identity))
    workflow.obtain_statistics(changed, FitConfig(), CALIBRATION)
    assert len(collected) == 2 and "stale" in caplog.text


def test_an_unreadable_cached_entry_is_rebuilt(named_pair, caplog):

    workflow.obtain_statistics(named_pair, FitConfig(), CALIBRATION, progress=False)
    statistics_path(named_pair, FitConfig(), CALIBRATION).with_suffix(".json").write_text("{not json")
    stats, info = workflow.obtain_statistics(named_pair, FitConfig(), CALIBRATION)
    assert stats.count > 0 and info["num_tokens"] == 3 * 64
    assert "not usable" in caplog.text


def test_maps_that_read_k_and_v_collect_again_over_a_pass_without_the_cross_moments(named_pair, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff")
    path = statistics_path(named_pair, FitConfig(), CALIBRATION)
    own, _, _ = obtain_mapper(named_pair, calibration=CALIBRATION)
    assert CalibrationStats.saved_content(path).kv_cross is False
    joint, _, _ = obtain_mapper(named_pair, FitConfig(source_inputs="kv"), CALIBRATION)
    assert "hold no K–V cross moments" in caplog.text
    caplog.clear()
    assert CalibrationStats.saved_content(path).kv_cross is True  # the same windows, now with them
    assert joint.weight.shape[2] == 2 * own.weight.shape[2]
    # the pass with them serves maps of their own modality as well, as they were
    again, _, reused = obtain_mapper(named_pair, calibration=CALIBRATION, refit=True)
    assert not reused and "collecting" not in caplog.text
    torch.testing.assert_close(again.weight, own.weight, rtol=0, atol=1e-6)
