"""The switch as a runtime step (`kvhandoff.runtime.switch.turn`): a script serves turns of a conversation across a
family with `serve_turn` under the pairs' `PairPolicy`s, no server involved."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from _serving_support import tiny_family
from kvhandoff.runtime.seam import Capabilities
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.pair import SwitchSettings, pair_policies
from kvhandoff.runtime.switch.turn import TurnCancelled, common_prefix, run_steps, serve_turn


def _family(settings: SwitchSettings = SwitchSettings(guard=False)):  # noqa: B008 - frozen
    models, mappers = tiny_family()
    policies = pair_policies(settings, mappers)
    session = SwitchingSession({name: model for name, (model, _) in models.items()}, mappers,
                               pair_plans={pair: policy.plan for pair, policy in policies.items()})
    return models, session, policies


def _prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(models, server: str, prompt: list[int]) -> torch.Tensor:
    model = models[server][0]
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)


def test_a_turn_after_a_switch_is_mapped_and_matches_the_receiving_models_own_read():
    models, session, policies = _family()
    first, second = _prompt(40), _prompt(12, seed=1)
    report, _ = run_steps(serve_turn(session, "small", first, policies))
    assert (report.status, report.source, report.target, report.read_tokens) == ("none", None, "small", 40)
    report, logprobs = run_steps(serve_turn(session, "large", first + second, policies, chunk=5))
    assert (report.status, report.source, report.mapped_tokens) == ("applied", "small", 40)
    assert report.cached_tokens == 40 and report.read_tokens == 12 and report.approximate_tokens == 40
    # the tiny pair is exactly related: the mapped history serves what the large model's own prefill would
    assert torch.allclose(logprobs, _reference(models, "large", first + second), atol=1e-3)
    assert report.to_dict()["from"] == "small" and report.to_dict()["to"] == "large"


def test_each_mode_and_guard_action_serves_the_turn_it_names():
    models, session, policies = _family()
    first, second = _prompt(30), _prompt(8, seed=2)
    run_steps(serve_turn(session, "small", first, policies))
    report, logprobs = run_steps(serve_turn(session, "large", first + second, policies, mode="reprefill"))
    assert (report.status, report.mapped_tokens, report.cached_tokens) == ("reprefill", 0, 0)
    assert torch.allclose(logprobs, _reference(models, "large", first + second), atol=1e-3)
    # a guard that flags every switch: re-prefill, or hand over again under the escalation budget
    for action, status in (("fallback", "fallback"), ("escalate:recent:50%", "escalated")):
        _, session, policies = _family(SwitchSettings(guard_threshold=-1e9, guard_action=action))
        run_steps(serve_turn(session, "small", first, policies))
        report, _ = run_steps(serve_turn(session, "large", first + second, policies))
        assert report.status == status and report.guard["score"] > report.guard["threshold"]


def test_a_cancelled_turn_stops_between_chunks():
    _, session, policies = _family()
    run_steps(serve_turn(session, "small", _prompt(10), policies))
    cancelled = threading.Event()
    steps = serve_turn(session, "small", _prompt(10) + _prompt(30, seed=3), policies, chunk=4, cancelled=cancelled)
    next(steps)
    cancelled.set()
    with pytest.raises(TurnCancelled, match="went away"):
        run_steps(steps)


def test_a_backend_without_the_models_layers_limits_each_pairs_policy():
    _, mappers = tiny_family()
    limited = Capabilities("rowsonly", ("none", "sinks", "recent"))
    policies = pair_policies(SwitchSettings(recompute="recent:10%"), mappers, capabilities=lambda name: limited)
    assert {policy.plan.recompute.spec for policy in policies.values()} == {"recent:10%"}
    with pytest.raises(Exception, match=r"deviation:10%.*a rowsonly target recomputes by the rules none, sinks"):
        pair_policies(SwitchSettings(recompute="deviation:10%"), mappers, capabilities=lambda name: limited)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_the_switch_imports_without_any_front_end():
    """What a vLLM connector or a script imports to decide and serve a switch loads no server, CLI or HTTP code."""
    code = ("import sys, kvhandoff.runtime.switch.turn, kvhandoff.runtime.switch.pair; "
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'typer') "
            "or m.startswith(('kvhandoff.serving', 'kvhandoff.cli'))]; print(loaded); sys.exit(bool(loaded))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
