"""Serving one turn of a conversation on a model, switching when another model served it last: the step any front
end calls (the HTTP server's scheduler, a vLLM connector, a script).

`serve_turn` brings a model's cache of a `SwitchingSession` up to a prompt: it rolls every cache back to what the
session and the prompt share, hands the history over when another model holds it (under the pair's `PairPolicy`),
reads the new tokens in chunks, scores the mapped cache with the pair's guard and acts on it (re-prefill, or hand over
again with the escalation budget), and reports what happened (`TurnReport`). It is a generator that yields None
between chunks, so a scheduler can step other requests in between; `run_steps` drives one to its end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.guard import Escalate, guard_score
from kvhandoff.runtime.switch.pair import PairPolicy

#: how a turn may be served at a switch: "auto" (mapped, under the pair's guard), "reprefill" (the receiving model
#: reads the whole conversation again), "exact" (it re-reads what it does not hold exactly; its own earlier turns stay)
TURN_MODES = ("auto", "reprefill", "exact")
#: how a turn's cached positions were found: "prefix" (the conversation's own start), "offset" (a run another
#: conversation holds after another beginning, `SwitchingSession.reuse`), "none" (nothing cached: a prefill)
REUSE_KINDS = ("prefix", "offset", "none")


class TurnCancelled(KVHandoffError):
    """The caller cancelled a turn while its prompt was read (the session is left whole up to the chunk read)."""


@dataclass
class TurnReport:
    """What happened to the conversation's cache before the first token: ``status`` "none" (no switch), "applied"
    (mapped), "escalated" (mapped again with a larger budget), "fallback" (the guard sent it to a re-prefill) or
    "reprefill" (asked for); from ``source`` to ``target``; the positions mapped, read and served from a cache; the
    guard's report (`GuardPolicy.report`); the time it took; the positions served from a cache that are not the
    model's own (mapped rows); ``reuse``: how the cached positions were found (`REUSE_KINDS`)."""

    status: str
    source: str | None
    target: str
    mapped_tokens: int
    read_tokens: int
    cached_tokens: int
    prompt_tokens: int
    guard: dict | None
    milliseconds: float
    approximate_tokens: int = 0
    reuse: str = "none"

    def to_dict(self) -> dict:
        return {"status": self.status, "from": self.source, "to": self.target, "mapped_tokens": self.mapped_tokens,
                "read_tokens": self.read_tokens, "cached_tokens": self.cached_tokens,
                "approximate_tokens": self.approximate_tokens, "prompt_tokens": self.prompt_tokens,
                "guard": self.guard, "milliseconds": self.milliseconds, "reuse": self.reuse}


def common_prefix(first, second) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        n += 1
    return n


Steps = Generator[None, None, tuple[TurnReport, torch.Tensor]]


def serve_turn(session: SwitchingSession, server: str, prompt: Sequence[int],
               policies: Mapping[tuple[str, str], PairPolicy], mode: str = "auto", chunk: int = 512,
               cancelled: threading.Event | None = None) -> Steps:
    """Bring ``server``'s cache of ``session`` up to ``prompt``; returns (`TurnReport`, log-probs of the next token).

    ``policies``: each ordered pair's `PairPolicy` (the guard of a switch to ``server`` is read there; the session's
    own plans hand over). At a switch with ``mode`` "reprefill" the model re-prefills the whole conversation instead
    of mapping; with "exact" it re-reads what it does not hold exactly (its own positions of earlier turns are kept).
    A generator: the new tokens are read ``chunk`` at a time, yielding None between chunks; a ``cancelled`` set
    meanwhile stops it there (`TurnCancelled`). Re-prefills are read in one forward."""
    started = time.perf_counter()
    prompt = list(prompt)
    reused = session.reused
    if reused is not None and reused.pending and reused.server == server:
        if mode != "auto":  # approximate rows serve only "auto": the whole prompt is read instead
            session.truncate(0)
        else:
            return (yield from _serve_reused(session, server, prompt, policies, chunk, cancelled, started))
    common = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
    session.truncate(common)
    new = prompt[common:]
    previous = session.owner
    own_before = session.own_length(server)  # its exact positions of the prompt, before anything is read
    mapped = common - session.cached_length(server) if previous not in (None, server) else 0
    status, source, guard = "none", None, None
    kept = common  # the positions of the prompt served from a cache, not read again
    if mapped > 0 and mode == "reprefill":  # the path without a handoff: the whole conversation read again
        status, source, mapped, kept = "reprefill", previous, 0, 0
        session.tokens += new  # read by the prefill below, with the rest of the conversation
        logprobs = session.reprefill(server, keep_own=False)[None]
    elif mode == "exact" and (mapped > 0 or session.own_length(server) < common):  # nothing mapped serves it
        status, source = ("reprefill", previous) if previous not in (None, server) else ("none", None)
        mapped = 0
        session.tokens += new
        kept = session.reprefill_start(server)
        logprobs = session.reprefill(server)[None]
    elif mapped > 0:
        status, source = "applied", previous
        pair = policies[previous, server]
        policy = pair.guard
        keep = policy.window if policy.active else 1
        # the previous model's read of the turn: the guard's reference and, for a policy ranking by it, the
        # attention that picks the positions to recompute (one forward for both)
        reference, turn_read = (session.preview_turn(server, new, keep) if policy.needs_reference
                                else (None, None))
        logprobs = yield from read_chunked(session, server, new, chunk, keep, cancelled, turn_read=turn_read)
        if policy.active:
            score = guard_score(policy.signal, logprobs, reference, new, mapped / common)
            guard = policy.report(score)
            if policy.rejects(score) and isinstance(policy.action, Escalate):
                session.undo_handover()  # hand over again, recomputing more of what is mapped
                plan = pair.escalated_plan(session.plan_for(previous, server))
                status = "escalated"
                logprobs = yield from read_chunked(session, server, new, chunk, 1, cancelled, plan, turn_read)
            elif policy.rejects(score):  # re-read what the model does not hold exactly (its own turns stay)
                status, kept = "fallback", session.reprefill_start(server)
                logprobs = session.reprefill(server)[None]
    else:
        logprobs = yield from read_chunked(session, server, new, chunk, 1, cancelled)
    approximate = max(0, kept - own_before) if status in ("applied", "escalated", "none") else 0
    report = TurnReport(status, source, server, mapped, len(prompt) - kept, kept, len(prompt), guard,
                        round((time.perf_counter() - started) * 1000, 3), approximate, "prefix" if kept else "none")
    return report, logprobs[-1]


