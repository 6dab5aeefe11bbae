"""The selective-recompute policy of a handoff: which mapped positions the target recomputes itself."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError

#: selective-recompute rules (`kvhandoff.runtime.recompute`): which mapped positions the target recomputes itself
RECOMPUTE_RULES: tuple[str, ...] = ("none", "sinks", "recent", "deviation", "source_attention", "mix")
#: the budgets (fractions of the mapped history) a retention-vs-speed sweep measures
RECOMPUTE_BUDGETS: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: the default shares of rule "mix"
DEFAULT_RECOMPUTE_MIX: tuple[tuple[str, float], ...] = (("sinks", 0.2), ("recent", 0.3), ("deviation", 0.5))


@dataclass(frozen=True)
class RecomputePolicy:
    """Selective recompute at a handoff (CacheBlend / EPIC): after the cache is mapped, the target runs the tokens
    at a chosen `budget` fraction of the mapped positions through all its layers, at their true positions, and
    their fresh K/V replace the mapped ones (`kvhandoff.runtime.recompute`).

    rule: one of `RECOMPUTE_RULES` — "none"; "sinks" (the first tokens of the context and of every turn);
    "recent" (the last tokens); "deviation" (the tokens whose mapped K/V at the target's layer 0 deviate most
    from the target's own); "source_attention" (the tokens the source's last `window` queries attended to
    most); "mix" (shares of the other rules, `mix`).
    budget: fraction of the mapped positions in [0, 1] (0: nothing recomputed; 1: everything — the target's own
        prefill, at the cost of one).
    mix: (rule, share) pairs of rule "mix" (shares > 0, summing to 1).
    window: how many of the history's last queries "source_attention" reads.
    Written as a spec "RULE:BUDGET" (`parse`, `spec`): "deviation:10%", "recent:0.05", "none",
    "mix(sinks=0.2,recent=0.3,deviation=0.5):10%".
    """

    rule: str = "none"
    budget: float = 0.0
    mix: tuple[tuple[str, float], ...] = DEFAULT_RECOMPUTE_MIX
    window: int = 32

    def __post_init__(self) -> None:
        if self.rule not in RECOMPUTE_RULES:
            raise ConfigError(f"recompute rule must be one of {', '.join(RECOMPUTE_RULES)}, got {self.rule!r}")
        require_positive("recompute budget", self.budget, float, minimum=0)
        if self.budget > 1:
            raise ConfigError(f"recompute budget must be a fraction in [0, 1] of the mapped positions, got "
                              f"{self.budget!r}")
        require_positive("recompute window", self.window)
        mix = tuple((str(rule), float(share)) for rule, share in self.mix)
        object.__setattr__(self, "mix", mix)
        bad = [rule for rule, _ in mix if rule in ("none", "mix") or rule not in RECOMPUTE_RULES]
        if not mix or bad or len({rule for rule, _ in mix}) != len(mix):
            raise ConfigError(f"recompute mix must name distinct rules among "
                              f"{', '.join(RECOMPUTE_RULES[1:-1])}, got {self.mix!r}")
        for rule, share in mix:
            require_positive(f"recompute mix share of {rule}", share, float)
        if abs(sum(share for _, share in mix) - 1) > 1e-6:
            raise ConfigError(f"recompute mix shares must sum to 1, got {self.mix!r}")

    @property
    def active(self) -> bool:
        """Whether a handoff under this policy recomputes anything."""
        return self.rule != "none" and self.budget > 0

    @property
    def rules(self) -> tuple[str, ...]:
        """The rules this policy ranks positions by (the mix's parts for "mix")."""
        return tuple(rule for rule, _ in self.mix) if self.rule == "mix" else (self.rule,)

    @property
    def spec(self) -> str:
        """The policy as a spec string (`parse` reads it back)."""
        if not self.active:
            return "none"
        rule = self.rule
        if rule == "mix" and self.mix != DEFAULT_RECOMPUTE_MIX:
            rule += "(" + ",".join(f"{name}={share:g}" for name, share in self.mix) + ")"
        window = "" if self.window == 32 else f":window={self.window}"
        return f"{rule}:{self.budget * 100:g}%{window}"

    @classmethod
    def parse(cls, spec) -> RecomputePolicy:
        """A policy from a spec "RULE:BUDGET[:window=N]" (budget a fraction "0.1" or a percentage "10%"; rule
        "mix(RULE=SHARE,...)" for other shares; "none" alone), or a policy as it is. ConfigError otherwise."""
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, str):
            raise ConfigError(f"a recompute policy is a spec such as 'deviation:10%', got {spec!r}")
        text = spec.strip()
        if text in ("none", ""):
            return cls()
        head, sep, rest = text.partition(":")
        if not sep:
            raise ConfigError(f"recompute spec {spec!r} must be RULE:BUDGET (e.g. 'deviation:10%', 'recent:0.05') "
                              "or 'none'")
        budget_text, _, option = rest.partition(":")
        kwargs: dict = {}
        if option:
            key, _, value = option.partition("=")
            if key.strip() != "window" or not value.strip().isdigit():
                raise ConfigError(f"recompute spec {spec!r}: the only option is window=N, got {option!r}")
            kwargs["window"] = int(value)
        rule = head.strip()
        if rule.startswith("mix(") and rule.endswith(")"):
            try:
                parts = [part.split("=") for part in rule[4:-1].split(",")]
                kwargs["mix"] = tuple((name.strip(), float(share)) for name, share in parts)
            except ValueError as exc:
                raise ConfigError(f"recompute spec {spec!r}: mix shares are RULE=SHARE,... ({exc})") from exc
            rule = "mix"
        budget_text = budget_text.strip()
        try:
            budget = float(budget_text[:-1]) / 100 if budget_text.endswith("%") else float(budget_text)
        except ValueError as exc:
            raise ConfigError(f"recompute spec {spec!r}: the budget must be a fraction or a percentage, got "
                              f"{budget_text!r}") from exc
        return cls(rule=rule, budget=budget, **kwargs)


#: the handoffs' default selective-recompute policy (`FitConfig.recompute`): the target recomputes the last 5% of
#: the mapped positions. Chosen on the switch benchmark's dev pool (docs/RESULTS.md "Switch benchmark"): it lowered
#: the choice KL to the target alone in both directions and keeps ≥ 5× (small → large) and ≥ 2.5× (large → small)
#: of the speed-up at 2K tokens of history.
DEFAULT_RECOMPUTE = "recent:5%"
