"""Reuse at another offset (`kvhandoff.runtime.offset`): keys moved to new positions exactly for every rope type, a
run reused after another beginning with every row recomputed equals the re-prefill, less recompute does not, the
beginning is an exact prefix the store can serve, another model's run found by `RunIndex` behind other
instructions is reused as the target would read it, bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from _runtime_support import exact_pair
from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_of
from kvhandoff.runtime.offset import moved_read, reposition_keys, repositioned, reuse_run
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo, history_reliance
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.runs import RunIndex
from kvhandoff.runtime.session import SwitchingSession

from conftest import LLAMA31_ROPE, tiny_model

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": LLAMA31_ROPE,
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
}
OLD_BEGINNING = list(range(10, 47))        # 37 tokens of other instructions
NEW_BEGINNING = list(range(60, 72))        # 12 tokens (the tiny models have 128 token ids)
RUN = [(7 * i + 3) % 120 + 1 for i in range(40)]
NEW_TURN = [5, 9, 33, 2]


def _prefill(model, ids: list[int]):
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=True)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_first_layer_keys_moved_to_the_new_offset_are_the_models_own_there(family, case):
    # layer 0's keys depend on the token and its position alone: moved, they must be what the model computes there
    model = tiny_model(family, head_dim=32, rope_parameters=dict(ROPE_CASES[case]), max_position_embeddings=256)
    old = _prefill(model, OLD_BEGINNING + RUN).past_key_values.layers[0].keys[:, :, len(OLD_BEGINNING):]
    new = _prefill(model, NEW_BEGINNING + RUN).past_key_values.layers[0].keys[:, :, len(NEW_BEGINNING):]
    moved = reposition_keys(old, len(OLD_BEGINNING), len(NEW_BEGINNING), model.config)
    assert torch.allclose(moved, new, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(old, new, atol=1e-3)  # the offset matters: the test can fail
    back = reposition_keys(moved, len(NEW_BEGINNING), len(OLD_BEGINNING), model.config)
    assert torch.allclose(back, old, atol=2e-5, rtol=1e-4)


def test_a_run_reused_with_every_row_recomputed_equals_the_re_prefill():
    model = tiny_model("qwen2", layers=3)
    old_rows = _prefill(model, OLD_BEGINNING + RUN).past_key_values
    run_rows = [(layer.keys[:, :, len(OLD_BEGINNING):], layer.values[:, :, len(OLD_BEGINNING):])
                for layer in old_rows.layers]
    rows = cache_of(run_rows)
    reference = _prefill(model, NEW_BEGINNING + RUN + NEW_TURN)
    expected = reference.logits[:, -1]

    def reused_logits(spec: str) -> torch.Tensor:
        mapped = reuse_run(model, torch.tensor([NEW_BEGINNING]), torch.tensor([RUN]), rows, len(OLD_BEGINNING),
                           HandoffPlan.of(recompute=spec))
        assert mapped.pending.shape[1] == len(NEW_BEGINNING) + round(float(spec.split(":")[1][:-1]) / 100 * len(RUN))
        with torch.inference_mode():
            logits = mapped.read(model, torch.tensor([NEW_TURN]))[:, -1]
        assert mapped.cache.length == len(NEW_BEGINNING) + len(RUN) + len(NEW_TURN)
        return logits, mapped.cache

    everything, cache = reused_logits("recent:100%")
    assert torch.allclose(everything, expected, atol=1e-4)
    own = reference.past_key_values
    for layer, (mine, theirs) in enumerate(zip(cache.export().layers, own.layers, strict=True)):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-4), layer
        assert torch.allclose(mine.values, theirs.values, atol=1e-4), layer
    nothing, _ = reused_logits("recent:0%")
    assert not torch.allclose(nothing, expected, atol=1e-4)  # the old beginning's traces are in the run's rows
    for spec in ("sinks:50%", "blend:50%"):
        half, _ = reused_logits(spec)
        assert (half - expected).abs().max() < (nothing - expected).abs().max(), spec


def test_the_source_read_of_the_new_turn_ranks_the_run_at_its_new_offset():
    """turn_attention at another offset: the source's read of the new turn on the conversation that holds the run,
    moved behind the new beginning (the old beginning's share spread over the new one), picks the run positions it
    attended to most; with every run row picked the reuse is the re-prefill; the session takes the read too."""
    read = torch.tensor([[6.0, 2.0, 1.0, 9.0, 3.0, 7.0]])
    moved = moved_read(read, 2, 4)
    assert torch.equal(moved, torch.tensor([[2.0, 2.0, 2.0, 2.0, 1.0, 9.0, 3.0, 7.0]]))
    assert history_reliance(moved, 4) == history_reliance(read, 2)
    assert torch.equal(moved_read(read, 2, 0), read[:, 2:])
    source, target, mapper = exact_pair()
    held = OLD_BEGINNING + RUN
    source_rows = _prefill(source, held).past_key_values
    mapped = mapper.transfer(source_rows, dtype=torch.float32)
    run_rows = cache_of((layer.keys[:, :, len(OLD_BEGINNING):], layer.values[:, :, len(OLD_BEGINNING):])
                        for layer in mapped.layers)
    attention = torch.rand(1, len(held))
    info = SelectionInfo(source_attention=moved_read(attention, len(OLD_BEGINNING), len(NEW_BEGINNING)))
    picked = reuse_run(target, torch.tensor([NEW_BEGINNING]), torch.tensor([RUN]), run_rows, len(OLD_BEGINNING),
                       HandoffPlan.of(recompute="turn_attention:10%"), info).pending[0, len(NEW_BEGINNING):]
    top = attention[0, len(OLD_BEGINNING):].topk(4).indices.sort().values + len(NEW_BEGINNING)
    assert torch.equal(picked, top)
    session = SwitchingSession({"small": source, "large": target}, {})
    with pytest.raises(ConfigError, match="source_turn_read must be \\[1, 77\\]"):
        session.reuse("large", NEW_BEGINNING, RUN, run_rows, len(OLD_BEGINNING), source="small",
                      plan=HandoffPlan.of(recompute="turn_attention:10%"), source_turn_read=attention[:, 1:])
    session.reuse("large", NEW_BEGINNING, RUN, run_rows, len(OLD_BEGINNING), source="small",
                  plan=HandoffPlan.of(recompute="turn_attention:100%"), source_turn_read=attention)
    logits = session.read_logprobs("large", NEW_TURN)
    expected = _prefill(target, NEW_BEGINNING + RUN + NEW_TURN).logits[0, -1].float().log_softmax(-1)
    assert torch.allclose(logits[-1], expected, atol=1e-4)


def test_a_stored_beginning_is_copied_in_not_recomputed():
    model = tiny_model("qwen2")
    rows = repositioned(_prefill(model, RUN).past_key_values, 0, 0, model.config)
    store = PrefixStore()
    beginning = torch.tensor([NEW_BEGINNING])
    store.remember(model, beginning, _prefill(model, NEW_BEGINNING).past_key_values)
    mapped = reuse_run(model, beginning, torch.tensor([RUN]), rows, 0,
                       HandoffPlan.of(recompute="none", prefix_store=store))
    assert mapped.pending.shape[1] == 0  # the store held the beginning; nothing else recomputed
    stored = _prefill(model, NEW_BEGINNING).past_key_values.layers[0].keys
    assert torch.allclose(mapped.cache.export().layers[0].keys[:, :, : len(NEW_BEGINNING)], stored, atol=1e-6)


def test_bad_inputs_are_refused():
    model = tiny_model("qwen2")
    rows = _prefill(model, RUN).past_key_values
    with pytest.raises(ConfigError, match="run_rows hold 40 positions"):
        reuse_run(model, torch.tensor([NEW_BEGINNING]), torch.tensor([RUN[:-1]]), rows, 0)
    with pytest.raises(ConfigError, match="must be \\[batch, tokens\\]"):
        reuse_run(model, torch.tensor(NEW_BEGINNING), torch.tensor([RUN]), rows, 0)
    with pytest.raises(ConfigError, match="ranks by the source's attention"):
        reuse_run(model, torch.tensor([NEW_BEGINNING]), torch.tensor([RUN]), rows, 0,
                  HandoffPlan.of(recompute="turn_attention:10%"))
    with pytest.raises(ConfigError, match="a read \\[batch, old_start \\+ run\\]"):
        moved_read(torch.ones(1, 5), 5, 3)
    with pytest.raises(ConfigError, match="positions start at 0"):
        reposition_keys(rows.layers[0].keys, -1, 3, model.config)


def test_another_models_run_found_behind_other_instructions_is_reused_as_the_target_would_read_it():
    # the agent handoff end to end on the exactly related pair: the small model's conversation (clerk instructions,
    # then the history) is indexed; the large model's prompt (analyst instructions, the same history, a new turn)
    # finds the history there; its rows, mapped, are reused, every row recomputed: the large model's own read
    source, target, mapper = exact_pair()
    clerk, analyst = [1, *range(20, 50), 2], [1, *range(60, 70), 2]
    history = [1, *RUN, 2, 1, *RUN[::-1], 2]
    held = clerk + history
    runs = RunIndex([1], probe=8, min_length=32)
    runs.add("clerk", held)
    prompt = analyst + history + NEW_TURN
    match = runs.find(prompt)
    assert (match.prompt_start, match.held_start, match.length) == (len(analyst), len(clerk), len(history))
    source_rows = _prefill(source, held).past_key_values
    mapped = mapper.transfer(source_rows, dtype=torch.float32)
    run_rows = cache_of((layer.keys[:, :, match.held_start: match.held_start + match.length],
                         layer.values[:, :, match.held_start: match.held_start + match.length])
                        for layer in mapped.layers)
    start, end = match.prompt_start, match.prompt_start + match.length
    reused = reuse_run(target, torch.tensor([prompt[:start]]), torch.tensor([prompt[start:end]]), run_rows,
                       match.held_start, HandoffPlan.of(recompute="recent:100%"))
    with torch.inference_mode():
        logits = reused.read(target, torch.tensor([prompt[end:]]))[:, -1]
    assert torch.allclose(logits, _prefill(target, prompt).logits[:, -1], atol=1e-4)


def test_a_reused_run_healed_before_its_first_read_becomes_the_prefill():
    # the pending recompute (the beginning) is done first, then every reused row is read again on the model's own
    from kvhandoff.runtime.session import SwitchingSession

    model = tiny_model("qwen2", layers=3)
    old = _prefill(model, OLD_BEGINNING + RUN).past_key_values
    rows = cache_of((layer.keys[:, :, len(OLD_BEGINNING):], layer.values[:, :, len(OLD_BEGINNING):])
                    for layer in old.layers)
    session = SwitchingSession({"m": model}, {}, plan=HandoffPlan.of(recompute="none"))
    reused = session.reuse("m", NEW_BEGINNING, RUN, rows, len(OLD_BEGINNING))
    assert reused.pending and session.own_length("m") == 0
    assert session.heal(limit=30) == 30 and not reused.pending
    assert session.heal() == len(NEW_BEGINNING) + len(RUN) - 30
    with torch.inference_mode():
        got = session.read("m", NEW_TURN)
    expected = _prefill(model, NEW_BEGINNING + RUN + NEW_TURN).logits[0, -1].float().log_softmax(-1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
