"""The server's settings: where it listens, its limits, its tenants, and what every pair's switches do
(`kvhandoff.runtime.switch.pair.SwitchSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.switch.guard import Escalate
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.tools import tool_parser

#: where a request's left-out sampling fields come from (`ServeConfig.generation_config`; vLLM's values)
GENERATION_CONFIG_SOURCES = ("auto", "vllm")


@dataclass(frozen=True)
class HealSettings:
    """How the server heals: ``budget``, the most positions a model heals after each request it served (of that
    request's conversation; 0: no healing); ``chunk``, the positions read in one forward (how long a new request may
    wait for the worker)."""

    budget: int = 4096
    chunk: int = 256

    def __post_init__(self) -> None:
        require_positive("heal budget", self.budget, minimum=0)
        require_positive("heal chunk", self.chunk)

    @property
    def active(self) -> bool:
        return self.budget > 0

    def to_dict(self) -> dict:
        return {"budget": self.budget, "chunk": self.chunk}


@dataclass(frozen=True)
class ServeConfig:
    """The kvhandoff server (`kvhandoff.serving`): where it listens, its limits, its tenants and its switches.

    max_sessions: live sessions at once (a new session past it waits up to admission_wait_s seconds for one to end —
    at most max_queue requests wait so — then is refused with 429). drain_timeout_s: at SIGTERM or SIGINT, how long
    running requests may go on (new ones get 503) before they are ended with an error. session_ttl_s: an idle
    session is dropped after this many seconds. cache_memory_bytes: bytes of KV cache held by the sessions, the
    prefix cache and the openings store together (the copies a running request serving from the prefix cache works
    on are not counted); past it the prefix cache's least recently used leaves go first, then the least recently
    used idle sessions (their next request re-prefills), then the openings store's least recently used openings.
    max_context: tokens a conversation may reach, prompt and answer together (None: the smallest
    `max_position_embeddings` of the hosted models). default_max_tokens: answer length when a
    request names none. max_queue: requests waiting per model worker (past it: 503). max_batch: requests a model
    serves at once (their decode steps share one forward; more wait in its queue). prefill_chunk: tokens a prompt is
    read in at a time, so a long prefill lets running answers step between its chunks (a re-prefill is read whole).
    max_body_bytes: the largest request body read (past it: 413, refused before it is read whole). read_timeout_s:
    seconds a request's body may take to arrive whole (past it: 408, and the connection is closed). switch: what every
    pair's switches do (`SwitchSettings`: the exact prefix, the recompute policy or the bounds that choose it, the
    quality guard), resolved into each ordered pair's `PairPolicy` when the server starts. api_key: one key or
    several (stored as a tuple); when set, every request must carry ``Authorization: Bearer <key>`` with one of
    them, and each key is a tenant of its own (its caches, sessions and openings serve no other key). open_probes:
    with a key set, ``/health`` and ``/metrics`` answer without one too (``/health`` then shows a caller without a
    key its liveness only, no cache figures); default False: they need a key as every route does. tool_parser: how
    tool calls are read out of answers (a name of `tools.TOOL_PARSERS`). handover: as in `SwitchingSession`.
    generation_config: where a request that leaves sampling fields or max_tokens out gets them, as vLLM's flag of that
    name: "auto", each model's generation config (the fields it sets, `decoding.generation_config_defaults`), then the
    server's own defaults; "vllm": the server's own defaults only (temperature 1, top-p 1, default_max_tokens, ...).
    heal: how a model heals the conversations it served in its idle time (`HealSettings`, `healing`).
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
    read_timeout_s: float = 30.0
    max_batch: int = 16
    prefill_chunk: int = 512
    admission_wait_s: float = 10.0
    drain_timeout_s: float = 30.0
    api_key: str | tuple[str, ...] | None = None
    open_probes: bool = False
    tool_parser: str = "hermes"
    handover: str = "incremental"
    generation_config: str = "auto"
    switch: SwitchSettings = field(default_factory=SwitchSettings)
    heal: HealSettings = field(default_factory=HealSettings)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"serve host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve port must be an integer in 0..65535, got {self.port!r}")
        for name in ("max_sessions", "cache_memory_bytes", "default_max_tokens", "max_queue", "max_body_bytes",
                     "max_batch", "prefill_chunk"):
            require_positive(f"serve {name}", getattr(self, name))
        for name in ("session_ttl_s", "drain_timeout_s", "read_timeout_s"):
            require_positive(f"serve {name}", getattr(self, name), float)
        require_positive("serve admission_wait_s", self.admission_wait_s, float, minimum=0)
        if self.max_context is not None:
            require_positive("serve max_context", self.max_context, minimum=2)
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
        if self.generation_config not in GENERATION_CONFIG_SOURCES:
            raise ConfigError(f"serve generation_config must be one of {', '.join(GENERATION_CONFIG_SOURCES)}, got "
                              f"{self.generation_config!r}")
        if not isinstance(self.switch, SwitchSettings):
            raise ConfigError(f"serve switch must be a SwitchSettings (kvhandoff.runtime.switch.pair), got "
                              f"{self.switch!r}")
        if not isinstance(self.heal, HealSettings):
            raise ConfigError(f"serve heal must be a HealSettings (kvhandoff.serving.settings), got {self.heal!r}")
        if isinstance(self.switch.guard_action, Escalate) and self.handover != "incremental":
            raise ConfigError("serve guard_action 'escalate' needs handover 'incremental' (under 'all' the previous "
                              "model's cache is given away at the switch, so the handover cannot be made again)")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"serve log_level must be a uvicorn log level, got {self.log_level!r}")

    def to_dict(self) -> dict:
        """The settings as plain values, the switch's among them (`SwitchSettings.to_dict`; the API key never
        written)."""
        keys = f"{len(self.api_key)} set" if self.api_key else None
        plain = {item.name: getattr(self, item.name) for item in fields(self) if item.name not in ("switch", "heal")}
        return {**plain, **self.switch.to_dict(), "heal": self.heal.to_dict(), "api_key": keys}
