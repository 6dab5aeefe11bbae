"""The runner: item selection, resumable per-item caches, identity retention, result files."""

from __future__ import annotations

import json

import pytest
import torch

from _eval_support import IdentityMapper, NoisyMapper
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.model.geometry import model_fingerprint, tokenizer_hash
from kvhandoff_lab.evaluation import runner as R
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions
from kvhandoff_lab.evaluation.tasks import load_items

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

TOK = ByteTokenizer()


def evaluate(source, target, mapper, tasks, limit=100, seed=0, out_dir=None, *, mapped="all", exact_prefix=None,
             recompute=None, result_name="results", reverse_mapper=None, documents=None, on_item=None, **scoring):
    """`run_eval` with fast scoring settings (few resamples, short generations) and no progress bars."""
    return R.run_eval(source, target, mapper, TOK, EvalOptions(tasks, limit, seed, mapped, exact_prefix, recompute),
                      ScoringOptions(**{"n_resamples": 50, "max_new_tokens": 4, **scoring}),
                      OutputOptions(out_dir, result_name, progress=False),
                      reverse_mapper=reverse_mapper, documents=documents, on_item=on_item)


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", seed=0, **BYTE_MODEL), tiny_model("qwen2", seed=1, **BYTE_MODEL)


class Crash(Exception):
    pass


