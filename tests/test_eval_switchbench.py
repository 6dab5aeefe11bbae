import json
import time

import pytest

from _eval_support import IdentityMapper, NoisyMapper
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import Recent
from kvhandoff_lab.evaluation import switchbench as B
from kvhandoff_lab.evaluation.switch import SwitchSettings

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def directions():
    small, large = tiny_model(seed=0, **BYTE_MODEL), tiny_model(seed=1, **BYTE_MODEL)  # NoisyMapper keeps the geometry
    return [B.Direction("forward", small, large, NoisyMapper(0.3), "small", "large"),
            B.Direction("reverse", large, small, NoisyMapper(0.3, seed=1), "large", "small")]


def settings(**changes):
    base = dict(tasks=("arc_challenge", "winogrande"), limit=4, pool="dev", histories=2, history_tokens=120,
                exact_prefix=0, ttft_repeats=1, n_resamples=50)
    return SwitchSettings(**{**base, **changes})


def test_recompute_points_put_none_first_once():
    points = B.recompute_points(("recent", "sinks"), (0.0, 0.05, 0.2))
    assert tuple(point.spec for point in points) == ("none", "recent:5%", "recent:20%", "sinks:5%", "sinks:20%")
    assert points[1] == Recent(0.05)


def test_pareto_front_keeps_the_undominated_points():
    points = [{"policy": p, "mean_retention": r, "speedup": {"1024": {"mean": s}}}
              for p, r, s in (("none", 0.8, 10.0), ("a:5%", 0.9, 5.0), ("b:5%", 0.85, 4.0), ("c:50%", 1.0, 1.5))]
    assert B.pareto_front(points, "1024") == ["none", "a:5%", "c:50%"]
    points.append({"policy": "d:1%", "mean_retention": float("nan"), "speedup": {"1024": {"mean": 20.0}}})
    assert B.pareto_front(points, "1024") == ["none", "a:5%", "c:50%"]


def test_benchmark_writes_both_directions_with_retention_and_ttft(directions, tmp_path, monkeypatch):
    made = []

    class Counted(B.HistoryPrefills):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(B, "HistoryPrefills", Counted)
    result = B.run_switch_benchmark(directions, TOK, "bytes", settings(policies=("recent:10%",)), tmp_path)
    assert result["complete"] and result["histories_done"] == 2
    # 2 tasks × 2 histories, each prefilled once by each of the two models for both directions
    assert len(made) == 1 and made[0].prefills == 8
    saved = json.loads((tmp_path / "switch.json").read_text())
    assert set(saved["directions"]) == {"forward", "reverse"}
    task = saved["directions"]["forward"]["tasks"]["winogrande"]
    assert set(task["transfers"]) == {"switch:recent:10%", "all_mapped"} and task["n"] == 4
    assert task["ttft"]["mean"]["speedup"]["switch:recent:10%"] > 0
    assert saved["directions"]["reverse"]["summary"]["switch:recent:10%"]["core"]["tasks"] == 2
    table = (tmp_path / "switch.md").read_text()
    assert "### small → large" in table and "| WinoGrande (recent:10%) | 4 |" in table


def test_identity_switch_retains_everything(tmp_path):
    model = tiny_model(seed=0, **BYTE_MODEL)
    direction = B.Direction("forward", model, model, IdentityMapper(), "m", "m")
    result = B.run_switch_benchmark([direction], TOK, "bytes", settings(ttft_repeats=0, tasks=("arc_challenge",)))
    task = result["directions"]["forward"]["tasks"]["arc_challenge"]
    assert task["transfers"]["switch"]["accuracy"]["value"] == task["accuracy"]["target"]["value"]


