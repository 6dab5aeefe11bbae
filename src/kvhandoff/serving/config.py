"""The server's settings: where it listens, its limits, and the quality guard."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.runtime import policy
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.serving.tools import tool_parser

#: signals the serving quality guard can score a mapped cache with (`kvhandoff.serving.guard`): "logloss" — the
#: receiving model's mean log-loss on the new turn over the mapped history minus the previous model's on the same
#: tokens over its own cache; "kl" — the mean KL(previous model ‖ receiving model) of the next-token distributions
#: at the new turn's positions; "kl_answer" — that KL at the last position only (the answer's first token);
#: "entropy" — the receiving model's mean next-token entropy at those positions; "entropy_gain" — that minus the
#: previous model's over the same tokens on its own cache; "mapped_share" — the share of the conversation's
#: positions before the new turn that this switch maps
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


@dataclass(frozen=True)
class ServeConfig:
    """The kvhandoff server (`kvhandoff.serving`): where it listens, its limits, and the quality guard.

    max_sessions: live sessions at once (a new session past it waits up to admission_wait_s seconds for one to end —
    at most max_queue requests wait so — then is refused with 429). drain_timeout_s: at SIGTERM or SIGINT, how long
    running requests may go on (new ones get 503) before they are ended with an error. session_ttl_s: an idle
    session is dropped after this many seconds. cache_memory_bytes: bytes of KV cache held by the sessions and the
    prefix cache together (the copies a running request serving from the prefix cache works on are not counted);
    past it the prefix cache's least recently used leaves go first, then the least recently used idle sessions
    (their next request re-prefills). max_context: tokens a conversation may reach, prompt and answer together
    (None: the smallest `max_position_embeddings` of the hosted models). default_max_tokens: answer length when a
    request names none. max_queue: requests waiting per model worker (past it: 503). max_batch: requests a model
    serves at once (their decode steps share one forward; more wait in its queue). prefill_chunk: tokens a prompt is
    read in at a time, so a long prefill lets running answers step between its chunks (a re-prefill is read whole).
    max_body_bytes: the largest request body read (past it: 413, refused before it is read whole). guard: score a mapped
    cache before it serves and act when the score exceeds the pair's threshold (False: never, for every pair);
    guard_action: what it does then, a `Fallback` (re-prefill) or an `Escalate` (hand over again with a larger recompute
    budget), given as one or as its spec ("fallback", "escalate:recent:35%") and stored parsed, for every pair; None:
    each pair's recorded guard's action, else a fallback. Each ordered pair's guard (`guard.GuardPolicy`): a
    guard_threshold given here is "configured" for every pair (with guard_signal, default `DEFAULT_GUARD_SIGNAL`, and
    guard_window, default `DEFAULT_GUARD_WINDOW`); without one each pair uses the guard recorded in its mapper's
    manifest (`kvhandoff guard-calibrate`) — when a guard_signal or guard_window given here differs from the record's,
    or there is no record, that pair has no guard (its switches serve mapped; said at start-up). api_key: one key or
    several (stored as a tuple); when set, every request but the probes (``/health``, ``/metrics``, while
    ``open_probes``) must carry ``Authorization: Bearer <key>`` with one of them, and each key is a tenant of its own
    (its caches and sessions serve no other key). tool_parser: how tool calls are read out of answers (a name of
    `tools.TOOL_PARSERS`). handover: as in `SwitchingSession`. exact_prefix / recompute: the handoffs' `HandoffPlan`
    (`plan`; exact_prefix None: the mapper's own setting); recompute is a `RecomputePolicy` for every pair, given as
    one or as a spec such as "sinks:10%" and stored parsed; None: each pair's policy recorded with its mapper, else
    `DEFAULT_RECOMPUTE` (`recompute.pair_recomputes`). min_retention / min_speedup: other bounds for every pair's
    recorded policy, which is then chosen again from the trade-off recorded with it
    (`kvhandoff.mapper.manifest.RecomputeChoice.rechosen`; None: the record's own bound); not with recompute.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 256
    session_ttl_s: float = 1800.0
    cache_memory_bytes: int = 4 * 1024**3
    max_context: int | None = None
    default_max_tokens: int = 512
    max_queue: int = 64
    max_body_bytes: int = 8 * 1024**2
    max_batch: int = 16
    prefill_chunk: int = 512
    admission_wait_s: float = 10.0
    drain_timeout_s: float = 30.0
    guard: bool = True
    # None: each pair's recorded guard (`kvhandoff guard-calibrate` measures a pair on its own dev conversations)
    guard_signal: str | None = None
    guard_threshold: float | None = None
    guard_window: int | None = None
    guard_action: GuardAction | str | None = None
    api_key: str | tuple[str, ...] | None = None
    open_probes: bool = True
    tool_parser: str = "hermes"
    handover: str = "incremental"
    exact_prefix: int | None = None
    recompute: RecomputePolicy | str | None = None
    min_retention: float | None = None
    min_speedup: float | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"serve host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve port must be an integer in 0..65535, got {self.port!r}")
        for name in ("max_sessions", "cache_memory_bytes", "default_max_tokens", "max_queue", "max_body_bytes",
                     "max_batch", "prefill_chunk"):
            require_positive(f"serve {name}", getattr(self, name))
        if self.guard_window is not None:
            require_positive("serve guard_window", self.guard_window)
        for name in ("session_ttl_s", "drain_timeout_s"):
            require_positive(f"serve {name}", getattr(self, name), float)
        require_positive("serve admission_wait_s", self.admission_wait_s, float, minimum=0)
        if self.max_context is not None:
            require_positive("serve max_context", self.max_context, minimum=2)
        if not isinstance(self.guard, bool):
            raise ConfigError(f"serve guard must be True or False, got {self.guard!r}")
        if self.guard_signal is not None and self.guard_signal not in GUARD_SIGNALS:
            raise ConfigError(
                f"serve guard_signal must be one of {', '.join(GUARD_SIGNALS)} (or None: the recorded one), got "
                f"{self.guard_signal!r}"
            )
        threshold = self.guard_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or threshold != threshold):
            raise ConfigError(f"serve guard_threshold must be a number (or None: each pair's recorded one), got "
                              f"{threshold!r}")
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key
            if (not isinstance(keys, tuple | list) or not keys
                    or any(not isinstance(key, str) or not key.strip() for key in keys)):
                raise ConfigError("serve api_key must be a non-empty string or several (or None: no key)")
            object.__setattr__(self, "api_key", tuple(keys))
        if not isinstance(self.open_probes, bool):
            raise ConfigError(f"serve open_probes must be True or False, got {self.open_probes!r}")
        tool_parser(self.tool_parser)  # an unknown name is refused, listing the known ones
        if self.handover not in ("all", "incremental"):
            raise ConfigError(f"serve handover must be 'all' or 'incremental', got {self.handover!r}")
        if self.exact_prefix is not None:
            require_positive("serve exact_prefix", self.exact_prefix, minimum=0)
        for name in ("min_retention", "min_speedup"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(require_positive(f"serve {name}", getattr(self, name), float,
                                                                      minimum=0)))
        if self.rechooses_recompute and self.recompute is not None:
            raise ConfigError("serve recompute (--recompute) names one policy for every pair, min_retention / "
                              "min_speedup (--min-retention / --min-speedup) choose each pair's from its recorded "
                              "trade-off: give one or the other")
        # parsed here, once: the engine and its sessions hold the policy object
        if self.recompute is not None:
            object.__setattr__(self, "recompute", policy.parse(self.recompute))
        if self.guard_action is not None:
            object.__setattr__(self, "guard_action", parse_guard_action(self.guard_action))
        if isinstance(self.guard_action, Escalate) and self.handover != "incremental":
            raise ConfigError("serve guard_action 'escalate' needs handover 'incremental' (under 'all' the previous "
                              "model's cache is given away at the switch, so the handover cannot be made again)")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"serve log_level must be a uvicorn log level, got {self.log_level!r}")

    @property
    def rechooses_recompute(self) -> bool:
        """Whether each pair's recorded recompute policy is chosen again under other bounds (min_retention,
        min_speedup)."""
        return self.min_retention is not None or self.min_speedup is not None

    @property
    def served_recompute(self) -> RecomputePolicy:
        """The recompute policy of a pair without a recorded one: the configured one, else `DEFAULT_RECOMPUTE`."""
        return DEFAULT_RECOMPUTE if self.recompute is None else self.recompute

    def plan(self, prefix_store: PrefixStore | None = None) -> HandoffPlan:
        """The handoffs' plan under these settings (`served_recompute`), the exact prefixes kept in
        ``prefix_store``."""
        return HandoffPlan(self.exact_prefix, self.served_recompute, prefix_store)

    def to_dict(self) -> dict:
        """The settings as plain values (the recompute policy as its spec, None: each pair's; the API key never
        written)."""
        keys = f"{len(self.api_key)} set" if self.api_key else None
        recompute = None if self.recompute is None else self.recompute.spec
        action = None if self.guard_action is None else self.guard_action.spec
        return {**asdict(self), "recompute": recompute, "guard_action": action, "api_key": keys}
