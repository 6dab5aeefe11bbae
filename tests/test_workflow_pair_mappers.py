"""The pair's mappers, cached and reused (kvhandoff.workflow.pair_mappers): fitted once, a damaged entry refitted,
held-out settings, and a mapper placed where the source takes its inputs."""


import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.mapper.manifest import (
    GUARD_RULES,
    GuardCalibration,
)
from kvhandoff.workflow import mapper_dir, obtain_mapper
from kvhandoff.workflow.pair_mappers import on_source_device

from conftest import TINY_CALIBRATION as CALIBRATION
from conftest import random_batches, tiny_model


def test_mapper_is_fitted_once_then_reused(named_pair):
    first, folder, reused = obtain_mapper(named_pair, calibration=CALIBRATION,
                                          progress=False)
    assert not reused and folder == mapper_dir(named_pair, FitConfig(), CALIBRATION)
    assert first.manifest["calibration"]["num_tokens"] == 3 * 64
    again, _, reused = obtain_mapper(named_pair, calibration=CALIBRATION,
                                     progress=False)
    assert reused and again.manifest["tensor_sha256"] == first.manifest["tensor_sha256"]
    assert first.folder == again.folder == folder  # where `kvhandoff guard-calibrate` records the pair's guard
    guard = GuardCalibration("entropy", 2.0, None, "answer_changed", GUARD_RULES[0], None, 4, 0, None, 0.0, 2,
                             "recent:5%", 64)
    again.record_guard(guard)
    recorded, _, reused = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False)
    assert reused and recorded.manifest.guard == guard  # a recorded guard keeps the cached mapper in use


def test_damaged_cached_mapper_is_refitted_not_reused(named_pair, caplog):
    _, folder, _ = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False)
    tensors = folder / "mapper.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    mapper, _, reused = obtain_mapper(named_pair, calibration=CALIBRATION)
    assert not reused and mapper.num_parameters() > 0
    assert "not usable" in caplog.text


def test_heldout_config_collects_rows_and_reuses_them(named_pair):
    from kvhandoff.workflow.named_pair import features_dir

    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    mapper, _, reused = obtain_mapper(named_pair, config, CALIBRATION, progress=False, both_directions=True)
    assert not reused and features_dir(named_pair, config, CALIBRATION).is_dir()
    assert len(mapper.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 3
    # the reverse direction reads the same pass's rows, flipped
    reverse, _, _ = obtain_mapper(named_pair.reversed(), config, CALIBRATION, progress=False)
    assert reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert len(reverse.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 2


def test_a_mapper_goes_where_the_source_takes_its_inputs():
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, seed=1)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k=1), progress=False)
    assert on_source_device(mapper, source) is mapper and mapper.device == torch.device("cpu")  # CPU: untouched
    assert on_source_device(None, source) is None
    source.model.embed_tokens.to("meta")  # stands in for a GPU this machine lacks
    on_source_device(mapper, source)
    assert mapper.device == torch.device("meta") and mapper.weight.device == torch.device("meta")
