import io
import json

import pytest
from rich.cells import cell_len
from rich.console import Console
from typer.testing import CliRunner

from _serving_support import with_record
from kvhandoff import FitConfig, fit_mapper
from kvhandoff.cli import app
from kvhandoff.cli.demo import render_demo, short_names
from kvhandoff.demo import (
    DEMO_QUESTIONS,
    QUESTION_MAPPED,
    TURN_BOUNDARY,
    Answer,
    DemoResult,
    MapperUse,
    Question,
    Script,
    Switch,
    TurnRecord,
    check_story,
    converse,
    demo_script,
    run_demo,
)
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RecomputeChoice
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE

from conftest import chat_tokenizer, exactly_related, random_batches, tiny_model

#: an exact relation, fitted as exactly as float32 captures allow
EXACT_FIT = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)
QUESTIONS = (Question("Who keeps the bees?", "Ann"), Question("Where is the hive?", "on the hill"),
             Question("What colour is the gate?", "red"))


def story(characters: int) -> str:
    sentences = ("Ann keeps bees on the hill behind the mill. ", "The gate to the hive is red and it squeaks. ",
                 "Every spring her brother Tom helps her carry the honey down. ")
    text = ""
    while len(text) < characters:
        text += sentences[len(text) % len(sentences)]
    return text


def chat_template_tokenizer():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def exact_family():
    """"small" and "large" (an exactly related copy: equal outputs, a different cache), exact mappers both ways."""
    small = tiny_model("qwen2", layers=3, vocab_size=300, seed=3, max_position_embeddings=2048)
    large = exactly_related(small)
    mappers = {("small", "large"): fit_mapper(small, large, random_batches(), EXACT_FIT, progress=False),
               ("large", "small"): fit_mapper(large, small, random_batches(), EXACT_FIT, progress=False)}
    return {"small": small, "large": large}, mappers


def test_the_default_script_asks_about_a_long_coqa_story_what_it_tells():
    script = demo_script()
    assert len(script.questions) == 3 and script.questions == DEMO_QUESTIONS
    assert len(script.story) > 4000  # over 1,000 tokens for the default pair's tokenizer
    for question in script.questions:
        assert question.reference.lower() in script.story.lower()


def test_a_switch_on_an_exact_pair_answers_token_for_token_as_the_re_prefill(exact_family):
    models, mappers = exact_family
    turns, switches = converse(models, mappers, chat_template_tokenizer(), Script("bees", story(400), QUESTIONS),
                               max_new_tokens=5)
    assert [t.model for t in turns] == ["small", "large", "small"] and [t.turn for t in turns] == [1, 2, 3]
    assert [(s.turn, s.source, s.target, s.condition) for s in switches] == [
        (2, "small", "large", TURN_BOUNDARY), (3, "large", "small", TURN_BOUNDARY), (2, "small", "large",
                                                                                     QUESTION_MAPPED)]
    for switch in switches:
        assert switch.handoff.token_ids and switch.same_answer, switch
        assert switch.handoff.text == switch.reprefill.text
        assert switch.handoff.ttft_seconds > 0 and switch.reprefill.ttft_seconds > 0 and switch.speedup > 0
    back, there, paper = switches[1], switches[0], switches[2]
    assert turns[1].answer == there.handoff and turns[2].answer == back.handoff  # the handoffs carry it on
    # the first switch maps the conversation so far; the way back maps only what the small model missed (random
    # models' answers may render to other tokens, which the next turn then reads: counts are checked as sums)
    assert there.mapped_tokens >= turns[0].context_tokens
    assert there.mapped_tokens + there.read_tokens == turns[1].context_tokens
    assert back.mapped_tokens + back.read_tokens == turns[2].context_tokens - there.mapped_tokens
    assert (paper.mapped_tokens, paper.read_tokens) == (turns[1].context_tokens - 1, 1)
    assert paper.reprefill == there.reprefill


