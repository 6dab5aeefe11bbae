import json
import logging
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from kvhandoff import FitConfig, fit_mapper, workflow
from kvhandoff.config import CalibrationSpec
from kvhandoff.errors import ConfigError
from kvhandoff.fit.corpus import calibration_batches
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.manifest import (
    GUARD_RULES,
    GuardCalibration,
    MapperManifest,
    RecomputeChoice,
    TradeoffPoint,
    dumps,
    loads,
)
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.capture import FeatureLayout
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.workflow import load_named_pair, mapper_dir, obtain_mapper, on_source_device, statistics_path

from conftest import random_batches, save_tiny_pair, tiny_model

CALIBRATION = CalibrationSpec(num_sequences=3, seq_len=64)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    return load_named_pair(small, large, progress=False)


def test_mapper_is_fitted_once_then_reused(pair):
    first, folder, reused = obtain_mapper(pair, calibration=CALIBRATION,
                                          progress=False)
    assert not reused and folder == mapper_dir(pair, FitConfig(), CALIBRATION)
    assert first.manifest["calibration"]["num_tokens"] == 3 * 64
    again, _, reused = obtain_mapper(pair, calibration=CALIBRATION,
                                     progress=False)
    assert reused and again.manifest["tensor_sha256"] == first.manifest["tensor_sha256"]
    assert first.folder == again.folder == folder  # where `kvhandoff guard-calibrate` records the pair's guard
    guard = GuardCalibration("entropy", 2.0, None, "answer_changed", GUARD_RULES[0], None, 4, 0, None, 0.0, 2,
                             "recent:5%", 64)
    again.record_guard(guard)
    recorded, _, reused = obtain_mapper(pair, calibration=CALIBRATION, progress=False)
    assert reused and recorded.manifest.guard == guard  # a recorded guard keeps the cached mapper in use


def test_reverse_direction_reuses_the_forward_statistics(pair):
    obtain_mapper(pair, calibration=CALIBRATION, progress=False, both_directions=True)
    assert CalibrationStats.saved_content(statistics_path(pair, FitConfig(), CALIBRATION)).target_gram
    reverse, _, reused = obtain_mapper(pair.reversed(), calibration=CALIBRATION,
                                       progress=False)
    assert not reused and reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert not statistics_path(pair.reversed(), FitConfig(), CALIBRATION).exists()
    assert reverse.selected.shape[0] == 2  # the small model is now the target
    # the same mapper as from a pass of its own in that direction
    windows = calibration_batches(pair.tokenizer, CALIBRATION.num_sequences, CALIBRATION.seq_len, CALIBRATION.seed,
                                  CALIBRATION.batch_size, mix=CALIBRATION.mix)
    own = fit_mapper(pair.target, pair.source, windows, progress=False)
    torch.testing.assert_close(reverse.weight, own.weight, rtol=0, atol=1e-5)


