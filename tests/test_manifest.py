import dataclasses
import json

import pytest

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.config import MAPPER_FORMAT_VERSION
from kvhandoff.errors import ConfigError, MapperFormatError
from kvhandoff.mapper.manifest import (
    GuardCalibration,
    MapperManifest,
    RecomputeChoice,
    TradeoffPoint,
    choose_point,
    dumps,
    loads,
)
from kvhandoff.model.capture import FeatureLayout

from conftest import random_batches, tiny_model


@pytest.fixture(scope="module")
def manifest() -> MapperManifest:
    source, target = tiny_model("llama", layers=2), tiny_model("llama", layers=3, seed=4)
    return fit_mapper(source, target, random_batches(2), FitConfig(top_k=1, exact_prefix=3), progress=False).manifest


def test_fields_are_typed_and_read_as_a_mapping_of_the_json_form(manifest):
    assert isinstance(manifest.config, FitConfig) and manifest.exact_prefix == 3 and not manifest.joint_inputs
    assert manifest.source_layout == FeatureLayout(2, 2, 16) and manifest.format_version == MAPPER_FORMAT_VERSION
    assert manifest.method == "ridge" and len(manifest.selected_layers) == 3
    assert all(isinstance(row, tuple) and len(row) == 1 for row in manifest.selected_layers)
    assert manifest["config"] == FitConfig(top_k=1, exact_prefix=3).to_dict()
    assert manifest["source_layout"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    assert manifest.get("refinement") is None and "refinement" not in manifest and "fit_metrics" in manifest
    assert dict(manifest) == manifest.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        manifest.method = "mlp"


def test_with_metrics_returns_a_new_manifest(manifest):
    more = manifest.with_metrics(extra_metric=1.5)
    assert more.fit_metrics["extra_metric"] == 1.5 and "extra_metric" not in manifest.fit_metrics
    assert more.fit_metrics["r2_k_mean"] == manifest.fit_metrics["r2_k_mean"]


def test_round_trip_through_the_file_text(manifest):
    again = loads(dumps(manifest), "manifest.json")
    assert again == manifest and again.checksum() == manifest.checksum()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"config": {"top_k": 0}}, "config"),
        ({"config": {"top_k": 1, "colour": "red"}}, "config"),
        ({"source_layout": {"num_layers": 2, "num_kv_heads": 0, "head_dim": 16}}, "source_layout"),
        ({"target_layout": [3, 2, 16]}, "target_layout"),
        ({"target_max_position_embeddings": 0}, "target_max_position_embeddings"),
        ({"source_max_position_embeddings": "long"}, "source_max_position_embeddings"),
        ({"selected_layers": [[0], [1]]}, "selected_layers"),
        ({"selected_layers": [[0], [1], [7]]}, "selected_layers"),
        ({"selected_layers": [[0], [1], ["x"]]}, "selected_layers"),
        ({"fit_metrics": [1, 2]}, "fit_metrics"),
        ({"method": ""}, "method"),
        ({"shiny_new_field": 1}, "shiny_new_field"),
        ({"tensor_sha256": 5}, "tensor_sha256"),
    ],
)
def test_validation_names_the_bad_field(manifest, edit, field):
    with pytest.raises(MapperFormatError, match=f"field '{field}'"):
        MapperManifest.from_dict({**manifest.to_dict(), **edit})


def test_missing_fields_and_fingerprint_geometry_are_named(manifest):
    data = manifest.to_dict()
    del data["target_layout"]
    with pytest.raises(MapperFormatError, match="field 'target_layout' is missing"):
        MapperManifest.from_dict(data)
    data = manifest.to_dict()
    data["source_fingerprint"]["geometry"]["num_kv_heads"] = 4
    with pytest.raises(MapperFormatError, match=r"field 'source_fingerprint\.geometry'"):
        MapperManifest.from_dict(data)
    data = manifest.to_dict()
    del data["target_fingerprint"]["geometry"]["rope"]
    with pytest.raises(MapperFormatError, match=r"field 'target_fingerprint\.geometry' lacks the RoPE"):
        MapperManifest.from_dict(data)


