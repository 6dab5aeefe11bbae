"""A model's scheduling worker: one thread per hosted model runs its requests' jobs, batching their decode steps
into one forward and stepping long prompts between them (`ModelWorker`)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.decoding import GenerationDefaults
from kvhandoff.serving.requests import RequestError

logger = logging.getLogger(__name__)

#: what `submit_idle` puts in the queue to wake a worker waiting for work
_WAKE = object()


def _end(job) -> None:
    """``job.close()`` where it has one (its cleanup runs); errors in it are ignored."""
    close = getattr(job, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


@dataclass(frozen=True)
class Read:
    """A running request's next decode step: ``session`` reads ``token`` on the worker's model (what a request's
    job yields; the worker sends back the log-probs of the token after it)."""

    session: SwitchingSession
    token: int


class ModelWorker:
    """One model's compute thread: a scheduler of the requests it serves, fed by a bounded queue.

    A request's job is a callable that returns a generator: it yields a `Read` when it needs a decode step (the
    worker sends back that token's log-probs) and None after each chunk of its prompt (the worker may run others
    meanwhile). Every round the worker takes queued jobs (up to ``max_batch`` held at once), runs one piece of one
    preparing job (its start up to its first chunk, or its next chunk), then one decode step of every job waiting
    for one, all in one forward (``step``: the reads → log-probs [n, vocab]). Concurrent answers so share their
    forwards, and a prompt read in chunks lets running answers step between its chunks (so does an echo's; a
    re-prefill and a guard's reference pass are read whole). A batched step that fails is retried one read at a
    time, so only a request whose own step fails gets the error. Jobs report their own errors; a job that fails
    past them is logged, and the worker goes on. `close` ends the jobs it holds (each generator closed: its cleanup
    runs).

    Idle work (`submit_idle`: a cache's healing) runs only while the worker has nothing else to do: one piece (up to
    the job's next yield) at a time, the queue looked at again before the next, so a new request waits for at most
    one piece. At most ``max_idle`` idle jobs are held; past it the oldest is ended (closed) to make room.
    """

    def __init__(self, name: str, max_queue: int, step=None, max_batch: int = 16, max_idle: int = 64) -> None:
        self.name = name
        self.max_queue, self.max_batch, self._step = max_queue, max_batch, step
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._idle: collections.deque = collections.deque()  # idle jobs, oldest first (appended from any thread)
        self._idle_piece = False  # a piece of an idle job is running (the job is out of the deque meanwhile)
        self.max_idle = max_idle
        self.steps = 0  # decode forwards run
        self.batched_reads = 0  # decode steps they served
        self._thread = threading.Thread(target=self._loop, name=f"kvhandoff-{name}", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise RequestError("overloaded", f"model {self.name!r} has {self.max_queue} requests waiting; retry later",
                               code="overloaded") from None

    def queued(self) -> int:
        return self._jobs.qsize()

    def submit_idle(self, job) -> None:
        """Hold ``job`` to run while the worker is idle (safe from any thread): an iterator, each ``next`` one piece
        of its work, ended early by its ``close`` (a generator's cleanup; called whether it started or not); past
        ``max_idle`` held, the oldest is ended."""
        self._idle.append(job)
        while len(self._idle) > self.max_idle:
            _end(self._idle.popleft())
        with contextlib.suppress(queue.Full):  # a full queue: the worker is busy and looks at the idle jobs later
            self._jobs.put_nowait(_WAKE)

    def idle_jobs(self) -> int:
        """Idle jobs held, the one running a piece among them."""
        return len(self._idle) + self._idle_piece

    @torch.inference_mode()
    def _loop(self) -> None:
        preparing: collections.deque = collections.deque()  # jobs not started, or between two prompt chunks
        decoding: list = []  # (job, Read) waiting for a decode step
        while True:
            while len(preparing) + len(decoding) < self.max_batch:
                try:
                    busy = preparing or decoding or self._idle
                    job = self._jobs.get_nowait() if busy else self._jobs.get()
                except queue.Empty:
                    break
                if job is None:
                    for running in [*preparing, *(running for running, _ in decoding)]:
                        if inspect.isgenerator(running):
                            _end(running)
                    while self._idle:
                        _end(self._idle.popleft())
                    return
                if job is not _WAKE:
                    preparing.append(job)
            if preparing:
                self._resume(preparing.popleft(), None, preparing, decoding)
            elif not decoding and self._idle:
                self._resume_idle()
            if decoding:
                batch, decoding[:] = list(decoding), []
                for (running, _), outcome in zip(batch, self._decode_step([read for _, read in batch]), strict=True):
                    self._resume(running, outcome, preparing, decoding)

    def _decode_step(self, reads: list[Read]) -> list:
        """Each read's log-probs from one batched forward; if that fails, from one forward each (an exception in
        place of the log-probs of a read whose own forward fails)."""
        try:
            rows = list(self._step(reads))
            if len(rows) != len(reads):
                raise RuntimeError(f"a decode step returned {len(rows)} rows for {len(reads)} reads")
            self.steps, self.batched_reads = self.steps + 1, self.batched_reads + len(reads)
            return rows
        except Exception as exc:
            if len(reads) == 1:
                return [exc]
            logger.warning("a batched decode step of %d requests failed (%s: %s); they step one by one", len(reads),
                           type(exc).__name__, exc)
        outcomes = []
        for read in reads:
            try:
                outcomes.append(self._step([read])[0])
                self.steps, self.batched_reads = self.steps + 1, self.batched_reads + 1
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _resume_idle(self) -> None:
        """One piece of the oldest idle job; held again (last) when it yields, dropped when it ends or fails."""
        self._idle_piece = True
        try:
            job = self._idle.popleft()
        except IndexError:
            self._idle_piece = False
            return
        try:
            next(job)
            self._idle.append(job)
        except StopIteration:
            pass
        except Exception:
            logger.exception("idle work failed")
            _end(job)
        finally:
            self._idle_piece = False

    @staticmethod
    def _resume(job, value, preparing, decoding) -> None:
        """Run ``job`` (started first if it is not yet) to its next yield, sending it ``value`` (thrown into it
        when an exception), and file it by what it yielded; a job that ended is dropped."""
        try:
            if not inspect.isgenerator(job):
                job = job()
            wants = job.throw(value) if isinstance(value, BaseException) else job.send(value)
        except StopIteration:
            return
        except Exception:  # a job that failed past its own error handling: logged, the worker goes on
            logger.exception("a request's job failed past its own error handling")
            return
        if wants is None:
            preparing.append(job)
        else:
            decoding.append((job, wants))

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


@dataclass
class HostedModel:
    """A model the server hosts: its name, the model, its tokenizer, the ids that end an answer, its vocabulary
    size, the worker that runs its requests, and what a request that leaves sampling fields or its answer limit out
    gets (`decoding.generation_config_defaults`)."""

    name: str
    model: object
    tokenizer: object
    stop_ids: frozenset[int]
    vocab_size: int
    worker: ModelWorker
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