def test_sweep_writes_table_plot_and_resumes(directions, tmp_path):
    points = B.recompute_points(("recent", "deviation"), (0.0, 0.2))
    swept = B.run_recompute_sweep(directions, TOK, "bytes", settings(policies=points), tmp_path, lengths=(64, 128))
    assert swept["complete"] and swept["items_per_task"] == 4 and swept["histories_done"] == 2
    assert [p["policy"] for p in swept["points"]] == [point.spec for point in points]  # stored as specs
    point = swept["points"][1]
    assert set(point["speedup"]) == {"64", "128"} and set(point["speedup"]["64"]) == {"forward", "reverse", "mean"}
    assert point["retention"]["forward"]["tasks"] == 2
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"sweep_recompute.{suffix}").stat().st_size > 0
    assert "| recent:20% |" in (tmp_path / "sweep_recompute.md").read_text()
    assert 0 <= point["mean_agreement"] <= 1 and point["mean_choice_kl"] >= 0
    assert point["choice_kl_change"]["forward"]["n"] == 8  # 4 items × 2 core tasks, paired with "none"
    assert swept["points"][0]["choice_kl_change"]["forward"]["value"] == 0.0
    (tmp_path / "sweep_recompute.md").unlink()
    assert B.rewrite_sweep(tmp_path)["points"] == json.loads(json.dumps(swept["points"]))
    assert (tmp_path / "sweep_recompute.md").is_file()
    # more items under a past deadline: the first round stops at its first new item and is kept, as it is
    more = B.run_recompute_sweep(directions, TOK, "bytes", settings(policies=points, limit=6), tmp_path,
                                 lengths=(64,), deadline=time.monotonic() - 1)
    assert not more["complete"] and more["histories_done"] == 1 and more["items_per_task"] == 2
    assert json.loads((tmp_path / "sweep_recompute.json").read_text())["items_per_task"] == 2


def test_resumed_sweep_reuses_its_ttft_unless_the_sweep_changed(directions, tmp_path, monkeypatch):
    small = settings(policies=B.recompute_points(("recent",), (0.0, 0.2)), tasks=("arc_challenge",), histories=1,
                     limit=2)
    first = B.run_recompute_sweep(directions, TOK, "bytes", small, tmp_path, lengths=(64,))

    class Timed(Exception):
        pass

    def timing(*args, **kwargs):
        raise Timed

    monkeypatch.setattr(B, "sweep_ttft", timing)
    again = B.run_recompute_sweep(directions, TOK, "bytes", small, tmp_path, lengths=(64,))
    assert again["ttft"] == json.loads(json.dumps(first["ttft"]))
    with pytest.raises(Timed):  # other lengths: timed again
        B.run_recompute_sweep(directions, TOK, "bytes", small, tmp_path, lengths=(64, 96))
    with pytest.raises(Timed):  # other repeats
        B.run_recompute_sweep(directions, TOK, "bytes", small, tmp_path, lengths=(64,), ttft_repeats=2)


def test_choice_kl_change_pools_the_paired_items_of_a_group():
    def task(group, ours, none):
        return {"group": group, "transfers": {"switch:recent:5%": {"choice_kl": {"per_item": ours}},
                                              "switch": {"choice_kl": {"per_item": none}}}}

    tasks = {"a": task("core", [0.1, 0.0], [0.3, 0.2]), "b": task("core", [0.2], [0.2]),
             "c": task("heldout", [9.0], [0.0])}
    change = B.choice_kl_change(tasks, "switch:recent:5%", "switch", n_resamples=200)
    assert change["n"] == 3 and change["value"] == pytest.approx(-0.4 / 3)
    assert change["ci"][0] <= change["value"] <= change["ci"][1] <= 0
    assert B.choice_kl_change(tasks, "switch:sinks:5%", "switch")["n"] == 0


def test_benchmark_with_generative_tasks_adds_their_table_and_pooled_differences(directions, tmp_path):
    mixed = settings(tasks=("winogrande", "nq_open", "boolq_long"), histories=1, generative_histories=2,
                     policies=("none", "recent:10%"), max_new_tokens={"answer": 3}, all_mapped=False)
    result = B.run_switch_benchmark(directions, TOK, "bytes", mixed, tmp_path)
    assert result["complete"] and result["histories_done"] == 2  # the generative tasks' two slots
    saved = json.loads((tmp_path / "switch.json").read_text())
    assert saved["settings"]["max_new_tokens"] == {"answer": 3, "cot": 256}
    forward = saved["directions"]["forward"]
    assert forward["tasks"]["winogrande"]["ttft"]["per_history"]  # timed in the last round
    pooled = forward["pooled"]["switch:recent:10%"]
    assert pooled["tasks"] == 2 and pooled["n"] == 8 and set(pooled) >= {"minus_target", "minus_source"}
    assert forward["summary"]["switch"]["generative"]["tasks"] == 2
    table = (tmp_path / "switch.md").read_text()
    assert "| WinoGrande | 4 |" in table and "| NQ-open (recent:10%) | exact_match | 4 | 2 |" in table
    assert "| BoolQ, passage in history | acc | 4 |" in table
    assert "| **pooled, generative (2 tasks), recent:10%** | | 8 |" in table
    assert table.count("| Task | Metric |") == 2  # one generative table per direction
    with pytest.raises(ConfigError, match="not both: sweep nq_open, boolq_long apart from winogrande"):
        B.run_recompute_sweep(directions, TOK, "bytes", mixed, tmp_path)