def test_one_format_version(manifest):
    for version in (1, 2, 3, None, "4"):
        with pytest.raises(MapperFormatError, match="re-fit"):
            MapperManifest.from_dict({**manifest.to_dict(), "format_version": version})
    with pytest.raises(MapperFormatError, match="upgrade kvhandoff"):
        MapperManifest.from_dict({**manifest.to_dict(), "format_version": MAPPER_FORMAT_VERSION + 1})


def test_a_manifest_without_fingerprints_has_no_rope(manifest):
    bare = dataclasses.replace(manifest, source_fingerprint={}, target_fingerprint={})
    with pytest.raises(MapperFormatError, match="no source fingerprint"):
        bare.rope_config("source")
    target_rope = manifest.rope_config("target")
    assert target_rope.max_position_embeddings == manifest.target_max_position_embeddings
    assert target_rope.rope_parameters == json.loads(manifest.target_fingerprint["geometry"]["rope"]["parameters"])


def guard_record(**changes) -> GuardCalibration:
    values = dict(signal="entropy", threshold=2.5, auroc=0.8, label="answer_changed",
                  rule="max_catch_minus_false_fallback", target_rate=None, dev_switches=30, bad_switches=12,
                  catch_rate=0.75, false_fallback_rate=0.1, dev_conversations=10, recompute="recent:5%", window=64)
    return GuardCalibration(**{**values, **changes})


def test_a_guard_record_round_trips_and_an_old_manifest_checksums_as_before(manifest):
    assert manifest.guard is None and "guard" not in manifest.to_dict()
    old_text = dumps(manifest)  # a manifest written before guards were recorded
    assert loads(old_text, "manifest.json") == manifest
    assert json.loads(old_text)["checksum"] == manifest.checksum() == manifest.with_guard(None).checksum()
    guarded = manifest.with_guard(guard_record())
    assert guarded.checksum() != manifest.checksum() and manifest.guard is None  # a new manifest, the old unchanged
    again = loads(dumps(guarded), "manifest.json")
    assert again == guarded and again.guard == guard_record() and again["guard"]["threshold"] == 2.5
    assert again.guard.auroc == 0.8 and again.guard.target_rate is None
    assert dataclasses.replace(again, guard=None) == manifest  # nothing else changed
    edited = json.loads(dumps(guarded))
    edited["guard"]["threshold"] = 9.0  # an edit past the checksum is refused
    with pytest.raises(MapperFormatError, match="checksum"):
        loads(json.dumps(edited), "manifest.json")


@pytest.mark.parametrize(("edit", "field"), [
    ({"threshold": float("nan")}, "guard.threshold"),
    ({"threshold": "high"}, "guard.threshold"),
    ({"auroc": 1.5}, "guard.auroc"),
    ({"signal": ""}, "guard.signal"),
    ({"rule": "vibes"}, "guard.rule"),
    ({"dev_switches": 0}, "guard.dev_switches"),
    ({"bad_switches": 31}, "guard.bad_switches"),
    ({"window": True}, "guard.window"),
    ({"action": "escalate"}, "guard.action"),
    ({"action": "retry"}, "guard.action"),
])
def test_a_bad_guard_record_names_its_field(manifest, edit, field):
    data = {**manifest.to_dict(), "guard": {**guard_record().to_dict(), **edit}}
    with pytest.raises(MapperFormatError, match=f"field '{field}'"):
        MapperManifest.from_dict(data)
    with pytest.raises(MapperFormatError, match="field 'guard'"):  # a field missing, or one it does not know
        MapperManifest.from_dict({**manifest.to_dict(), "guard": {"signal": "entropy"}})
    with pytest.raises(MapperFormatError, match=r"field 'guard' has fields this kvhandoff does not know \(margin\); "
                                                "upgrade kvhandoff"):
        MapperManifest.from_dict({**manifest.to_dict(), "guard": {**guard_record().to_dict(), "margin": 0.1}})


