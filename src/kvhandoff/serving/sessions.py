"""The server's named sessions: each tenant's conversations by key, admitted under a bound on live sessions (a new
one waits for a slot, then is refused), dropped when idle too long or when the KV cache held passes its memory
bound (`SessionTable`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.requests import RequestError
from kvhandoff.serving.settings import ServeConfig


@dataclass
class SessionState:
    id: tuple[str, str] | None  # (namespace, session key); None: a request served from the prefix cache
    session: SwitchingSession
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    pending: int = 0  # requests admitted and not finished (waiting for the lock or running)
    bytes: int = 0
    # an opaque name of this conversation cache for routers, revealing nothing of the session key
    cache_id: str | None = field(default_factory=lambda: uuid.uuid4().hex)

    def idle(self) -> bool:
        return self.pending == 0 and not self.lock.locked()


class SessionTable:
    """The named sessions, least recently used first, under ``config``'s bounds (max_sessions, session_ttl_s,
    admission_wait_s, max_queue waiting). ``new_session(namespace)`` makes a conversation's `SwitchingSession` in
    that tenant's namespace; ``refuse_if_draining`` raises while the server shuts down; evictions are counted in
    ``metrics``. Use from the event loop."""

    def __init__(self, config: ServeConfig, new_session: Callable[[str], SwitchingSession], metrics: ServingMetrics,
                 refuse_if_draining: Callable[[], None]) -> None:
        self.config, self.new_session, self.metrics = config, new_session, metrics
        self.refuse_if_draining = refuse_if_draining
        self._states: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._waiters: list[asyncio.Future] = []  # requests waiting for a session slot (at most max_queue)

    def __len__(self) -> int:
        return len(self._states)

    def state(self, namespace: str, session_id: str) -> SessionState | None:
        return self._states.get((namespace, session_id))

    def waiting(self) -> int:
        """Requests waiting for a session slot."""
        return len(self._waiters)

    def bytes(self) -> int:
        """Bytes of KV cache the named sessions hold."""
        return sum(state.bytes for state in self._states.values())

    async def admit_waiting(self, session_id: str | None, namespace: str) -> SessionState:
        """`admit`; while every session is busy, wait for one to end (up to ``config.admission_wait_s``, at most
        ``config.max_queue`` requests waiting), then refuse (429)."""
        deadline = time.monotonic() + self.config.admission_wait_s
        while True:
            try:
                return self.admit(session_id, namespace)
            except RequestError as exc:
                left = deadline - time.monotonic()
                if exc.kind != "too_many_sessions" or left <= 0 or len(self._waiters) >= self.config.max_queue:
                    raise
            self.refuse_if_draining()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def admit(self, session_id: str | None, namespace: str) -> SessionState:
        """The state a request of ``session_id`` in ``namespace`` is served on (None: a session of its own, filled
        from the prefix cache); idle sessions past their time to live are dropped first, and the least recently
        used idle one when all slots are taken (`RequestError` "too_many_sessions" when none is idle)."""
        now = time.monotonic()
        for key, state in list(self._states.items()):
            if state.idle() and now - state.last_used > self.config.session_ttl_s:
                self._evict(key, "ttl")
        if session_id is None:
            return SessionState(None, self.new_session(namespace), cache_id=None)
        key = (namespace, session_id)
        state = self._states.get(key)
        if state is None:
            if len(self._states) >= self.config.max_sessions:
                victim = next((k for k, s in self._states.items() if s.idle()), None)
                if victim is None:
                    raise RequestError("too_many_sessions", f"all {self.config.max_sessions} sessions are busy; "
                                       "retry later", code="too_many_sessions")
                self._evict(victim, "sessions")
            state = self._states[key] = SessionState(key, self.new_session(namespace))
        self._states.move_to_end(key)
        state.last_used = now
        return state

    def release(self, state: SessionState) -> None:
        """A request of ``state`` ended: its session is free again, and the requests waiting for a slot try again."""
        state.pending -= 1
        state.last_used = time.monotonic()
        state.lock.release()
        self.wake()

    def wake(self) -> None:
        """A session may have become free: the requests waiting for a slot try again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def trim(self, total: int, limit: int) -> None:
        """Drop the least recently used idle sessions while ``total`` bytes held (theirs among them) pass
        ``limit``."""
        for key, candidate in list(self._states.items()):
            if total <= limit:
                break
            if candidate.idle():
                total -= candidate.bytes
                self._evict(key, "memory")

    def _evict(self, key: tuple[str, str], reason: str) -> None:
        del self._states[key]
        self.metrics.evictions.labels(reason=reason).inc()
