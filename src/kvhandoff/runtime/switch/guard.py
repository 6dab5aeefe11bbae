"""The quality guard of a switch: before a mapped cache serves, score it cheaply and act (re-prefill, or hand over
again with a larger recompute budget) when the score says the mapping is degraded.

At a switch the receiving model reads the new turn anyway (on top of the mapped history), so its next-token
distributions at the new turn's positions come for free; the previous model can read the same tokens over its own
cache (a forward pass of the new turn only, then rolled back) for a reference. Signals (`GUARD_SIGNALS`):

- "logloss": the receiving model's mean log-loss on the new turn's tokens minus the previous model's;
- "kl": the mean KL(previous model ‖ receiving model) of the next-token distributions at those positions;
- "kl_answer": that KL at the new turn's last position (the distribution of the answer's first token);
- "entropy": the receiving model's mean next-token entropy at those positions (no reference needed);
- "entropy_gain": that minus the previous model's mean entropy at the same positions over its own cache (how much
  more the turn surprises the receiving model than the one that read the conversation: a turn that is uncertain
  for any model, such as an open question, does not count against the mapping);
- "mapped_share": the share of the conversation's positions before the new turn that this switch maps (no model
  output needed).

The reference signals (`REFERENCE_GUARD_SIGNALS`) cost a forward pass of the new turn's tokens through the previous
model (`SwitchingSession.preview_turn`), next to a re-prefill of the whole conversation by the receiving model;
under a recompute policy that ranks by that same read (`turn_attention`) it serves both. The others cost nothing.
A score above the threshold means: act.

Each ordered pair's `GuardPolicy` is part of its `kvhandoff.runtime.switch.pair.PairPolicy`; how it is measured on
dev conversations (`kvhandoff guard-calibrate`) lives with the calibration (`kvhandoff.serving.calibrate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GuardCalibration, MapperManifest
from kvhandoff.model.cache import kl_divergence
from kvhandoff.runtime import policy
from kvhandoff.runtime.policy import RecomputePolicy

#: the signals a guard can score a mapped cache with (each described above)
GUARD_SIGNALS: tuple[str, ...] = ("logloss", "kl", "kl_answer", "entropy", "entropy_gain", "mapped_share")
#: the signals that need the previous model's reference pass over the new turn
REFERENCE_GUARD_SIGNALS: tuple[str, ...] = ("logloss", "kl", "kl_answer", "entropy_gain")
#: the signal and window of a configured guard (a threshold given without them)
DEFAULT_GUARD_SIGNAL = "entropy"
DEFAULT_GUARD_WINDOW = 64


@dataclass(frozen=True)
class Fallback:
    """What the guard does at a switch it flags: the receiving model re-prefills what it does not hold exactly."""

    spec: ClassVar[str] = "fallback"


@dataclass(frozen=True)
class Escalate:
    """What the guard does at a switch it flags: the handover is taken back and made again with a larger recompute
    budget (``recompute``; the pair's exact prefix stays), and that cache serves."""

    recompute: RecomputePolicy

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, RecomputePolicy):
            raise ConfigError(f"an escalation recomputes under a RecomputePolicy, got {self.recompute!r}")

    @property
    def spec(self) -> str:
        return f"escalate:{self.recompute.spec}"


GuardAction = Fallback | Escalate


def parse_guard_action(spec: str | GuardAction) -> GuardAction:
    """A guard action from its spec, "fallback" or "escalate:RULE:BUDGET" (e.g. "escalate:recent:35%"), or an
    action as it is; ConfigError naming the forms otherwise."""
    if isinstance(spec, Fallback | Escalate):
        return spec
    text = spec.strip() if isinstance(spec, str) else ""
    if text == Fallback.spec:
        return Fallback()
    head, sep, rest = text.partition(":")
    if head == "escalate" and sep and rest:
        return Escalate(policy.parse(rest))
    raise ConfigError(f"guard action must be 'fallback' or 'escalate:RULE:BUDGET' (e.g. 'escalate:recent:35%'), "
                      f"got {spec!r}")



def mean_entropy(logprobs: torch.Tensor) -> float:
    """Mean next-token entropy (nats) of log-probs [k, vocab]."""
    return float(-(logprobs.exp() * logprobs).sum(-1).mean())


def check_signal(signal: str) -> str:
    """``signal`` if it is one of `GUARD_SIGNALS`, else a ConfigError naming them."""
    if signal not in GUARD_SIGNALS:
        raise ConfigError(f"guard signal must be one of {', '.join(GUARD_SIGNALS)}, got {signal!r}")
    return signal


def needs_reference(signal: str) -> bool:
    """Whether ``signal`` scores against the previous model's reference pass over the new turn."""
    return check_signal(signal) in REFERENCE_GUARD_SIGNALS