def test_bad_scripts_are_refused_before_any_work():
    tokenizer = chat_template_tokenizer()
    with pytest.raises(ConfigError, match="at least 1000"):
        check_story(tokenizer, Script("short", story(300), QUESTIONS))
    assert check_story(tokenizer, Script("long", story(1200), QUESTIONS)) >= 1000
    with pytest.raises(ConfigError, match="two questions"):
        check_story(tokenizer, Script("one", story(1200), QUESTIONS[:1]))
    with pytest.raises(ConfigError, match="chat template"):
        check_story(chat_tokenizer(), Script("plain", story(1200), QUESTIONS))
    with pytest.raises(ConfigError, match="two models"):
        run_demo("same", "same")


@pytest.fixture
def chat_pair(tmp_path, monkeypatch):
    """Two tiny chat models saved as local folders (one tokenizer with a chat template); the demo's script is a
    story of the tiny tokenizer's 1,000+ tokens."""
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("kvhandoff.demo.demo_script", lambda: Script("bees", story(1100), QUESTIONS))
    paths = []
    for name, layers, head_dim, seed in (("small", 2, 16, 0), ("large", 3, 32, 1)):
        path = tmp_path / name
        tiny_model("qwen2", layers=layers, head_dim=head_dim, seed=seed, vocab_size=300).save_pretrained(path)
        chat_template_tokenizer().save_pretrained(path)
        paths.append(str(path))
    return paths


