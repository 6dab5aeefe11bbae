"""The server's measurements on the tiny family, through their commands: the serve bench (both paths per length and
direction, with the server's reports), the load test (switching conversations, no errors), the hostile mixed load
(every class sent, no 5xx) and the guard measurement (dev / held-out split); and their pieces (schedules, chat turns,
percentiles, loopback only)."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from _serving_support import AGENT_CONTEXT, chat_ids, tiny_family
from kvhandoff.coqa import DEMO_STORY_ID, dev_conversations
from kvhandoff.errors import ConfigError
from kvhandoff.serving.calibrate import GuardRecord, auroc, guard_records, guard_records_by_signal
from kvhandoff_lab.cli import app
from kvhandoff_lab.serving.client import require_loopback
from kvhandoff_lab.serving.guard_eval import (
    SERVED_THRESHOLD,
    auroc_interval,
    chat_turns,
    heldout_conversations,
    resummarize,
    switching_schedule,
)
from kvhandoff_lab.serving.hostile import CLASSES, hostile_over_http, server_outcomes
from kvhandoff_lab.serving.loadtest import current_rss, load_over_http, peak_rss, percentile, schedule
from kvhandoff_lab.serving.workload import coqa_dialogues, document

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tiny_cli(monkeypatch):
    """The measurement commands host the tiny family instead of loading models."""
    import kvhandoff_lab.cli.measure as measure

    seen = {}

    def fake_load_family(specs, mapper_dirs, progress=False):
        seen["family"] = (specs, mapper_dirs)
        return tiny_family()

    monkeypatch.setattr(measure, "load_family", fake_load_family)
    return seen


def test_bench_serve_times_both_paths_per_length_and_direction(tiny_cli, tmp_path):
    out, plot = tmp_path / "serve_bench.json", tmp_path / "serve_bench.png"
    result = CliRunner().invoke(app, ["bench-serve", "--guard", "on", "--guard-signal", "logloss",
                                      "--guard-threshold", "1.0", "--lengths", "24,48", "--repeats", "2",
                                      "--max-tokens", "3", "--out", str(out), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert plot.stat().st_size > 0 and "ratio" in result.output
    bench = json.loads(out.read_text())
    assert bench["format"] == "kvhandoff-serve-bench/1" and bench["models"] == ["small", "large"]
    assert bench["settings"]["guard"] and bench["skipped"] == []
    rows = bench["results"]
    assert [(r["tokens"], r["source"], r["target"]) for r in rows] == [
        (24, "small", "large"), (24, "large", "small"), (48, "small", "large"), (48, "large", "small")]
    for row in rows:
        handoff, reprefill = row["handoff"], row["reprefill"]
        assert handoff["status"] == ["applied", "applied"] and reprefill["status"] == ["reprefill", "reprefill"]
        assert all(m > 0 for m in handoff["mapped_tokens"]) and reprefill["mapped_tokens"] == [0, 0]
        assert reprefill["read_tokens"] == [row["prompt_tokens"]] * 2
        assert all(g["signal"] == "logloss" for g in handoff["guard"]) and reprefill["guard"] == [None, None]
        assert handoff["answers"] == reprefill["answers"]  # an exact mapper: the same answers either way
        for path in (handoff, reprefill):
            assert len(path["ttft_s"]["samples"]) == 2 and path["ttft_s"]["median"] > 0
            assert path["first_chunk_s"]["median"] <= path["ttft_s"]["median"]
        assert row["ratio"] == pytest.approx(reprefill["ttft_s"]["median"] / handoff["ttft_s"]["median"])
        assert row["history_tokens"] < row["prompt_tokens"]
    assert rows[2]["history_tokens"] - rows[0]["history_tokens"] == 24  # the document grew by 24 tokens


def test_bench_serve_one_direction_and_bad_values(tiny_cli, tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(app, ["bench-serve", "--lengths", "16", "--direction", "reverse", "--no-warmup",
                                      "--recompute", "sinks:0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert [(r["source"], r["target"]) for r in saved["results"]] == [("large", "small")]
    assert saved["settings"]["recompute"] == "sinks:50%"
    for args, option in ((["--direction", "sideways"], "--direction"), (["--lengths", "0"], "--lengths"),
                         (["--lengths", "4000"], "lengths"), (["--recompute", "fast:1"], "--recompute")):
        tiny_cli.clear()
        result = CliRunner().invoke(app, ["bench-serve", *args, "--out", str(out)])
        assert result.exit_code != 0 and option in result.output, result.output


def test_load_test_runs_switching_conversations_without_errors(tiny_cli, tmp_path):
    out = tmp_path / "serve_load.json"
    result = CliRunner().invoke(app, ["load-test", "--conversations", "3", "--turns", "4", "--max-tokens", "3",
                                      "--story-chars", "40", "--time-limit", "120", "--recompute", "none",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["recompute"] == "none"
    assert report["errors"] == 0 and report["requests"] == 12 and report["turns_left_out"] == 0
    assert report["generated_tokens"] == 36 and report["generated_tokens_per_s"] > 0 and report["requests_per_s"] > 0
    statuses = report["ttft_by_status"]
    assert set(statuses) == {"none", "applied"}  # every conversation switches at least once
    assert sum(row["requests"] for row in statuses.values()) == 12
    for row in statuses.values():
        assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"]
    assert report["memory"]["peak_rss_bytes"] >= report["memory"]["rss_max_during_run_bytes"] > 0
    assert report["settings"]["schedules"][1] == ["large", "large", "large", "small"]
    assert len(report["requests_log"]) == 12 and report["server_health_after"]["sessions"] == 3


def test_load_test_without_a_session_header_still_hands_over(tiny_cli, tmp_path):
    out = tmp_path / "serve_load.json"
    result = CliRunner().invoke(app, ["load-test", "--conversations", "2", "--turns", "4", "--max-tokens", "3",
                                      "--story-chars", "40", "--time-limit", "120", "--no-session-header",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["session_header"] is False and report["errors"] == 0 and report["requests"] == 8
    assert set(report["ttft_by_status"]) == {"none", "applied"}
    health = report["server_health_after"]
    assert health["sessions"] == 0 and health["prefix_cache"]["bytes"] > 0
    later = [entry for entry in report["requests_log"] if entry["turn"] > 0]
    assert all(entry["handoff"]["read_tokens"] < entry["prompt_tokens"] for entry in later)  # served from caches


def test_load_hostile_sends_every_class_with_chat_and_gets_no_5xx(monkeypatch, tmp_path):
    """Five seconds of the hostile mixed load on the tiny family (a context long enough that n × max_tokens ×
    (1 + top_logprobs) can pass the bound): every class sent, each answered as the server's contract says, no 5xx
    seen by a client nor counted by the server, /health answering 200 throughout."""
    import kvhandoff_lab.cli.measure as measure

    monkeypatch.setattr(measure, "load_family", lambda specs, mapper_dirs, progress=False: tiny_family(AGENT_CONTEXT))
    out = tmp_path / "serve_hostile.json"
    result = CliRunner().invoke(app, ["load-hostile", "--duration", "5", "--read-timeout", "1", "--settle", "0.5",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["five_xx"] == 0 and report["server_five_xx"] == 0
    classes = report["classes"]
    assert list(classes) == list(CLASSES) and all(row["sent"] > 0 for row in classes.values()), classes
    expected = {"chat": {"200"}, "tool_flood": {"400"}, "huge_logprobs": {"200", "400"}, "slow_body": {"408"},
                "half_sent": {"408"}, "disconnect": {"disconnected", "200"}, "bad_utf8": {"400"},
                "deep_json": {"400"}, "long_keys": {"200", "400"}}
    for kind, statuses in expected.items():
        assert set(classes[kind]["statuses"]) <= statuses, (kind, classes[kind])
    assert "disconnected" in classes["disconnect"]["statuses"]
    assert sum(row["sent"] for row in classes.values()) == report["requests"] == sum(report["statuses"].values())
    assert report["served_2xx"] >= classes["chat"]["sent"]
    assert report["server_statuses"]["400"] == report["statuses"]["400"]
    health = report["health"]
    assert health["polls"] > 0 and set(health["statuses"]) == {"200"} and health["p50_s"] <= health["p99_s"]
    memory = report["memory"]
    assert 0 < memory["rss_before_bytes"] <= memory["peak_rss_bytes"]
    assert memory["rss_peak_during_load_bytes"] > 0 and memory["rss_after_settling_bytes"] > 0
    assert "/health over" in result.output and "tool_flood" in result.output


def test_the_hostile_load_is_loopback_only_and_reads_the_servers_counts():
    with pytest.raises(ConfigError, match="this machine only"):
        hostile_over_http("http://192.168.1.2:8000", ["a"])
    with pytest.raises(ConfigError, match="classes"):
        hostile_over_http("http://127.0.0.1:1", ["a"], classes=("chat", "teapot"))
    metrics = ('kvhandoff_requests_total{endpoint="/health",outcome="200"} 3.0\n'
               'kvhandoff_requests_total{endpoint="/v1/chat/completions",outcome="200"} 2.0\n'
               'kvhandoff_requests_total{endpoint="unmatched",outcome="404"} 1.0\n'
               'kvhandoff_requests_created{endpoint="/health",outcome="200"} 1.7e9\n')
    assert server_outcomes(metrics) == {"200": 5, "404": 1}


def test_bench_concurrency_compares_batched_and_one_at_a_time_workers(tiny_cli, tmp_path):
    out = tmp_path / "concurrency.json"
    result = CliRunner().invoke(app, ["bench-concurrency", "--levels", "1,3", "--batches", "1,4", "--turns", "2",
                                      "--max-tokens", "3", "--story-chars", "40", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(row["conversations"], row["max_batch"]) for row in report["rows"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["requests"] == 2 * row["conversations"]
        assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] and row["generated_tokens_per_s"] > 0
    assert "max_batch 1" in result.output


def test_guard_eval_splits_dev_and_heldout_and_reports_each_signal(tiny_cli, tmp_path):
    out = tmp_path / "serve_guard.json"
    result = CliRunner().invoke(app, ["guard-eval", "--conversations", "4", "--turns", "3", "--max-new-tokens", "3",
                                      "--story-chars", "40", "--escalate", "recent:50%", "--recompute", "none",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    guard = json.loads(out.read_text())
    assert guard["settings"]["recompute"] == "none"
    assert guard["n"] == {"conversations_run": 4, "conversations_dev": 2, "conversations_heldout": 2,
                          "handoffs": 8, "changed": 0}  # switching every turn: two handoffs per conversation
    assert set(guard["signals"]) == {"logloss", "kl", "kl_answer", "entropy", "entropy_gain", "mapped_share"}
    assert set(guard["labels"]) == {"answer_changed", "answer_f1_below_0.5", "first_token_kl_above_0.5"}
    assert guard["labels"]["answer_changed"] == guard["signals"] and guard["settings"]["escalate"] == "recent:50%"
    for signal, row in guard["signals"].items():
        assert row["dev"]["handoffs"] == row["heldout"]["handoffs"] == 4
        assert row["auroc_dev"] is None  # an exact mapper never changes an answer: one class only
        assert row["heldout"]["catch_rate"] is None and row["heldout"]["false_fallback_rate"] is not None
        assert signal == "entropy" or row["served_threshold"] == {  # a random tiny model's entropy is above 1
            "threshold": SERVED_THRESHOLD, "catch_rate": None, "false_fallback_rate": 0.0,
            "fallback_rate": 0.0}
        assert {d: v["handoffs"] for d, v in row["by_direction"].items()} == {"large → small": 4, "small → large": 4}
    again = resummarize(guard)  # the stored records give the same numbers again
    assert (again["signals"], again["labels"], again["escalation"]) == (guard["signals"], guard["labels"],
                                                                      guard["escalation"])
    for row in guard["escalation"].values():  # an exact mapper: every strategy serves the re-prefilled answer
        assert row["switches"] == 8
        for strategy in ("none", "fallback", "escalate", "escalate_all"):
            assert row[strategy] == {"mean_f1": 1.0, "changed": 0.0}
    records = guard["records"]
    assert {r["split"] for r in records if r["conversation"] % 2} == {"heldout"}
    assert {(r["from"], r["to"]) for r in records} == {("small", "large"), ("large", "small")}
    assert all(abs(r["scores"]["kl"]) < 1e-3 and r["first_kl"] < 1e-3 and r["answer_f1"] == 1.0 for r in records)
    assert all(r["handed"] == r["own"] == r["escalated"] for r in records)
    result = CliRunner().invoke(app, ["guard-eval", "--heldout-every", "1", "--out", str(out)])
    assert result.exit_code == 2 and "--heldout-every" in result.output
    result = CliRunner().invoke(app, ["guard-eval", "--signals", "vibes", "--out", str(out)])
    assert result.exit_code == 2 and "--signals" in result.output


def test_records_for_several_signals_equal_one_pass_per_signal():
    models, mappers = tiny_family()
    plain = {name: model for name, (model, _) in models.items()}
    conversations = [[("small", list(range(40, 70))), ("large", [5, 6, 7, 8]), ("small", [9, 10, 11])]]
    both = guard_records_by_signal(plain, mappers, conversations, ("logloss", "kl"), max_new_tokens=3)
    for signal in ("logloss", "kl"):
        assert both[signal] == guard_records(plain, mappers, conversations, signal, max_new_tokens=3)
    assert guard_records_by_signal(plain, mappers, conversations, ("kl",), time_limit_s=1e-9) == {"kl": []}
    with pytest.raises(ConfigError, match="guard signal"):
        guard_records_by_signal(plain, mappers, conversations, ("vibes",))


def test_chat_turns_render_the_conversation_the_server_sees():
    tokenizer = tiny_family()[0]["small"][1]
    dialogue = coqa_dialogues(1, min_turns=3)[0]
    turns = chat_turns(tokenizer, dialogue, 3, story_chars=30)
    answers = ["yes", "no"]
    ids = turns[0] + tokenizer(answers[0], add_special_tokens=False)["input_ids"] + turns[1]
    ids += tokenizer(answers[1], add_special_tokens=False)["input_ids"] + turns[2]
    messages = [{"role": "user", "content": f"{dialogue.story[:30]}\n\nQ: {dialogue.turns[0].question}"},
                {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": f"Q: {dialogue.turns[1].question}"},
                {"role": "assistant", "content": answers[1]},
                {"role": "user", "content": f"Q: {dialogue.turns[2].question}"}]
    assert tokenizer.decode(ids) == tokenizer.decode(chat_ids(tokenizer, messages))


def test_schedules_documents_percentiles_and_loopback_only():
    names = ["a", "b"]
    assert schedule(0, 5, names) == ["a", "a", "b", "b", "a"] and schedule(1, 5, names) == ["b", "b", "b", "a", "a"]
    assert switching_schedule(0, 4, names) == ["a", "b", "a", "b"]
    assert switching_schedule(1, 4, names, 2) == ["b", "b", "a", "a"]
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.95) == pytest.approx(1.95)
    assert percentile([], 0.5) is None
    tokenizer = tiny_family()[0]["small"][1]
    text = document(tokenizer, 50, coqa_dialogues(3))
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 50
    assert require_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert require_loopback("http://localhost:1") and require_loopback("http://[::1]:5")
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:80"):
        with pytest.raises(ConfigError, match="this machine only"):
            require_loopback(url)
    with pytest.raises(ConfigError, match="this machine only"):
        asyncio.run(load_over_http("http://192.168.1.2:8000", names))


def test_auroc_interval_brackets_the_auroc_and_needs_both_classes():
    records = [GuardRecord(i, 1, "a", "b", 5, score, bad) for i, (score, bad) in
               enumerate([(0.1, False), (0.2, False), (0.35, True), (0.3, False), (0.8, True), (0.9, True)])]
    low, high = auroc_interval(records, n_resamples=300)
    assert 0.5 < low <= auroc([r.score for r in records], [r.differs for r in records]) <= high <= 1.0
    assert auroc_interval([r for r in records if r.differs]) is None


def test_guard_eval_holds_out_only_what_guard_calibrate_never_measures_on():
    """The lab's held-out conversations (what guard-eval reports on) and the product's dev conversations (what
    `kvhandoff guard-calibrate` chooses thresholds on) never meet, whatever turn count either asks for; the lab's
    dev conversations are the product's."""
    dev = {c.id for c in dev_conversations(120, min_turns=2)}
    for turns in (4, 12):
        dialogues = coqa_dialogues(60, min_turns=turns)
        held = heldout_conversations(dialogues)
        assert 20 <= len(held) <= 40
        assert not {dialogues[i].id for i in held} & dev
        assert {d.id for i, d in enumerate(dialogues) if i not in held} <= dev | {DEMO_STORY_ID}


def test_peak_rss_is_never_below_an_rss_seen():
    """The kernel's high-water mark lags the resident set: a sampled RSS above it is the peak."""
    now = current_rss()
    assert now is not None and peak_rss() >= now
    assert peak_rss([None, 2**50]) == 2**50
