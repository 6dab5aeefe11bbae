import math

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import switchguard as G

# two tasks, hand-made: the served switch loses where the guard's entropy is high
COQA = G.GuardedTask(served=(0.0, 1.0, 0.2, 1.0), guard=(3.0, 1.0, 2.5, 0.5), flagged=(1.0, 1.0, 0.8, 1.0),
                     target=(1.0, 1.0, 1.0, 1.0), source=(0.5, 0.5, 0.5, 0.5))
NQ = G.GuardedTask(served=(1.0, 0.0), guard=(0.2, 2.8), flagged=(1.0, 0.0), target=(1.0, 0.0),
                   source=(0.0, 0.0))
COSTS = G.GuardCosts(served=4.0, flagged=32.0, reprefill=32.0)


def test_a_guarded_task_serves_the_flagged_condition_above_the_threshold():
    assert COQA.scores(2.0) == [1.0, 1.0, 0.8, 1.0] and COQA.flagged_count(2.0) == 2
    assert COQA.scores(math.inf) == list(COQA.served) and COQA.flagged_count(math.inf) == 0
    assert COQA.scores(2.5) == [1.0, 1.0, 0.2, 1.0]  # a score equal to the threshold is served


def test_costs_give_the_mean_speedup_at_a_flagged_share():
    assert COSTS.speedup(0.0) == 8.0
    assert COSTS.speedup(0.25) == pytest.approx(32 / 12)  # a flagged switch pays the switch and the re-prefill


def test_a_row_pools_the_flagged_share_and_averages_retention_over_tasks():
    row = G.guard_row({"coqa": COQA, "nq": NQ}, COSTS, 2.0)
    assert row.flagged_share == pytest.approx(3 / 6)
    assert row.scores == pytest.approx({"coqa": 0.95, "nq": 0.5})
    assert row.retention == pytest.approx({"coqa": 0.95, "nq": 1.0})
    assert row.mean_retention == pytest.approx(0.975)
    assert row.lowest_minus_source == pytest.approx(0.45)
    assert row.speedup == pytest.approx(32 / (4 + 0.5 * 32))


def test_the_table_runs_from_flagging_all_to_none_and_the_choice_keeps_the_speedup():
    rows = G.guard_table({"coqa": COQA, "nq": NQ}, COSTS)
    assert [row.flagged_share for row in rows] == pytest.approx([1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0, 0])
    assert rows[-1].threshold == math.inf and rows[-1].speedup == 8.0
    chosen = G.choose_threshold(rows, 2.5)
    # the best retention at ≥ 2.5×: flag only the highest score (3.0), which CoQA's first item lost
    assert chosen.threshold == 2.8 and chosen.flagged_share == pytest.approx(1 / 6)
    assert G.choose_threshold(rows, 9.0) is None
    assert G.choose_threshold(rows, 1.0).mean_retention == pytest.approx(0.975)


def test_the_report_differences_are_paired_per_task_and_pooled():
    report = G.guarded_report({"coqa": COQA, "nq": NQ}, COSTS, 2.0, n_resamples=200)
    coqa = report["tasks"]["coqa"]
    assert coqa["n"] == 4 and coqa["flagged"] == 2 and coqa["score"] == pytest.approx(0.95)
    assert coqa["minus_target"]["value"] == pytest.approx(-0.05)
    assert coqa["minus_unguarded"]["value"] == pytest.approx(0.95 - 0.55)
    pooled = report["tasks"]["pooled"]
    assert pooled["n"] == 6 and pooled["minus_source"]["value"] == pytest.approx((3.8 + 1.0) / 6 - 2.0 / 6)
    assert report["row"]["threshold"] == 2.0


