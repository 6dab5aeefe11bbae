import pytest
import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.config import CalibrationSpec
from kvhandoff.demo import agreement, demo_context, mapped_length, run_demo
from kvhandoff.errors import ConfigError, MapperMismatchError
from kvhandoff.model.cache import feed, prefill

from conftest import ByteTokenizer, exactly_related, random_batches, save_tiny_pair, tiny_model


def test_demo_context_is_long_real_coqa_with_an_open_question():
    tok = ByteTokenizer()
    context = demo_context(tok, min_tokens=1000)
    assert len(tok.encode(context.text)) >= 1000 and context.text.endswith("A:")
    assert context.gold_answers
    assert context.text == context.history + context.new_turn and context.history.endswith("\n\n")
    assert context.new_turn.startswith("Q: ") and "\n\nQ: " not in context.new_turn
    ids = tok(context.text)["input_ids"]
    assert mapped_length(tok, context, ids, "all") == len(ids) - 1
    assert mapped_length(tok, context, ids, "history") == len(tok.encode(context.history))
    with pytest.raises(ConfigError, match="history"):
        mapped_length(tok, context, ids, "question")


@pytest.mark.parametrize("mapped", ["all", "history"])
def test_demo_runs_on_a_tiny_pair(tmp_path, monkeypatch, mapped):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    result = run_demo(small, large, FitConfig(), CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose",)),
                      max_new_tokens=3, min_context_tokens=300, progress=False, mapped=mapped)
    assert result["mapped"] == mapped and result["context_tokens"] >= 300
    assert result["mapped_tokens"] + result["target_prefilled_tokens"] == result["context_tokens"]
    new_turn = result["target_prefilled_tokens"]
    assert new_turn == 1 if mapped == "all" else 10 < new_turn < 300
    assert result["handoff_ttft_seconds"] > 0
    positions, top1 = result["agreement_positions"], result["agreement_top1_agreement"]
    assert 1 <= positions <= 3 and top1 * positions == pytest.approx(round(top1 * positions))  # agreeing positions


def test_demo_shows_a_saved_mapper_and_refuses_one_of_another_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    calibration = CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose",))
    first = run_demo(small, large, FitConfig(), calibration, max_new_tokens=2, min_context_tokens=300, progress=False)
    result = run_demo(small, large, FitConfig(), calibration, max_new_tokens=2, min_context_tokens=300,
                      progress=False, mapper_path=first["mapper_dir"])
    assert result["mapper_dir"] == first["mapper_dir"] and result["mapper_reused"]
    with pytest.raises(MapperMismatchError):
        run_demo(large, small, FitConfig(), calibration, max_new_tokens=2, min_context_tokens=300, progress=False,
                 mapper_path=first["mapper_dir"])


def test_agreement_is_perfect_for_an_exact_mapper_and_lower_for_noise():
    source = tiny_model("qwen2", layers=2)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(8), FitConfig(ridge_lambda=1e-6), progress=False)
    ids = torch.randint(0, 128, (1, 30))
    own_cache, _ = prefill(target, ids[:, :-1])
    mapped = mapper.transfer(prefill(source, ids[:, :-1])[0])
    own_first = feed(target, own_cache, ids[0, -1:].tolist())[-1]
    mapped_first = feed(target, mapped, ids[0, -1:].tolist())[-1]
    continuation = torch.randint(0, 128, (6,)).tolist()
    exact = agreement(target, own_cache, mapped, 30, own_first, mapped_first, continuation)
    assert exact["positions"] == 6 and exact["top1_agreement"] == 1.0 and exact["mean_kl"] < 1e-4
    assert own_cache.get_seq_length() == 30  # caches rolled back after scoring
    with torch.inference_mode():  # the mapped cache holds inference tensors
        for layer in mapped.layers:
            layer.values += torch.randn_like(layer.values) * 5
    noisy = agreement(target, own_cache, mapped, 30, own_first, mapped_first, continuation)
    assert noisy["mean_kl"] > exact["mean_kl"]


@pytest.mark.real_models
def test_demo_end_to_end_on_the_real_pair():
    from kvhandoff.demo import render_demo, run_demo
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET

    result = run_demo(DEFAULT_SOURCE, DEFAULT_TARGET)
    render_demo(result)
    assert result["context_tokens"] >= 1000
    assert result["speedup"] > 1
    assert result["answer_handoff"]
    assert 0 <= result["agreement_top1_agreement"] <= 1


def test_demo_with_a_full_recompute_answers_as_the_target_itself(tmp_path, monkeypatch):
    """`--recompute recent:100%`: the target recomputes every mapped position, timed as part of the handoff, so its
    answer agrees with the re-prefill's at every position."""
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    result = run_demo(small, large, FitConfig(), CalibrationSpec(num_sequences=2, seq_len=64, mix=("prose",)),
                      max_new_tokens=3, min_context_tokens=300, progress=False, recompute="recent:100%")
    assert result["recompute"] == "recent:100%"
    assert result["agreement_top1_agreement"] == 1.0 and result["answer_handoff"] == result["answer_reprefill"]