def guard_score(signal: str, served: torch.Tensor, reference: torch.Tensor | None, ids: Sequence[int],
                mapped_share: float | None = None) -> float | None:
    """The guard's score of a mapped cache (higher: more degraded).

    served / reference: log-probs [k, vocab] of the last k positions of the new turn ``ids`` from the receiving
    model over the mapped history and from the previous model over its own cache (None for a signal that needs no
    reference); mapped_share: the share of the positions before the new turn that were mapped ("mapped_share"
    only). None when the signal has nothing to score ("logloss" needs two positions: k − 1 tokens are predicted
    inside the turn).
    """
    if needs_reference(signal) and reference is None:
        raise ConfigError(f"guard signal {signal!r} needs the previous model's reference log-probs")
    if signal == "mapped_share":
        if mapped_share is None:
            raise ConfigError("guard signal 'mapped_share' needs the share of positions mapped")
        return float(mapped_share)
    if signal == "entropy":
        return mean_entropy(served)
    reference = reference.to(served.device)
    if signal == "entropy_gain":
        return mean_entropy(served) - mean_entropy(reference)
    if signal == "kl":
        return float(kl_divergence(reference, served).mean())
    if signal == "kl_answer":
        return float(kl_divergence(reference[-1:], served[-1:]).mean())
    k = served.shape[0]
    if k < 2:
        return None
    following = torch.tensor(list(ids)[-(k - 1):], device=served.device)[:, None]
    served_loss = -served[:-1].gather(1, following).mean()
    reference_loss = -reference[:-1].gather(1, following).mean()
    return float(served_loss - reference_loss)


# -- a pair's guard ----------------------------------------------------------------------------------------------
#: where a pair's guard comes from: "configured" (`SwitchSettings.guard_threshold`, the same for every pair),
#: "recorded" (the pair's mapper manifest, `kvhandoff guard-calibrate`), "none" (no guard: switches serve mapped)
GUARD_SOURCES = ("recorded", "configured", "none")


@dataclass(frozen=True)
class GuardPolicy:
    """The quality guard of one ordered pair (from → to), as the server applies it at that pair's switches: a
    mapped cache whose ``signal`` score exceeds ``threshold`` (over the new turn's last ``window`` positions) is
    re-prefilled (``action`` a `Fallback`) or handed over again with a larger recompute budget (an `Escalate`).
    source: one of `GUARD_SOURCES`; note: why a pair has no guard, or what to know about its record (None: nothing);
    recorded: the manifest's record the policy came from (source "recorded" only)."""

    source: str
    signal: str | None = None
    threshold: float | None = None
    window: int = DEFAULT_GUARD_WINDOW
    note: str | None = None
    recorded: GuardCalibration | None = None
    action: GuardAction = field(default_factory=Fallback)

    def __post_init__(self) -> None:
        if self.source not in GUARD_SOURCES:
            raise ConfigError(f"a guard's source must be one of {', '.join(GUARD_SOURCES)}, got {self.source!r}")
        if not isinstance(self.action, Fallback | Escalate):
            raise ConfigError(f"a guard's action is a Fallback or an Escalate (parse_guard_action reads a spec), got "
                              f"{self.action!r}")
        if self.active:
            check_signal(self.signal)
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float):
                raise ConfigError(f"a {self.source} guard needs a threshold, got {self.threshold!r}")

    @property
    def active(self) -> bool:
        """Whether this pair's switches are scored (a source other than "none")."""
        return self.source != "none"

    @property
    def needs_reference(self) -> bool:
        return self.active and needs_reference(self.signal)

    def rejects(self, score: float | None) -> bool:
        """Whether a mapped cache with this ``score`` falls back (a switch with nothing to score serves)."""
        return self.active and score is not None and score > self.threshold

    def report(self, score: float | None) -> dict | None:
        """The guard's part of a handoff report (`serving.response_models.GuardInfo`): None when the pair has none."""
        if not self.active:
            return None
        return {"signal": self.signal, "score": score, "threshold": float(self.threshold), "source": self.source}

    def to_dict(self) -> dict:
        """The policy as /health shows it: signal, threshold, window and source (None for a pair without a guard),
        the note, and the record it came from."""
        data = {"source": self.source, "signal": self.signal,
                "threshold": None if self.threshold is None else float(self.threshold),
                "window": self.window if self.active else None, "action": self.action.spec if self.active else None,
                "note": self.note}
        if self.recorded is not None:
            data["recorded"] = self.recorded.to_dict()
        return data

    def describe(self, source: str, target: str) -> str:
        """One line for the server's start-up log."""
        pair = f"{source} → {target}"
        if not self.active:  # the note names the pair
            return self.note or f"no guard for {pair}: switches are served mapped"
        line = f"guard for {pair}: {self.signal} > {self.threshold:.4g} over the new turn's last {self.window} " \
               f"positions → {self.action.spec} ({self.source}"
        if self.recorded is not None:
            record = self.recorded
            auroc = "-" if record.auroc is None else f"{record.auroc:.2f}"
            line += (f": AUROC {auroc} for {record.label} on {record.dev_switches} dev switches, recompute "
                     f"{record.recompute}")
        line += ")"
        return line if self.note is None else f"{line}; {self.note}"


#: what a start-up line says of a pair without a recorded guard
NO_GUARD_HINT = ("run `kvhandoff guard-calibrate` with the server's --models/--mapper to record one, or give "
                 "--guard-threshold (and --guard-signal) for every pair")


def recorded_guard(mapper) -> GuardCalibration | None:
    """The guard recorded in ``mapper``'s manifest (None: none, or a stand-in mapper without a manifest)."""
    manifest = getattr(mapper, "manifest", None)
    return manifest.guard if isinstance(manifest, MapperManifest) else None