def test_the_command_fits_one_pass_for_both_ways_and_shows_every_switch(chat_pair, tmp_path):
    small, large = chat_pair
    out = tmp_path / "demo.json"
    arguments = ["demo", "--source", small, "--target", large, "--sequences", "2", "--seq-len", "64", "--mix",
                 "prose", "--max-new-tokens", "3"]
    result = CliRunner().invoke(app, [*arguments, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "The conversation" in result.output and "paper's condition" in result.output
    assert result.output.count("fitted now") == 2
    data = json.loads(out.read_text())
    assert [s["condition"] for s in data["switches"]] == [TURN_BOUNDARY, TURN_BOUNDARY, QUESTION_MAPPED]
    assert all(s["speedup"] > 0 and s["handoff"]["token_ids"] for s in data["switches"])
    assert data["story_tokens"] >= 1000 and len(data["turns"]) == 3
    back = Mapper.load(data["mappers"][1]["folder"])
    assert back.manifest["calibration"]["reused_reverse_pass"] is True  # the way back needed no pass of its own
    again = CliRunner().invoke(app, [*arguments, "--reverse", "--json", str(out)])
    assert again.exit_code == 0, again.output
    assert again.output.count("reused") == 2 and "fitted now" not in again.output
    reverse = json.loads(out.read_text())
    assert reverse["source"] == large and reverse["switches"][0]["source"] == large


def test_the_command_refuses_a_short_story_before_fitting(chat_pair, tmp_path, monkeypatch):
    monkeypatch.setattr("kvhandoff.demo.demo_script", lambda: Script("short", story(200), QUESTIONS))
    small, large = chat_pair
    result = CliRunner().invoke(app, ["demo", "--source", small, "--target", large])
    assert result.exit_code == 1 and "error: " in result.output and "at least 1000" in result.output
    assert not (tmp_path / "home" / "pairs").exists()
    result = CliRunner().invoke(app, ["demo", "--mapped", "history"])
    assert result.exit_code == 2 and "--mapped" in result.output


def test_the_models_are_named_by_what_tells_them_apart():
    assert short_names("qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b") == {"qwen2.5-coder:0.5b": "0.5b",
                                                                       "qwen2.5-coder:1.5b": "1.5b"}
    assert short_names("/m/small", "/m/large") == {"/m/small": "small", "/m/large": "large"}
    assert short_names("a", "a:b") == {"a": "a", "a:b": "a:b"}


def recorded_demo() -> DemoResult:
    """A demo result as the default pair prints it (the models' real names, the recorded policy, a long answer and
    one that looks like console markup)."""
    small, large = "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"
    fit = "ridge, k = all, λ = 0.01, exact prefix 4, 120 windows × 512 tokens (prose, exams, math)"
    folder = "/root/.cache/kvhandoff/pairs/qwen2.5-coder_0.5b__qwen2.5-coder_1.5b/mapper-ab45882b5ee0"
    long = ("Henry's two friends are Tom and Joe, who have been coming to the Saturday dance with him ever since "
            "the three of them were boys on the farm [1].")
    up, up_again = Answer("Two", (2,), 2.01), Answer("Two", (2,), 18.67)
    down, down_again = Answer(long, (3, 4), 0.71), Answer("Tom and Joe", (5,), 5.84)
    turns = (TurnRecord(1, small, DEMO_QUESTIONS[0], Answer("Henry", (1,), 1.2), 1045),
             TurnRecord(2, large, DEMO_QUESTIONS[1], up, 1071), TurnRecord(3, small, DEMO_QUESTIONS[2], down, 1090))
    switches = (Switch(2, small, large, TURN_BOUNDARY, 1050, 21, up, up_again, "turn_attention:10%"),
                Switch(3, large, small, TURN_BOUNDARY, 23, 16, down, down_again, "turn_attention:10%"),
                Switch(2, small, large, QUESTION_MAPPED, 1070, 1, Answer("Two", (2,), 1.77), up_again,
                       "turn_attention:10%"))
    return DemoResult(small, large, (MapperUse(small, large, folder, True, fit), MapperUse(large, small, folder,
                                                                                          False, fit)),
                      "CoQA story 34z02eimisdylvztwmit917ni020tb", 1017, turns, switches)


def test_the_demo_reads_in_an_80_column_terminal_without_splitting_a_word():
    result = recorded_demo()
    out = io.StringIO()
    render_demo(result, Console(file=out, width=80, color_system=None))
    lines = out.getvalue().splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    shown = [result.story, *(use.fit for use in result.mappers)]
    for turn in result.turns:
        shown += [turn.question.text, turn.question.reference, turn.answer.text]
    for switch in result.switches:
        shown += [switch.handoff.text, switch.reprefill.text, switch.recompute, QUESTION_MAPPED, "re-prefill",
                  f"{switch.handoff.ttft_seconds:.2f} {switch.reprefill.ttft_seconds:.2f} {switch.speedup:.1f}×"]
    words = {word for text in shown for word in text.split()}
    split = [word for word in words if not any(word in line for line in lines)]
    assert not split, f"words split across lines: {split}"
    text = out.getvalue()
    # what the table reports: every switch's tokens, policy, both times, the speed-up and both answers, same or not
    assert "1,050 mapped (turn_attention:10%), 21 read" in text and "(the paper's condition)" in text
    assert text.count("(the same answer)") == 2 and text.count("(another answer)") == 1
    assert "reused" in text and "fitted now" in text and "[1]." in text  # plain text, never console markup


@pytest.mark.real_models
def test_demo_end_to_end_on_the_real_pair():
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET

    result = run_demo(DEFAULT_SOURCE, DEFAULT_TARGET)
    render_demo(result)
    assert result.story_tokens >= 1000 and len(result.switches) == 3
    assert all(switch.speedup > 1 and switch.handoff.text for switch in result.switches)
    assert "two" in result.turns[1].answer.text.lower()  # the 1.5B, handed the conversation, finds the count


def test_each_switch_runs_under_its_pairs_recorded_policy_and_says_which(exact_family):
    models, mappers = exact_family
    recorded = RecomputeChoice("recent:50%", "fastest_at_min_retention", 0.97, "generative", ("coqa_gen",), "dev",
                               12, 0.98, 2048, 3.0)
    marked = {**mappers, ("small", "large"): with_record(mappers["small", "large"], recompute=recorded)}
    _, switches = converse(models, marked, chat_template_tokenizer(), Script("bees", story(400), QUESTIONS),
                           max_new_tokens=3)
    assert [(s.source, s.recompute) for s in switches] == [("small", "recent:50%"), ("large", "recent:5%"),
                                                            ("small", "recent:50%")]
    _, told = converse(models, marked, chat_template_tokenizer(), Script("bees", story(400), QUESTIONS),
                       max_new_tokens=3, recompute="none")
    assert {s.recompute for s in told} == {"none"}  # a policy named for every pair wins over the record