def _serve_reused(session: SwitchingSession, server: str, prompt: list[int],
                  policies: Mapping[tuple[str, str], PairPolicy], chunk: int, cancelled, started: float) -> Steps:
    """`serve_turn` of a session started from a run at another offset (`SwitchingSession.reuse`): the model reads
    the rest of the prompt, recomputing the new beginning and the policy's picks in the first chunk's forward. A run
    mapped from another model is a switch ("applied") under that pair's guard when its signal needs no reference
    pass (the previous model never read this conversation); a rejected one is read whole again ("fallback")."""
    reused = session.reused
    held = reused.beginning + reused.length
    if common_prefix(session.tokens, prompt) < held or len(prompt) <= held:
        raise ConfigError(f"a reused run ends at position {held}: the prompt must hold the session's tokens and at "
                          "least one more")
    switched = reused.source != server
    policy = policies[reused.source, server].guard if switched else None
    guarded = policy is not None and policy.active and not policy.needs_reference
    new = prompt[held:]
    keep = policy.window if guarded else 1
    logprobs = yield from read_chunked(session, server, new, chunk, keep, cancelled)
    status, guard, kept = ("applied" if switched else "none"), None, reused.known + reused.length
    if guarded:
        score = guard_score(policy.signal, logprobs, None, new, reused.length / held)
        guard = policy.report(score)
        if policy.rejects(score):
            status, kept = "fallback", 0
            logprobs = session.reprefill(server)[None]
    report = TurnReport(status, reused.source if switched else None, server, reused.length if switched else 0,
                        len(prompt) - kept, kept, len(prompt), guard, round((time.perf_counter() - started) * 1000, 3),
                        reused.length if kept else 0, "offset" if kept else "none")
    return report, logprobs[-1]


def read_chunked(session: SwitchingSession, server: str, new: list[int], chunk: int, keep: int = 1,
                 cancelled: threading.Event | None = None, plan: HandoffPlan | None = None,
                 turn_read: torch.Tensor | None = None) -> Generator[None, None, torch.Tensor]:
    """``server`` reads ``new`` in chunks of ``chunk`` tokens (the last one holds at least ``keep`` tokens), yielding
    None after each but the last, and stopping there when ``cancelled`` is set; returns the log-probs of the last
    ``keep`` positions. ``plan``: that of a handover the first chunk makes, instead of the pair's; ``turn_read``: the
    previous model's attention while it read ``new`` (`SwitchingSession.preview_turn`), for it."""
    last = min((len(new) - 1) // chunk * chunk, max(0, len(new) - keep))  # where the last chunk starts
    for start in range(0, last, chunk):
        session.read_logprobs(server, new[start:min(start + chunk, last)], 1, upcoming=new[start:], plan=plan,
                              source_turn_read=turn_read)
        yield None
        if cancelled is not None and cancelled.is_set():
            raise TurnCancelled("the client went away while its prompt was read")
    return session.read_logprobs(server, new[last:], keep, upcoming=new[last:], plan=plan,
                                 source_turn_read=turn_read)


def run_steps(steps: Generator):
    """Drive a generator of steps (`serve_turn`) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