def test_a_guard_records_its_action_and_a_fallback_record_keeps_its_checksum(manifest):
    plain = manifest.with_guard(guard_record())
    assert plain.guard.action == "fallback" and "action" not in plain.to_dict()["guard"]
    assert plain.checksum() == manifest.with_guard(guard_record(action="fallback")).checksum()
    escalating = manifest.with_guard(guard_record(action="escalate:recent:35%",
                                                  rule="best_retention_at_min_speedup"))
    again = loads(dumps(escalating), "manifest.json")
    assert again.guard.action == "escalate:recent:35%" and again.checksum() != plain.checksum()


def recompute_record(**changes) -> RecomputeChoice:
    values = dict(spec="recent:20%", rule="fastest_at_min_retention", min_retention=0.97, group="generative",
                  tasks=("coqa_gen", "boolq_long"), pool="dev", items_per_task=24, mean_retention=0.98,
                  history_tokens=2048, speedup=3.1)
    return RecomputeChoice(**{**values, **changes})


def test_a_recompute_record_round_trips_and_leaves_a_manifest_without_one_as_it_was(manifest):
    assert manifest.recompute is None and "recompute" not in manifest.to_dict()
    chosen = manifest.with_recompute(recompute_record())
    assert chosen.checksum() != manifest.checksum() and manifest.recompute is None
    again = loads(dumps(chosen), "manifest.json")
    assert again == chosen and again.recompute == recompute_record() and again["recompute"]["tasks"] == [
        "coqa_gen", "boolq_long"]
    assert dataclasses.replace(again, recompute=None) == manifest
    assert "fastest with mean retention >= 0.97 over generative tasks coqa_gen, boolq_long (24 dev items each: " \
           "retention 0.980, 3.1x faster than re-prefill at 2048 tokens)" in again.recompute.describe()
    short = recompute_record(mean_retention=0.949).describe()  # no point kept 0.97: the most retentive
    assert short.startswith("chosen as the most retentive (no policy kept a mean retention of 0.97) over "
                            "generative tasks") and "retention 0.949" in short


@pytest.mark.parametrize(("edit", "field"), [
    ({"spec": ""}, "recompute.spec"),
    ({"rule": "cheapest"}, "recompute.rule"),
    ({"tasks": []}, "recompute.tasks"),
    ({"speedup": float("inf")}, "recompute.speedup"),
    ({"mean_retention": "high"}, "recompute.mean_retention"),
    ({"items_per_task": 0}, "recompute.items_per_task"),
    ({"history_tokens": True}, "recompute.history_tokens"),
    ({"min_speedup": -1}, "recompute.min_speedup"),
    ({"tradeoff": "fast"}, "recompute.tradeoff"),
    ({"tradeoff": [{"spec": "recent:20%", "mean_retention": 0.98}]}, "recompute.tradeoff"),
    ({"tradeoff": [{"spec": "recent:20%", "mean_retention": 0.98, "speedup": -3.1}]}, "recompute.tradeoff.speedup"),
    ({"tradeoff": [{"spec": "recent:20%", "mean_retention": 0.98, "speedup": 3.1}] * 2}, "recompute.tradeoff"),
    # the record names a point its own rule does not take from its trade-off
    ({"tradeoff": [{"spec": "recent:20%", "mean_retention": 0.98, "speedup": 3.1},
                   {"spec": "recent:10%", "mean_retention": 0.99, "speedup": 6.0}]}, "recompute.spec"),
])
def test_a_bad_recompute_record_names_its_field_and_the_fix(manifest, edit, field):
    data = {**manifest.to_dict(), "recompute": {**recompute_record().to_dict(), **edit}}
    with pytest.raises(MapperFormatError, match=f"field '{field}'.*record-recompute"):
        MapperManifest.from_dict(data)