def test_runs_without_guard_scores_or_conditions_are_refused_with_the_fix():
    entry = {"scores": {"switch:turn_attention:5%": [1.0], "target": [1.0], "source": [0.0]}}
    with pytest.raises(ConfigError, match=r"switch:recent:35%.*--recompute"):
        G.guarded_task(entry, "switch:turn_attention:5%", "switch:recent:35%")
    with pytest.raises(ConfigError, match="fresh --out"):
        G.guarded_task(entry, "switch:turn_attention:5%", "target")
    entry["guard_entropy"] = {"switch:turn_attention:5%": [1.5]}
    task = G.guarded_task(entry, "switch:turn_attention:5%", "target")
    assert task.guard == (1.5,) and task.flagged == (1.0,)
    with pytest.raises(ConfigError, match="source records carry no 'entropy_gain' guard score"):
        G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="entropy_gain")
    with pytest.raises(ConfigError, match=r"turn_attention:5% records carry no 'kl' guard score.*fresh --out"):
        G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="kl")
    with pytest.raises(ConfigError, match="logloss, kl, kl_answer, entropy, entropy_gain"):
        G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="mapped_share")
    with pytest.raises(ConfigError, match="no scored items"):
        G.guard_row({}, COSTS, 1.0)


def test_the_served_switchs_recorded_guard_scores_come_before_its_entropy():
    entry = {"scores": {"switch:turn_attention:5%": [1.0, 0.0], "target": [1.0, 1.0], "source": [0.0, 0.0]},
             "guard_entropy": {"switch:turn_attention:5%": [1.5, 0.5], "source": [1.0, 1.0]},
             "guard_scores": {"switch:turn_attention:5%": {"logloss": [0.1, 0.9], "entropy": [1.4, 0.6]}}}
    assert G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="logloss").guard == (0.1, 0.9)
    assert G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="entropy").guard == (1.4, 0.6)
    # a signal the record lacks comes from the entropies where it can
    assert G.guarded_task(entry, "switch:turn_attention:5%", "target", signal="entropy_gain").guard == (0.5, -0.5)


def test_costs_come_from_a_ttft_measurement_with_the_reprefill_as_the_target():
    seconds = {"reprefill": 32.0, "switch:turn_attention:5%": 4.0, "switch:recent:35%": 14.0}
    assert G.guard_costs(seconds, "switch:turn_attention:5%", "target") == G.GuardCosts(4.0, 32.0, 32.0)
    assert G.guard_costs(seconds, "switch:turn_attention:5%", "switch:recent:35%").flagged == 14.0
    with pytest.raises(ConfigError, match=r"switch:recent:50%.*--ttft-repeats"):
        G.guard_costs(seconds, "switch:turn_attention:5%", "switch:recent:50%")
    relative = G.guard_costs(seconds, "switch:turn_attention:5%", "target", reference=0.5)
    assert relative.speedup(0.0) == pytest.approx(32 / 4.5)  # the reference pass at every switch
    with pytest.raises(ConfigError, match="guard_reference_seconds"):
        G.guard_costs(seconds, "switch:turn_attention:5%", "target", reference=None)


def test_the_separation_counts_the_switches_below_the_target_alone():
    got = G.guard_separation({"coqa": COQA, "nq": NQ}, 2.0)
    # bad: CoQA's items 0 and 2 (below the target's 1.0); NQ's none
    assert (got["switches"], got["bad"]) == (6, 2)
    assert got["catch_rate"] == 1.0 and got["false_fallback_rate"] == pytest.approx(1 / 4)  # NQ's 2.8 flagged
    assert got["auroc"] == pytest.approx((4 + 3) / 8)  # 3.0 beats all four; 2.5 all but 2.8


def test_the_entropy_gain_discounts_the_sources_own_entropy_over_the_turn():
    entry = {"scores": {"switch": [1.0, 0.0], "target": [1.0, 1.0], "source": [0.0, 0.0]},
             "guard_entropy": {"switch": [2.5, 1.5], "source": [2.75, 0.5]}}
    assert G.guarded_task(entry, "switch", "target").guard == (2.5, 1.5)
    task = G.guarded_task(entry, "switch", "target", signal="entropy_gain")
    assert task.guard == pytest.approx((-0.25, 1.0))
    assert task.scores(0.0) == [1.0, 1.0]  # only the switch more surprised than the source is flagged