def test_a_sweep_of_the_generative_group_ranks_by_it_and_times_on_a_multiple_choice_history(directions, tmp_path,
                                                                                           monkeypatch):
    timed = []
    real = B.ttft_history

    def history(task, *args):
        timed.append(task)
        return real(task, *args)

    monkeypatch.setattr(B, "ttft_history", history)
    points = B.recompute_points(("recent", "layers"), (0.0, 0.5))
    generative = settings(tasks=("nq_open", "boolq_long"), histories=1, generative_histories=2, policies=points,
                          max_new_tokens={"answer": 3})
    swept = B.run_recompute_sweep(directions, TOK, "bytes", generative, tmp_path, lengths=(64,))
    assert swept["group"] == "generative" and swept["complete"] and swept["histories_done"] == 2
    assert set(timed) == {B.TTFT_TASK}
    point = next(p for p in swept["points"] if p["policy"] == "layers:50%")
    assert point["retention"]["forward"]["tasks"] == 2 and point["speedup"]["64"]["forward"] > 0
    assert point["minus_target"]["forward"]["n"] == 8  # 4 items × 2 tasks, pooled
    assert point["choice_kl_change"]["forward"]["n"] == 8  # the first answer token's KL where a task generates
    table = (tmp_path / "sweep_recompute.md").read_text()
    assert "Items per generative task and direction: 4" in table and "| layers:50% |" in table
    assert B.sweep_group(("arc_challenge", "mmlu")) == "core"


def test_generative_table_alone_and_with_a_stopped_task():
    task = {"display": "CoQA", "group": "generative", "n": 0, "transfers": {}}
    result = {"directions": {"forward": {"source": "s", "target": "t", "tasks": {"coqa_gen": task}}}}
    table = B.switch_markdown(result)
    assert "| CoQA | | 0 |" in table and "| Task | n | History tokens" not in table


def test_choose_recompute_takes_the_fastest_point_that_keeps_the_retention():
    def point(policy, retention, speedup):
        return {"policy": policy, "retention": {"forward": {"mean_retention": retention}},
                "speedup": {"1024": {"forward": 2 * speedup}, "2048": {"forward": speedup}}}

    result = {"ttft_lengths": ["1024", "2048"], "group": "generative", "items_per_task": 24,
              "directions": {"forward": {}}, "settings": {"tasks": ["coqa_gen"], "pool": "dev"},
              "points": [point("none", 0.6, 11.0), point("recent:20%", 0.95, 3.0), point("recent:50%", 0.99, 1.8),
                         point("recent:35%", 0.98, 2.4), point("sinks:5%", float("nan"), 9.0)]}
    chosen = B.choose_recompute(result, "forward")
    assert (chosen.spec, chosen.history_tokens, chosen.speedup, chosen.mean_retention) == ("recent:35%", 2048, 2.4,
                                                                                             0.98)
    assert chosen.group == "generative" and chosen.tasks == ("coqa_gen",) and chosen.items_per_task == 24
    assert B.choose_recompute(result, "forward", 0.9).spec == "recent:20%"
    assert B.choose_recompute(result, "forward", 0.999).spec == "recent:50%"  # none keeps it: the most retentive
    floored = B.choose_recompute(result, "forward", 0.999, min_speedup=2.0)  # the most retentive at 2x or faster
    assert (floored.spec, floored.min_speedup) == ("recent:35%", 2.0)
    # every point with a retention is recorded, so the server can choose again under other bounds
    assert [p.spec for p in floored.tradeoff] == ["none", "recent:20%", "recent:50%", "recent:35%"]
    assert floored.rechosen(min_speedup=0.0).spec == "recent:50%"
    assert B.choose_recompute(result, "forward", length="1024").speedup == 4.8
    with pytest.raises(ConfigError, match="not 4096"):
        B.choose_recompute(result, "forward", length="4096")
    with pytest.raises(ConfigError, match="no direction 'reverse'"):
        B.choose_recompute(result, "reverse")
    assert B.choose_recompute({**result, "points": []}, "forward") is None