def test_a_pass_for_one_direction_leaves_the_reverse_its_own_pass(pair, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff")
    forward, _, _ = obtain_mapper(pair, calibration=CALIBRATION)
    assert not CalibrationStats.saved_content(statistics_path(pair, FitConfig(), CALIBRATION)).target_gram
    reverse, _, reused = obtain_mapper(pair.reversed(), calibration=CALIBRATION)
    assert not reused and "reused_reverse_pass" not in reverse.manifest["calibration"]
    assert statistics_path(pair.reversed(), FitConfig(), CALIBRATION).is_file()
    assert "hold no target Gram" in caplog.text
    # asking for both directions later reuses the cached pass of each as it is
    again, _, _ = obtain_mapper(pair, calibration=CALIBRATION, progress=False, both_directions=True, refit=True)
    assert torch.equal(again.weight, forward.weight)


def test_attention_weighted_rows_are_a_pass_of_their_own_that_serves_one_direction(pair):
    weighted = FitConfig(row_weights="attention")
    obtain_mapper(pair, calibration=CALIBRATION, progress=False, both_directions=True)
    mapper, folder, reused = obtain_mapper(pair, weighted, CALIBRATION, progress=False)
    assert not reused and folder != mapper_dir(pair, FitConfig(), CALIBRATION)
    assert statistics_path(pair, weighted, CALIBRATION).is_file() and mapper.manifest["config"]["row_weights"] == \
        "attention"
    # the uniform pass of the other direction holds its Gram, but its rows are not weighted by this target
    reverse, _, _ = obtain_mapper(pair.reversed(), weighted, CALIBRATION, progress=False)
    assert "reused_reverse_pass" not in reverse.manifest["calibration"]
    assert statistics_path(pair.reversed(), weighted, CALIBRATION).is_file()
    with pytest.raises(ConfigError, match="nor the reverse direction"):
        obtain_mapper(pair, weighted, CALIBRATION, progress=False, both_directions=True, refit=True)


def test_damaged_cached_mapper_is_refitted_not_reused(pair, caplog):
    _, folder, _ = obtain_mapper(pair, calibration=CALIBRATION, progress=False)
    tensors = folder / "mapper.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    mapper, _, reused = obtain_mapper(pair, calibration=CALIBRATION)
    assert not reused and mapper.num_parameters() > 0
    assert "not usable" in caplog.text


def test_heldout_config_collects_rows_and_reuses_them(pair):
    from kvhandoff.workflow import features_dir

    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    mapper, _, reused = obtain_mapper(pair, config, CALIBRATION, progress=False, both_directions=True)
    assert not reused and features_dir(pair, config, CALIBRATION).is_dir()
    assert len(mapper.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 3
    # the reverse direction reads the same pass's rows, flipped
    reverse, _, _ = obtain_mapper(pair.reversed(), config, CALIBRATION, progress=False)
    assert reverse.manifest["calibration"]["reused_reverse_pass"] is True
    assert len(reverse.manifest["fit_metrics"]["heldout_choice"]["k_per_target_layer"]) == 2


def test_a_calibration_mix_is_its_own_cache_entry(pair):
    mixed = CalibrationSpec(num_sequences=4, seq_len=64, mix=("prose", "exams"))
    assert statistics_path(pair, FitConfig(), mixed) != statistics_path(pair, FitConfig(), CALIBRATION)
    mapper, folder, reused = obtain_mapper(pair, calibration=mixed, progress=False)
    assert not reused and folder == mapper_dir(pair, FitConfig(), mixed)
    assert mapper.manifest["calibration"]["mix"] == {"prose": 2, "exams": 2}
    assert mapper.manifest["calibration"]["num_tokens"] == 4 * 64


@pytest.mark.parametrize(("lead_gram", "both_directions"), [(False, False), (True, True), (False, True)])
def test_a_mix_extends_a_cached_pass_of_its_leading_groups(pair, monkeypatch, lead_gram, both_directions):
    from kvhandoff import workflow

    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    workflow.obtain_statistics(pair, FitConfig(), lead, progress=False, both_directions=lead_gram)
    collected = []
    real_collect = workflow._collect
    monkeypatch.setattr(workflow, "_collect", lambda *a, **k: collected.append(a[2]) or real_collect(*a, **k))
    stats, info = workflow.obtain_statistics(pair, FitConfig(), extended, progress=False,
                                             both_directions=both_directions)
    # only the new group was run through the models
    assert collected == [CalibrationSpec(num_sequences=1, seq_len=64, mix=("tasks",))]
    assert info["mix"] == {"prose": 1, "exams": 1, "tasks": 1} and info["num_tokens"] == 3 * 64
    assert info["assembled_from"]["new_pass"]["mix"] == ["tasks"]
    assert statistics_path(pair, FitConfig(), extended).is_file()
    # the same statistics as one pass over the whole mix (sums over disjoint windows add)
    path = statistics_path(pair, FitConfig(), extended)
    # the Gram when both passes sum it
    assert CalibrationStats.saved_content(path).target_gram == (lead_gram and both_directions)
    saved = CalibrationStats.load(path, target_gram=lead_gram and both_directions)
    whole, whole_info = real_collect(pair, FitConfig(), extended, False, target_gram=True)
    assert stats.count == saved.count == whole.count and info["token_ids_sha256"] == whole_info["token_ids_sha256"]
    for name, tensor in saved.tensors().items():
        assert torch.allclose(tensor, whole.tensors()[name], rtol=1e-9, atol=1e-6)


def test_a_pass_with_feature_rows_is_never_assembled(pair):
    config = FitConfig(top_k="heldout", ridge_lambda="heldout")
    lead = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose", "exams"))
    extended = CalibrationSpec(num_sequences=3, seq_len=64, mix=("prose", "exams", "tasks"))
    obtain_mapper(pair, config, lead, progress=False)
    mapper, _, _ = obtain_mapper(pair, config, extended, progress=False)
    assert "assembled_from" not in mapper.manifest["calibration"]


def test_a_changed_model_under_the_same_name_never_reuses_old_statistics(pair, tmp_path, monkeypatch, caplog):
    from kvhandoff import workflow

    from conftest import tiny_model

    workflow.obtain_statistics(pair, FitConfig(), CALIBRATION, progress=False)
    first = statistics_path(pair, FitConfig(), CALIBRATION)
    assert first.is_file()
    # another model saved into the same folder: same name, different weights
    tiny_model("qwen2", layers=3, head_dim=32, seed=7, vocab_size=300).save_pretrained(pair.target_spec)
    changed = load_named_pair(pair.source_spec, pair.target_spec, progress=False)
    assert changed.target_identity != pair.target_identity
    assert statistics_path(changed, FitConfig(), CALIBRATION) != first
    collected = []
    real_collect = workflow._collect
    monkeypatch.setattr(workflow, "_collect", lambda *a, **k: collected.append(a[2]) or real_collect(*a, **k))
    _, info = workflow.obtain_statistics(changed, FitConfig(), CALIBRATION, progress=False)
    assert collected == [CALIBRATION] and info["target_identity"] == changed.target_identity
    # an entry whose record names other models (e.g. copied by hand) is stale: rebuilt, with a one-line note
    stale = statistics_path(changed, FitConfig(), CALIBRATION).with_suffix(".json")
    stale.write_text(stale.read_text().replace(changed.target_identity, pair.target_identity))
    workflow.obtain_statistics(changed, FitConfig(), CALIBRATION)
    assert len(collected) == 2 and "stale" in caplog.text


def test_an_unreadable_cached_entry_is_rebuilt(pair, caplog):
    from kvhandoff import workflow

    workflow.obtain_statistics(pair, FitConfig(), CALIBRATION, progress=False)
    statistics_path(pair, FitConfig(), CALIBRATION).with_suffix(".json").write_text("{not json")
    stats, info = workflow.obtain_statistics(pair, FitConfig(), CALIBRATION)
    assert stats.count > 0 and info["num_tokens"] == 3 * 64
    assert "not usable" in caplog.text


def test_the_manifest_records_each_sides_own_tokenizer(pair):
    from kvhandoff.model.geometry import tokenizer_hash

    mapper, _, _ = obtain_mapper(pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest["source_fingerprint"]["tokenizer_hash"] == tokenizer_hash(pair.models.source_tokenizer)
    assert mapper.manifest["target_fingerprint"]["tokenizer_hash"] == tokenizer_hash(pair.models.target_tokenizer)


def test_a_pair_whose_tokenizers_differ_is_refused(tmp_path):
    from kvhandoff.errors import IncompatiblePairError

    from conftest import chat_tokenizer

    small, large = save_tiny_pair(tmp_path / "models")
    chat_tokenizer().save_pretrained(large)
    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        load_named_pair(small, large, progress=False)


def test_a_mapper_goes_where_the_source_takes_its_inputs():
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, seed=1)
    mapper = fit_mapper(source, target, random_batches(2), FitConfig(top_k=1), progress=False)
    assert on_source_device(mapper, source) is mapper and mapper.device == torch.device("cpu")  # CPU: untouched
    assert on_source_device(None, source) is None
    source.model.embed_tokens.to("meta")  # stands in for a GPU this machine lacks
    on_source_device(mapper, source)
    assert mapper.device == torch.device("meta") and mapper.weight.device == torch.device("meta")


def test_maps_that_read_k_and_v_collect_again_over_a_pass_without_the_cross_moments(pair, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff")
    path = statistics_path(pair, FitConfig(), CALIBRATION)
    own, _, _ = obtain_mapper(pair, calibration=CALIBRATION)
    assert CalibrationStats.saved_content(path).kv_cross is False
    joint, _, _ = obtain_mapper(pair, FitConfig(source_inputs="kv"), CALIBRATION)
    assert "hold no K–V cross moments" in caplog.text
    caplog.clear()
    assert CalibrationStats.saved_content(path).kv_cross is True  # the same windows, now with them
    assert joint.weight.shape[2] == 2 * own.weight.shape[2]
    # the pass with them serves maps of their own modality as well, as they were
    again, _, reused = obtain_mapper(pair, calibration=CALIBRATION, refit=True)
    assert not reused and "collecting" not in caplog.text
    torch.testing.assert_close(again.weight, own.weight, rtol=0, atol=1e-6)


def record_entry(source: str, target: str, config: FitConfig | None = None, calibration: CalibrationSpec = CALIBRATION,
                 guard: GuardCalibration | None = None, recompute: RecomputeChoice | None = None) -> dict:
    """A record of a measured records file (for the default fit config unless told), each measurement in its
    manifest form."""
    config = FitConfig() if config is None else config
    measured = {name: value.to_dict() for name, value in (("guard", guard), ("recompute", recompute)) if value}
    return {"source_model": source, "target_model": target, "config": config.to_dict(),
            "calibration": calibration.to_dict(), **measured,
            "source": {name: {"docs": "a test", "command": "none"} for name in measured}}


def records_file(folder: Path, *records: dict, name: str = "records.json") -> Path:
    path = folder / name
    path.write_text(json.dumps({"description": "a test", "records": list(records)}), encoding="utf-8")
    return path


def test_a_mapper_with_a_measured_guard_records_it_when_fitted(pair, monkeypatch, tmp_path):
    guard = GuardCalibration(signal="entropy", threshold=1.5, auroc=0.7, label="answer_changed",
                             rule="max_catch_minus_false_fallback", target_rate=None, dev_switches=10, bad_switches=4,
                             catch_rate=0.5, false_fallback_rate=0.1, dev_conversations=5, recompute="recent:5%",
                             window=64)
    monkeypatch.setattr(workflow, "MEASURED_RECORDS_FILE",
                        records_file(tmp_path, record_entry(pair.source_spec, pair.target_spec, guard=guard)))
    mapper, folder, _ = obtain_mapper(pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest.guard == guard and mapper.manifest.recompute is None
    assert Mapper.load(folder, pair.source, pair.target).manifest.guard == guard
    reverse, _, _ = obtain_mapper(pair.reversed(), calibration=CALIBRATION, progress=False)
    assert reverse.manifest.guard is None  # measured for one direction only


def test_a_mapper_with_a_measured_recompute_policy_records_it_when_fitted(pair, monkeypatch, tmp_path):
    choice = RecomputeChoice("turn_attention:5%", "fastest_at_min_retention", 0.97, "generative",
                             ("coqa_gen", "boolq_long"), "dev", 12, 0.98, 2048, 8.2)
    monkeypatch.setattr(workflow, "MEASURED_RECORDS_FILE",
                        records_file(tmp_path, record_entry(pair.source_spec, pair.target_spec, recompute=choice)))
    mapper, folder, _ = obtain_mapper(pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest.recompute == choice and mapper.manifest.guard is None
    assert Mapper.load(folder, pair.source, pair.target).manifest.recompute == choice
    other, _, _ = obtain_mapper(pair, FitConfig(ridge_lambda=0.5), CALIBRATION, progress=False)
    assert other.manifest.recompute is None  # measured for the default fit only


def test_the_default_pairs_measured_records_serve_as_recorded():
    """Each record the default mappers are fitted with is one the server takes as it is: its signal known, its
    action readable, measured under the recompute policy recorded beside it (no note)."""
    from kvhandoff.runtime.policy import parse
    from kvhandoff.runtime.switch.guard import Fallback
    from kvhandoff.runtime.switch.pair import guard_policy
    from kvhandoff.serving.config import ServeConfig

    for record in workflow.measured_records():
        policy = guard_policy(ServeConfig().switch, record.guard, recompute=parse(record.recompute.spec))
        assert (policy.source, policy.note, policy.signal) == ("recorded", None, record.guard.signal)
    forward, backward = workflow.measured_records()
    assert (forward.source, forward.target) == (DEFAULT_SOURCE, DEFAULT_TARGET)
    assert {guard_policy(ServeConfig().switch, r.guard).action for r in workflow.measured_records()} == {Fallback()}
    # the point `kvhandoff serve --min-speedup 3` serves (docs/SERVING.md): the budget at which CoQA small → large
    # reaches the 1.5B alone on dev, and large → small's own record
    assert [r.recompute.rechosen(min_speedup=3.0).spec for r in (forward, backward)] == [
        "turn_attention:20%", "turn_attention:10%"]


#: what the embedded pair's records held when they were literals in `workflow` (copied once): the packaged records
#: file must load to exactly these, so the default mappers fitted on a fresh machine carry the same manifests
EXPECTED_RECORDS = (
    workflow.MeasuredRecord(DEFAULT_SOURCE, DEFAULT_TARGET, FitConfig(), CalibrationSpec(), guard=GuardCalibration(
        signal="entropy_gain", threshold=0.038418, auroc=0.79296875, label="switch_below_target",
        rule="best_retention_at_min_speedup", target_rate=None, dev_switches=72, bad_switches=8, catch_rate=0.25,
        false_fallback_rate=0.046875, dev_conversations=24, recompute="turn_attention:10%", window=64),
        recompute=RecomputeChoice(
            spec="turn_attention:10%", rule="fastest_at_min_retention", min_retention=0.97, group="generative",
            tasks=("coqa_gen", "boolq_long"), pool="dev", items_per_task=24, mean_retention=0.9519360554990008,
            history_tokens=2048, speedup=8.819499180950405, min_speedup=5.0, tradeoff=(
                TradeoffPoint("turn_attention:5%", 0.9263846472872601, 10.587184056527029),
                TradeoffPoint("turn_attention:10%", 0.9519360554990008, 8.819499180950405),
                TradeoffPoint("turn_attention:20%", 0.9679334916864609, 3.5331742675718742)))),
    workflow.MeasuredRecord(DEFAULT_TARGET, DEFAULT_SOURCE, FitConfig(), CalibrationSpec(), guard=GuardCalibration(
        signal="entropy", threshold=2.343122, auroc=0.5488372093023256, label="switch_below_target",
        rule="best_retention_at_min_speedup", target_rate=None, dev_switches=48, bad_switches=5, catch_rate=0.2,
        false_fallback_rate=0.0, dev_conversations=16, recompute="turn_attention:10%", window=64),
        recompute=RecomputeChoice(
            spec="turn_attention:10%", rule="fastest_at_min_retention", min_retention=0.97, group="generative",
            tasks=("coqa_gen", "boolq_long"), pool="dev", items_per_task=24, mean_retention=1.1392151220995335,
            history_tokens=2048, speedup=4.102146249589246, min_speedup=2.5, tradeoff=(
                TradeoffPoint("turn_attention:5%", 0.8830586128362312, 4.524685964621116),
                TradeoffPoint("turn_attention:10%", 1.1392151220995335, 4.102146249589246)))),
)


def _manifest(guard: GuardCalibration | None, recompute: RecomputeChoice | None) -> MapperManifest:
    return MapperManifest("ridge", FitConfig(), FeatureLayout(2, 1, 4), FeatureLayout(3, 1, 4), ((0,), (1,), (1,)),
                          {}, {}, 64, 64, guard=guard, recompute=recompute)


def test_the_packaged_records_are_the_measured_values_with_their_source():
    records = workflow.measured_records()
    assert records == EXPECTED_RECORDS
    assert records is workflow.measured_records()  # read once
    data = json.loads(workflow.MEASURED_RECORDS_FILE.read_text(encoding="utf-8"))
    for record, entry, expected in zip(records, data["records"], EXPECTED_RECORDS, strict=True):
        # each measurement in exactly the form a manifest writes it, the fit it applies to as its config writes it
        assert entry["guard"] == expected.guard.to_dict() and entry["recompute"] == expected.recompute.to_dict()
        assert (entry["config"], entry["calibration"]) == (FitConfig().to_dict(), CalibrationSpec().to_dict())
        # a manifest carrying the loaded records is the one the literals gave, byte for byte, and reads back so
        loaded, literal = _manifest(record.guard, record.recompute), _manifest(expected.guard, expected.recompute)
        assert dumps(loaded) == dumps(literal) and loaded.checksum() == literal.checksum()
        back = loads(dumps(loaded), "manifest.json")
        assert (back.guard, back.recompute, back.checksum()) == (expected.guard, expected.recompute,
                                                                 literal.checksum())
        # the numbers' source: the docs section and the experiment command for each measurement
        assert set(record.measured_by) == {"guard", "recompute"}
        assert all(origin["docs"].startswith("docs/RESULTS.md") for origin in record.measured_by.values())
        assert "experiments/switch_guard.py" in record.measured_by["guard"]["command"]
        assert "experiments/recompute_tradeoff.py" in record.measured_by["recompute"]["command"]
    # no measured number is left in the code
    code = Path(workflow.__file__).read_text(encoding="utf-8")
    numbers = {repr(float(v)) for r in EXPECTED_RECORDS for v in (r.guard.threshold, r.guard.auroc,
                                                                  r.recompute.mean_retention, r.recompute.speedup)}
    assert not [n for n in numbers if n in code]


def test_the_records_file_ships_with_the_package():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvhandoff"]
    package = Path(workflow.__file__).parent
    relative = workflow.MEASURED_RECORDS_FILE.relative_to(package).as_posix()
    assert any(fnmatch(relative, pattern) for pattern in patterns)


def test_records_for_another_file_are_read_from_it(tmp_path):
    choice = RecomputeChoice("recent:5%", "fastest_at_min_retention", 0.9, "generative", ("coqa_gen",), "dev", 4,
                             0.95, 1024, 3.0)
    prose = CalibrationSpec(num_sequences=4, seq_len=64, mix=("prose",))  # its dict form leaves the mix out
    path = records_file(tmp_path, record_entry("a", "b", FitConfig(top_k=2), prose, recompute=choice))
    (record,) = workflow.measured_records(path)
    assert record == workflow.MeasuredRecord("a", "b", FitConfig(top_k=2), prose, recompute=choice)
    assert record.measured_by == {"recompute": {"docs": "a test", "command": "none"}}


def _entry(**changes) -> dict:
    entry = record_entry("small", "large", guard=EXPECTED_RECORDS[0].guard, recompute=EXPECTED_RECORDS[0].recompute)
    for name, value in changes.items():
        if value is None:
            del entry[name]
        else:
            entry[name] = value
    return entry


@pytest.mark.parametrize(("records", "problem"), [
    ([_entry(weights="x")], r"record 0 \(small → large\): fields kvhandoff does not know \(weights"),
    ([_entry(guard={**EXPECTED_RECORDS[0].guard.to_dict(), "margin": 1})],
     r"record 0 \(small → large\): field 'guard' has fields a GuardCalibration does not know \(margin\)"),
    ([_entry(guard={**EXPECTED_RECORDS[0].guard.to_dict(), "threshold": "high"})],
     r"record 0 \(small → large\): field 'guard' fails the GuardCalibration check .*guard.threshold"),
    ([_entry(recompute={**EXPECTED_RECORDS[0].recompute.to_dict(), "spec": "turn_attention:20%"})],
     r"field 'recompute' fails the RecomputeChoice check .*its rule takes 'turn_attention:10%'"),
    ([_entry(recompute={**EXPECTED_RECORDS[0].recompute.to_dict(), "tradeoff": [{"spec": "x", "speed": 1}]})],
     r"field 'recompute' fails the RecomputeChoice check .*speed"),
    ([_entry(config={"top_k": 0})], r"field 'config' fails the FitConfig check"),
    ([_entry(calibration={"seq_len": 4})], r"field 'calibration' fails the CalibrationSpec check"),
    ([_entry(source=None)], r"record 0 \(small → large\): field 'source' is missing"),
    ([_entry(source={"guard": {"docs": "RESULTS", "command": "x"}})], r"field 'source' must name where each"),
    ([_entry(source={"guard": {"docs": "RESULTS"}, "recompute": {"docs": "RESULTS", "command": "x"}})],
     r"field 'source.guard' must be an object"),
    ([_entry(guard=None, recompute=None, source={})], r"records no measurement"),
    ([_entry(target_model=3)], r"record 0: field 'target_model' must name a model"),
    ([_entry(), _entry()], r"has record 1 \(small → large\) for a pair, fit config and calibration an earlier"),
    (["small → large"], r"invalid record 0: a record must be a JSON object"),
])
def test_an_invalid_records_file_is_refused_naming_the_file_the_record_and_the_fix(tmp_path, records, problem):
    path = records_file(tmp_path, *records)
    with pytest.raises(ConfigError, match=problem) as caught:
        workflow.measured_records(path)
    assert str(path) in str(caught.value) and "correct the record" in str(caught.value)


@pytest.mark.parametrize(("text", "problem"), [
    ("{\"records\": [", "is not valid JSON"),
    ("[]", "must be a JSON object with a list of \"records\""),
    (json.dumps({"records": [], "version": 2}), r"fields kvhandoff does not know \(version"),
])
def test_a_corrupt_records_file_is_refused_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "records.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=problem) as caught:
        workflow.measured_records(path)
    assert str(path) in str(caught.value) and "reinstall kvhandoff" in str(caught.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        workflow.measured_records(tmp_path / "missing.json")
