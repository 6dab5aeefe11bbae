"""A cache that heals in the server's idle time (`Healer`): after a request, the model that served it reads the
approximate rows of that conversation again (mapped for it, or computed on top of mapped ones) on its own exact
rows, so the turns after a switch run on the model's own cache.

The work is idle work on the model's worker (`ModelWorker.submit_idle`): chunks of ``HealSettings.chunk``
positions, run only while the worker has nothing else to do, so a new request waits for one chunk at most; at most
``HealSettings.budget`` positions after each request. A named session is healed holding its lock (lent: a request
for it waits for the chunk in progress, and the healing stops there); a conversation of the prefix cache is healed
through the tree (`PrefixCache.heal`: its exact rows copied out, the healed ones kept as exact in place of the
approximate ones). Counted in ``kvhandoff_healed_positions_total`` and ``kvhandoff_heal_seconds_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.prefix_cache import PrefixCache
from kvhandoff.serving.sessions import SessionState, SessionTable
from kvhandoff.serving.settings import HealSettings
from kvhandoff.serving.worker import HostedModel


class _Lent:
    """An idle job that holds a session's lock: ``release`` is called once, when the job ends, fails or is closed,
    whether it started or not."""

    def __init__(self, job: Iterator, release: Callable[[], None]) -> None:
        self._job, self._release = job, release

    def __iter__(self) -> _Lent:
        return self

    def __next__(self):
        try:
            return next(self._job)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            try:
                close = getattr(self._job, "close", None)
                if callable(close):
                    close()
            finally:
                release()


class Healer:
    """Queues the healing of each served conversation on its model's worker (see the module docstring).
    ``new_session(namespace)``: a fresh conversation of that tenant (the prefix cache's healing reads on one)."""

    def __init__(self, settings: HealSettings, metrics: ServingMetrics, prefix_cache: PrefixCache,
                 sessions: SessionTable, new_session: Callable[[str], SwitchingSession]) -> None:
        self.settings, self.metrics, self.prefix_cache = settings, metrics, prefix_cache
        self.sessions, self.new_session = sessions, new_session
        self._lending: dict[str, int] = {}  # per model: named sessions whose lock is being taken for healing

    def status(self, hosted: dict[str, HostedModel]) -> dict:
        """The settings and, per model, the conversations waiting to be healed (or healing)."""
        return {**self.settings.to_dict(), "waiting": {name: model.worker.idle_jobs() + self._lending.get(name, 0)
                                                      for name, model in hosted.items()}}

    def after(self, state: SessionState, hosted: HostedModel, namespace: str, tokens: list[int]) -> None:
        """A request of ``state`` served by ``hosted`` ended (event loop): heal its conversation (a prefix-cache
        request's: ``tokens`` in ``namespace``, as kept) when the model holds approximate rows of it."""
        session = state.session
        if not self.settings.active or session.own_length(hosted.name) >= session.cached_length(hosted.name):
            return  # nothing approximate to heal
        if state.id is None:
            if tokens:
                hosted.worker.submit_idle(self._heal_kept(hosted.name, namespace, tokens))
            return
        if state.idle():
            self._lending[hosted.name] = self._lending.get(hosted.name, 0) + 1
            asyncio.get_running_loop().create_task(self._lend(state, hosted))

    async def _lend(self, state: SessionState, hosted: HostedModel) -> None:
        """Take the idle session's lock and heal it on the model's worker; the lock is given back when it ends."""
        try:
            if state.idle():
                await self._lent(state, hosted)
        finally:
            self._lending[hosted.name] -= 1

    async def _lent(self, state: SessionState, hosted: HostedModel) -> None:
        await state.lock.acquire()
        if state.pending:  # a request came first: it waits for the lock, and needs no healing now
            self._give_back(state)
            return
        loop = asyncio.get_running_loop()

        def release() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                loop.call_soon_threadsafe(self._give_back, state)

        job = self._chunks(hosted.name, lambda limit: state.session.heal(hosted.name, limit),
                           lambda: state.pending > 0 or self.sessions.waiting() > 0)
        hosted.worker.submit_idle(_Lent(job, release))

    def _give_back(self, state: SessionState) -> None:
        state.lock.release()
        self.sessions.wake()

    def _heal_kept(self, model: str, namespace: str, tokens: list[int]) -> Iterator[None]:
        return self._chunks(model, lambda limit: self.prefix_cache.heal(namespace, tokens, model,
                                                                        self.new_session(namespace), limit))

    def _chunks(self, model: str, heal: Callable[[int], int],
                interrupted: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """``heal(limit)`` a chunk at a time until nothing is left, the budget is spent or ``interrupted()``."""
        left = self.settings.budget
        while left > 0 and not interrupted():
            begin = time.perf_counter()
            healed = heal(min(self.settings.chunk, left))
            if not healed:
                return
            self.metrics.record_heal(model, healed, time.perf_counter() - begin)
            left -= healed
            yield
