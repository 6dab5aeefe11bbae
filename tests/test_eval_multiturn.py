"""Multi-turn CoQA switching on real conversations with tiny models."""

from __future__ import annotations

import dataclasses

import pytest

from _eval_support import IdentityMapper, NoisyMapper
from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import multiturn as MT

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def conversations():
    convs = MT.load_coqa_conversations(min_turns=10, num_turns=10)
    # the two shortest stories keep byte-level prefill cheap
    return sorted(convs, key=lambda c: len(c.story))[:1]


def test_loading_real_conversations():
    convs = MT.load_coqa_conversations(min_turns=10, num_turns=10)
    assert len(convs) > 100
    assert all(len(c.turns) == 10 for c in convs)
    first = next(c for c in convs if c.id == "3dr23u6we5exclen4th8uq9rb42tel")
    assert first.turns[0].question == "What color was Cotton?"
    assert first.turns[0].answers[0] == "white"
    assert first.turns[1].answers[0] == "in a barn"
    full = MT.load_coqa_conversations(min_turns=10, num_turns=None)
    assert max(len(c.turns) for c in full) > 10
    with pytest.raises(ConfigError):
        MT.load_coqa_conversations(min_turns=5, num_turns=10)


def test_prompt_segments():
    conv = MT.Conversation("c", "Story text.", (MT.Turn("Who?", ("Ann",)), MT.Turn("Where?", ("home",))))
    assert MT.first_segment(conv) == "Story text.\n\nQ: Who?\n\nA:"
    assert MT.next_segment("Ann", "Where?") == " Ann\n\nQ: Where?\n\nA:"
    assert MT.next_segment("", "Where?") == "\n\nQ: Where?\n\nA:"


def test_schedules():
    s = MT.schedules(4, ("small", "large"))
    assert s["switch_small_first"] == ["small", "large", "small", "large"]
    assert s["switch_large_first"] == ["large", "small", "large", "small"]
    assert s["standalone_large"] == ["large"] * 4


def test_identity_handoffs_do_not_drift(conversations):
    model = tiny_model("qwen2", seed=0, **BYTE_MODEL)
    out = MT.multiturn_switching(model, model, IdentityMapper(), IdentityMapper(), TOK, conversations,
                                 max_new_tokens=3)
    assert out["conversations"] == 1 and out["turns"] == 10
    assert set(out["runs"]) == {"standalone_small", "standalone_large", "switch_small_first", "switch_large_first",
                                "switch_small_first_incremental", "switch_large_first_incremental"}
    for run in ("switch_small_first", "switch_large_first", "switch_small_first_incremental"):
        assert out["runs"][run]["f1_vs_standalone_per_turn"] == [1.0] * 10
        assert out["runs"][run]["drift_per_turn"] == [0.0] * 10
    records = out["records"]
    assert records["switch_small_first"][conversations[0].id]["answers"] == \
        records["standalone_small"][conversations[0].id]["answers"]
    assert len(out["runs"]["standalone_small"]["f1_vs_gold_per_turn"]) == 10


def test_switches_hand_over_the_whole_cache(conversations):
    small, large = tiny_model("qwen2", seed=0, **BYTE_MODEL), tiny_model("qwen2", seed=1, **BYTE_MODEL)
    handed: list[int] = []

    class Recording(NoisyMapper):
        def transfer(self, cache, position_ids=None, dtype=None):
            handed.append(cache.get_seq_length())
            return super().transfer(cache)

    conv = dataclasses.replace(conversations[0], turns=conversations[0].turns[:4])
    models = {"small": small, "large": large}
    mappers = {("small", "large"): Recording(scale=1.0), ("large", "small"): Recording(scale=1.0)}
    record = MT.run_conversation(conv, ["small", "large", "small", "large"], models, mappers, TOK, 3)
    assert len(handed) == 3 and len(record["answers"]) == 4
    assert handed == sorted(handed) and handed[0] == len(TOK.encode(MT.first_segment(conv)))
    assert record["servers"] == ["small", "large", "small", "large"]
    standalone = MT.run_conversation(conv, ["small"] * 4, models, mappers, TOK, 3)
    assert record["answers"][0] == standalone["answers"][0]  # no handoff before the first answer
    # incremental: after the first switch, only the turns the returning model missed are mapped
    handed.clear()
    incremental = MT.run_conversation(conv, ["small", "large", "small", "large"], models, mappers, TOK, 3,
                                      handover="incremental")
    turn_lengths = [len(TOK.encode(MT.next_segment(answer, turn.question), add_special_tokens=False))
                    for answer, turn in zip(incremental["answers"], conv.turns[1:], strict=False)]
    assert handed == [handed[0], turn_lengths[0], turn_lengths[1]]
    assert handed[0] == len(TOK.encode(MT.first_segment(conv)))
    with pytest.raises(ConfigError, match="handover"):
        MT.run_conversation(conv, ["small"] * 4, models, mappers, TOK, 3, handover="some")


def test_summary_against_standalone_and_gold():
    conv = MT.Conversation("c", "S", (MT.Turn("q1", ("white",)), MT.Turn("q2", ("in a barn",))))
    runs = {
        "standalone_a": {"c": {"answers": ["white", "in a barn"], "servers": ["a", "a"]}},
        "standalone_b": {"c": {"answers": ["white cat", "barn"], "servers": ["b", "b"]}},
        "switch_a_first": {"c": {"answers": ["white", "barn"], "servers": ["a", "b"]}},
    }
    out = MT.summarise_multiturn([conv], runs, ("a", "b"))
    sw = out["runs"]["switch_a_first"]
    assert sw["f1_vs_standalone_per_turn"] == [1.0, 1.0]  # turn 2 is compared with b's standalone answer
    assert sw["f1_vs_gold_per_turn"] == pytest.approx([1.0, 2 * 1.0 * 0.5 / 1.5])
    assert out["runs"]["standalone_b"]["f1_vs_gold_per_turn"] == pytest.approx([2 * 0.5 / 1.5, 2 * 0.5 / 1.5])


def test_missing_mapper_is_a_config_error(conversations):
    model = tiny_model("qwen2", seed=0, **BYTE_MODEL)
    conv = dataclasses.replace(conversations[0], turns=conversations[0].turns[:2])
    with pytest.raises(ConfigError, match="no mapper"):
        MT.run_conversation(conv, ["a", "b"], {"a": model, "b": model}, {}, TOK, 2)


def test_exact_prefix_patches_every_handoff(conversations):
    model = tiny_model("qwen2", seed=0, **BYTE_MODEL)
    conv = dataclasses.replace(conversations[0], turns=conversations[0].turns[:3])
    models = {"a": model, "b": model}
    mappers = {("a", "b"): NoisyMapper(scale=3.0), ("b", "a"): NoisyMapper(scale=3.0)}
    standalone = MT.run_conversation(conv, ["a"] * 3, models, mappers, TOK, 3)
    # recomputing every position after each handoff gives back the model's own run
    healed = MT.run_conversation(conv, ["a", "b", "a"], models, mappers, TOK, 3, exact_prefix=10**6)
    assert healed["answers"] == standalone["answers"]