TRADEOFF = (TradeoffPoint("turn_attention:5%", 0.926, 10.6), TradeoffPoint("turn_attention:10%", 0.952, 8.8),
            TradeoffPoint("turn_attention:20%", 0.968, 3.5))


@pytest.mark.parametrize(("min_retention", "min_speedup", "chosen"), [
    (0.97, 0.0, "turn_attention:20%"),   # none keeps 0.97: the most retentive
    (0.97, 5.0, "turn_attention:10%"),   # ... of those at 5x or faster
    (0.95, 5.0, "turn_attention:10%"),   # the fastest keeping 0.95
    (0.90, 5.0, "turn_attention:5%"),    # the fastest keeping 0.90
    (0.97, 20.0, "turn_attention:5%"),   # none is 20x faster: the fastest
    (0.0, 3.5, "turn_attention:5%"),
])
def test_the_recorded_rule_takes_the_fastest_retentive_point_above_the_speed_floor(min_retention, min_speedup,
                                                                                    chosen):
    assert choose_point(TRADEOFF, min_retention, min_speedup).spec == chosen
    assert choose_point((), 0.97, 5.0) is None
    tied = (TradeoffPoint("a:5%", 0.9, 4.0), TradeoffPoint("b:5%", 0.9, 6.0))
    assert choose_point(tied, 0.97).spec == "b:5%"  # equal retention: the faster


def test_a_record_with_its_tradeoff_round_trips_and_is_chosen_again_under_other_bounds(manifest):
    record = recompute_record(spec="turn_attention:10%", mean_retention=0.952, speedup=8.8, min_speedup=5.0,
                              tradeoff=TRADEOFF)
    again = loads(dumps(manifest.with_recompute(record)), "manifest.json")
    assert again.recompute == record and again["recompute"]["tradeoff"][2] == {
        "spec": "turn_attention:20%", "mean_retention": 0.968, "speedup": 3.5}
    assert "most retentive of 3 measured at 5x or faster (no policy kept a mean retention of 0.97)" in \
        record.describe()
    slower = record.rechosen(min_speedup=3.0)
    assert (slower.spec, slower.mean_retention, slower.speedup, slower.min_speedup, slower.min_retention) == (
        "turn_attention:20%", 0.968, 3.5, 3.0, 0.97)
    assert record.rechosen(min_retention=0.9).spec == "turn_attention:5%"  # the record's floor of 5x kept
    assert record.rechosen() == record
    # a record without a trade-off keeps its JSON form (and so the checksum of the manifest it is in)
    assert set(recompute_record().to_dict()) == {"spec", "rule", "min_retention", "group", "tasks", "pool",
                                                 "items_per_task", "mean_retention", "history_tokens", "speedup"}
    with pytest.raises(ConfigError, match=r"recorded without the trade-off.*record-recompute.*--recompute"):
        recompute_record().rechosen(min_speedup=3.0)


def test_a_record_may_name_any_point_tied_with_its_rules_choice():
    tied = (TradeoffPoint("recent:10%", 0.98, 6.0), TradeoffPoint("sinks:10%", 0.98, 6.0),
            TradeoffPoint("recent:20%", 0.99, 3.0))
    for spec in ("recent:10%", "sinks:10%"):
        assert recompute_record(spec=spec, mean_retention=0.98, speedup=6.0, tradeoff=tied).spec == spec
    with pytest.raises(MapperFormatError, match=r"'recompute.spec' is 'recent:20%', but its rule takes"):
        recompute_record(spec="recent:20%", mean_retention=0.99, speedup=3.0, tradeoff=tied)
    with pytest.raises(MapperFormatError, match=r"field 'recompute.tradeoff' has fields this kvhandoff does not know "
                                                r"\(spread\); upgrade kvhandoff"):
        recompute_record(spec="recent:10%", mean_retention=0.98, speedup=6.0,
                         tradeoff=[{"spec": "recent:10%", "mean_retention": 0.98, "speedup": 6.0, "spread": 0.1}])
