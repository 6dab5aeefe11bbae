"""What was measured for the embedded pair's default mappers (kvhandoff.workflow.measured): the packaged records,
invalid files refused, and the records a mapper carries from its fit on."""

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from kvhandoff import FitConfig, workflow
from kvhandoff.config import CalibrationSpec
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import (
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
from kvhandoff.workflow import measured, obtain_mapper

from conftest import TINY_CALIBRATION as CALIBRATION


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


def test_a_mapper_with_a_measured_guard_records_it_when_fitted(named_pair, monkeypatch, tmp_path):
    guard = GuardCalibration(signal="entropy", threshold=1.5, auroc=0.7, label="answer_changed",
                             rule="max_catch_minus_false_fallback", target_rate=None, dev_switches=10, bad_switches=4,
                             catch_rate=0.5, false_fallback_rate=0.1, dev_conversations=5, recompute="recent:5%",
                             window=64)
    entry = record_entry(named_pair.source_spec, named_pair.target_spec, guard=guard)
    monkeypatch.setattr(measured, "MEASURED_RECORDS_FILE", records_file(tmp_path, entry))
    mapper, folder, _ = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest.guard == guard and mapper.manifest.recompute is None
    assert Mapper.load(folder, named_pair.source, named_pair.target).manifest.guard == guard
    reverse, _, _ = obtain_mapper(named_pair.reversed(), calibration=CALIBRATION, progress=False)
    assert reverse.manifest.guard is None  # measured for one direction only


def test_a_mapper_with_a_measured_recompute_policy_records_it_when_fitted(named_pair, monkeypatch, tmp_path):
    choice = RecomputeChoice("turn_attention:5%", "fastest_at_min_retention", 0.97, "generative",
                             ("coqa_gen", "boolq_long"), "dev", 12, 0.98, 2048, 8.2)
    entry = record_entry(named_pair.source_spec, named_pair.target_spec, recompute=choice)
    monkeypatch.setattr(measured, "MEASURED_RECORDS_FILE", records_file(tmp_path, entry))
    mapper, folder, _ = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest.recompute == choice and mapper.manifest.guard is None
    assert Mapper.load(folder, named_pair.source, named_pair.target).manifest.recompute == choice
    other, _, _ = obtain_mapper(named_pair, FitConfig(ridge_lambda=0.5), CALIBRATION, progress=False)
    assert other.manifest.recompute is None  # measured for the default fit only


def test_the_default_pairs_measured_records_serve_as_recorded():
    """Each record the default mappers are fitted with is one the server takes as it is: its signal known, its
    action readable, measured under the recompute policy recorded beside it (no note)."""
    from kvhandoff.runtime.policy import parse
    from kvhandoff.runtime.switch.guard import Fallback
    from kvhandoff.runtime.switch.pair import guard_policy
    from kvhandoff.serving.settings import ServeConfig

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
    code = "".join(path.read_text(encoding="utf-8") for path in Path(workflow.__file__).parent.glob("*.py"))
    numbers = {repr(float(v)) for r in EXPECTED_RECORDS for v in (r.guard.threshold, r.guard.auroc,
                                                                  r.recompute.mean_retention, r.recompute.speedup)}
    assert not [n for n in numbers if n in code]


def test_the_records_file_ships_with_the_package():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvhandoff"]
    package = Path(workflow.__file__).parents[1]
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