def same(a: dict, b: dict) -> bool:
    """Equality that treats NaN as equal to NaN (undefined retentions)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_item_selection_is_seeded_disjoint_and_nested():
    a = R.select_items("arc_challenge", 20, seed=1)
    assert [i.id for i in a] == [i.id for i in R.select_items("arc_challenge", 20, seed=1)]
    assert [i.id for i in a] != [i.id for i in R.select_items("arc_challenge", 20, seed=2)]
    assert [i.id for i in R.select_items("arc_challenge", 10, seed=1)] == [i.id for i in a[:10]]
    dev = R.select_items("arc_challenge", None, seed=1, pool="dev")
    report = R.select_items("arc_challenge", None, seed=5, pool="report")
    assert not {i.id for i in dev} & {i.id for i in report}
    assert len(dev) + len(report) == len(load_items("arc_challenge"))
    assert 0.1 < len(dev) / (len(dev) + len(report)) < 0.3
    with pytest.raises(ConfigError):
        R.select_items("arc_challenge", 0, seed=0)
    with pytest.raises(ConfigError):
        R.select_items("arc_challenge", 5, seed=0, pool="test")


def test_item_store_survives_a_torn_line(tmp_path):
    path = tmp_path / "x.jsonl"
    store = R.ItemStore(path, {"what": "test"})
    store.append({"id": "a", "v": 1})
    store.append({"id": "b", "v": 2})
    with path.open("a") as f:
        f.write('{"id": "c", "v"')  # a crash in the middle of a write
    store = R.ItemStore(path)
    assert set(store.records) == {"a", "b"} and store.skipped_lines == 1
    store.append({"id": "c", "v": 3})
    reloaded = R.ItemStore(path)
    assert reloaded.records == {"a": {"id": "a", "v": 1}, "b": {"id": "b", "v": 2}, "c": {"id": "c", "v": 3}}
    assert json.loads(path.read_text().splitlines()[0]) == {"_header": {"what": "test"}}
    with pytest.raises(ValueError):
        reloaded.append({"id": "a", "v": 9})


def test_identity_transfer_has_retention_exactly_one(models, tmp_path):
    target, _ = models
    result = evaluate(target, target, IdentityMapper(), "arc_challenge,winogrande", limit=4, seed=0,
                        out_dir=tmp_path)
    for name in ("arc_challenge", "winogrande"):
        task = result["tasks"][name]
        acc = task["accuracy"]
        assert acc["transfer"]["value"] == acc["target"]["value"] == acc["source"]["value"]
        assert acc["target"]["value"] > 0  # so that retention is defined (the checks below always run)
        assert task["retention"] == {"value": 1.0, "ci": [1.0, 1.0]}
        assert task["n"] == 4 and len(task["item_ids"]) == 4
    assert (tmp_path / "results.json").is_file() and (tmp_path / "results.md").is_file()
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_mapping_in_the_runner(models, tmp_path):
    target, source = models
    result = evaluate(source, target, NoisyMapper(scale=0.3), "arc_challenge,mmlu", limit=2, seed=0,
                        out_dir=tmp_path, mapped="history")
    assert result["mapped"] == "history" and set(result["tasks"]) == {"mmlu"}
    assert "few-shot history" in result["skipped"]["arc_challenge"]
    assert "new turn" in (tmp_path / "results.md").read_text()
    # its transfer records are kept apart from the whole-context transfer's; the standalone ones are shared
    whole = evaluate(source, target, NoisyMapper(scale=0.3), "mmlu", limit=2, seed=0, out_dir=tmp_path)
    files = sorted(p.name for p in (tmp_path / "items" / "mmlu").glob("*.jsonl"))
    assert len(files) == 4 and sum(name.startswith("transfer-") for name in files) == 2
    assert whole["mapped"] == "all" and "skipped" not in whole
    with pytest.raises(ConfigError, match="mapped"):
        evaluate(source, target, NoisyMapper(), "mmlu", limit=1, mapped="turn")


def test_generation_task_in_the_runner(models, tmp_path):
    target, _ = models
    result = evaluate(target, target, IdentityMapper(), "gsm8k", limit=1, seed=0, out_dir=tmp_path)
    task = result["tasks"]["gsm8k"]
    assert task["primary_metric"] == "exact_match" and task["chance"] == 0.0
    files = sorted((tmp_path / "items" / "gsm8k").glob("*.jsonl"))
    outputs = {json.loads(f.read_text().splitlines()[1])["output"] for f in files}
    assert len(files) == 2 and len(outputs) == 1  # source == target share one file; transfer output equal


def test_resume_after_a_crash_recomputes_nothing(models, tmp_path):
    target, source = models
    mapper = NoisyMapper(scale=0.3)
    clean = evaluate(source, target, mapper, "arc_challenge,winogrande", limit=3, seed=4,
                       out_dir=tmp_path / "clean")
    computed: list[tuple[str, str, str]] = []

    def crash_after_five(task, condition, record):
        computed.append((task, condition, record["id"]))
        if len(computed) == 5:
            raise Crash

    out = tmp_path / "resumed"
    with pytest.raises(Crash):
        evaluate(source, target, mapper, "arc_challenge,winogrande", limit=3, seed=4, out_dir=out,
                   on_item=crash_after_five)
    assert not (out / "results.json").exists()
    first = list(computed)
    computed.clear()
    resumed = evaluate(source, target, mapper, "arc_challenge,winogrande", limit=3, seed=4, out_dir=out,
                         on_item=lambda *a: computed.append((a[0], a[1], a[2]["id"])))
    assert len(first) == 5 and len(computed) == 2 * 3 * 3 - 5
    assert not set(first) & set(computed)  # nothing computed twice
    assert same(resumed, clean)
    # a finished run re-renders without computing anything
    computed.clear()
    again = evaluate(source, target, mapper, "arc_challenge,winogrande", limit=3, seed=4, out_dir=out,
                       on_item=lambda *a: computed.append(a))
    assert computed == [] and same(again, clean)
    for f in (out / "items").rglob("*.jsonl"):
        ids = [json.loads(line).get("id") for line in f.read_text().splitlines()[1:]]
        assert len(ids) == len(set(ids)) == 3


def test_directions_share_standalone_records_and_mappers_are_keyed(models, tmp_path):
    a, b = models
    evaluate(a, b, NoisyMapper(seed=1), "arc_challenge", limit=2, seed=0, out_dir=tmp_path)
    computed: list = []

    def hook(task, condition, record):
        computed.append(condition)

    evaluate(b, a, NoisyMapper(seed=2), "arc_challenge", limit=2, seed=0, out_dir=tmp_path,
               result_name="reverse", on_item=hook)
    assert computed == ["transfer", "transfer"]  # both standalone runs come from the forward run's files

    class OtherMapper(NoisyMapper):
        def __init__(self) -> None:
            super().__init__()
            self.manifest = {"config": {"top_k": 1}}

    computed.clear()
    evaluate(a, b, OtherMapper(), "arc_challenge", limit=2, seed=0, out_dir=tmp_path, on_item=hook)
    assert computed == ["transfer", "transfer"]  # a different mapper never reuses stale transfer records
    computed.clear()
    result = evaluate(a, b, NoisyMapper(seed=1), "arc_challenge", limit=2, seed=0, out_dir=tmp_path,
                        exact_prefix=2, on_item=hook)
    assert computed == ["transfer", "transfer"] and result["exact_prefix"] == 2


def test_perplexity_and_coqa_in_the_runner(models, tmp_path):
    target, _ = models
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (40,), generator=gen) for _ in range(2)]
    result = evaluate(target, target, IdentityMapper(), "perplexity,coqa", limit=2, seed=0, out_dir=tmp_path,
                        recompute="none", reverse_mapper=IdentityMapper(), documents=docs, perplexity_docs=2,
                        prefix_len=12, continuation_len=8, coqa_conversations=1, coqa_turns=2, coqa_max_new_tokens=2)
    assert result["perplexity"]["ratio"] == 1.0 and len(result["perplexity"]["document_ids"]) == 2
    coqa = result["coqa"]
    assert coqa["conversations"] == 1 and coqa["turns"] == 2
    assert coqa["runs"]["switch_source_first"]["f1_vs_standalone_per_turn"] == [1.0, 1.0]
    assert "Conditional perplexity" in (tmp_path / "results.md").read_text()
    with pytest.raises(ConfigError, match="reverse mapper"):
        evaluate(target, target, IdentityMapper(), "coqa", limit=1, out_dir=tmp_path)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    atomic_write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_identities():
    m0, m1 = tiny_model("qwen2", seed=0, **BYTE_MODEL), tiny_model("qwen2", seed=1, **BYTE_MODEL)
    assert model_fingerprint(m0) == model_fingerprint(tiny_model("qwen2", seed=0, **BYTE_MODEL))
    assert model_fingerprint(m0) != model_fingerprint(m1)
    assert R.mapper_identity(IdentityMapper())["class"].endswith("IdentityMapper")

    class WithManifest:
        def __init__(self) -> None:
            self.manifest = {"config": {"top_k": 4}, "x": 1}

    assert R.mapper_identity(WithManifest())["top_k"] == 4
    timed, retimed = WithManifest(), WithManifest()
    timed.manifest["fit_metrics"] = {"r2": 0.5, "solve_seconds": 1.0}
    retimed.manifest["fit_metrics"] = {"r2": 0.5, "solve_seconds": 2.5}
    assert R.mapper_identity(timed) == R.mapper_identity(retimed)  # timings do not change the identity
    retimed.manifest["fit_metrics"]["r2"] = 0.6
    assert R.mapper_identity(timed) != R.mapper_identity(retimed)
    served = WithManifest()
    served.manifest["recompute"] = {"spec": "recent:20%"}  # how the pair is served, not what the map computes
    served.manifest["guard"] = {"signal": "entropy", "threshold": 1.4}
    assert R.mapper_identity(served) == R.mapper_identity(WithManifest())
    assert R.mapper_identity(NoisyMapper(scale=0.1)) != R.mapper_identity(NoisyMapper(scale=0.2))
    counted = IdentityMapper()
    before = R.mapper_identity(counted)
    counted.transfer(None)
    assert R.mapper_identity(counted) == before
    assert tokenizer_hash(TOK) == tokenizer_hash(ByteTokenizer())
    assert R.slug("Qwen/Qwen2.5 0.5B!") == "qwen-qwen2.5-0.5b"


@pytest.mark.real_models
def test_real_pair_transfer_retains_most_of_the_target(tmp_path):
    """The default pair with a mapper fitted on the built-in calibration corpus (slow: ~25 min on 2 busy CPUs)."""
    from kvhandoff.fit.corpus import calibration_batches
    from kvhandoff.fit.pipeline import fit_mapper
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET, load_pair

    pair = load_pair(DEFAULT_SOURCE, DEFAULT_TARGET, progress=False)
    mapper = fit_mapper(pair.source, pair.target, calibration_batches(pair.tokenizer, 32, 256),
                        source_tokenizer=pair.source_tokenizer, target_tokenizer=pair.target_tokenizer, progress=False)
    result = R.run_eval(pair.source, pair.target, mapper, pair.tokenizer, EvalOptions("arc_easy,piqa", limit=40),
                        ScoringOptions(n_resamples=200), OutputOptions(tmp_path, progress=False))
    for task in result["tasks"].values():
        acc = task["accuracy"]
        assert acc["target"]["value"] > task["chance"] + 0.1, task  # the target model itself is competent
        assert acc["transfer"]["value"] > task["chance"], task  # the mapped cache carries the context
    assert result["summary"]["all"]["mean_retention"] > 0.6, result["summary"]  # measured: 0.78 (40 items)


def test_items_sharing_a_prefix_are_computed_together():
    from kvhandoff_lab.evaluation.tasks import Choice, MCItem

    def item(i, prefix):
        context = (prefix or "") + f"Q{i}?"
        return MCItem(f"i{i}", (Choice(context, " a", 1), Choice(context, " b", 1)), 0, shared_prefix=prefix)

    items = [item(0, "A."), item(1, None), item(2, "B."), item(3, "A."), item(4, None), item(5, "B."), item(6, "A.")]
    assert R.prefix_grouped_order(items) == [0, 3, 6, 1, 2, 5, 4]
    assert R.prefix_grouped_order(items[1:2] + items[4:5]) == [0, 1]  # no prefixes: the order given

    computed = []
    run = R.RecordRun("target", "k", {}, lambda it: computed.append(it.id) or {"id": it.id, "gold": 0})
    records = R.run_records("t", items, [run], None)
    assert computed == ["i0", "i3", "i6", "i1", "i2", "i5", "i4"]
    assert list(records["target"]) == [it.id for it in items]  # results keep the items' order
