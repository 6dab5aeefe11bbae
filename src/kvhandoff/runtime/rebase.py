"""A conversation whose beginning changed (another agent's instructions, an edited system prompt) kept at its new
offset: `rebase` finds the longest run of the new prompt that the session already holds after another beginning
(`runs.RunIndex` over the session's own tokens) and, when it is longer than what the prompt shares with the session
as a prefix, starts the session again from that run (`SwitchingSession.reuse`): the rows of the model holding it
(the serving model's own, else the last model's, mapped) moved behind the new beginning, the serving model's own
exact rows of the beginning's start kept, the rest recomputed with the prompt's read (a `turn_attention` plan ranks
the run by the holder's read of the rest of the prompt on what it held, `offset.held_read`), and the prompt's new
turn (its last message) read by the serving model itself, as at any switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvhandoff.model.cache import cache_view
from kvhandoff.runtime.offset import held_read, mapped_run
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.runs import DEFAULT_MIN_RUN, RunIndex
from kvhandoff.runtime.session import ReusedRun, SwitchingSession
from kvhandoff.runtime.switch.turn import common_prefix

logger = logging.getLogger(__name__)

#: the key of the session's own tokens in the one-sequence run index `rebase` builds
_HELD = "session"


def rebase(session: SwitchingSession, server: str, prompt: Sequence[int], anchor_ids: Iterable[int],
           plan: HandoffPlan, min_length: int = DEFAULT_MIN_RUN) -> ReusedRun | None:
    """Start ``session`` again from the run of ``prompt`` it holds at another offset, for ``server`` to read the rest
    under ``plan`` (the offset plan); None (the session as it was) when no run of at least ``min_length`` tokens,
    longer than the prefix ``prompt`` shares with the session, is held by a model that may serve it."""
    tokens, prompt = list(session.tokens), [int(token) for token in prompt]
    shared = common_prefix(tokens, prompt)
    if shared == len(tokens) or len(prompt) < 2:  # the conversation goes on: no held run is longer than the prefix
        return None
    runs = RunIndex(anchor_ids, min_length=min_length)
    runs.add(_HELD, tokens)
    run = runs.find(prompt[:runs.new_turn_start(prompt)])  # the new turn is read by the model itself
    if run is None or run.length <= shared:
        return None
    end = run.held_start + run.length
    holder = server if session.cached_length(server) >= end else session.owner
    if holder is None or session.cached_length(holder) < end or (holder != server
                                                                 and (holder, server) not in session.mappers):
        return None
    read = None
    if plan.recompute.ranks_by_source_turn_read:  # the holder reads the rest of the prompt on what it held
        held_rows = session.export(holder, 0, end)  # exported once: the run is its tail
        read = held_read(session.models[holder], held_rows, prompt[run.prompt_start + run.length:],
                         session.cache_factory)
        rows = cache_view(held_rows, run.held_start, end)
    else:
        rows = session.export(holder, run.held_start, end)
    if holder != server:
        rows = mapped_run(session.mappers[holder, server], rows, run.held_start, dtype=rows.layers[0].keys.dtype)
    known = min(session.own_length(server), shared, run.prompt_start)
    beginning_rows = session.export(server, 0, known) if known else None
    session.truncate(0)
    logger.debug("%s: %d positions of the session reused at another offset (%+d)", server, run.length, run.shift)
    return session.reuse(server, prompt[:run.prompt_start], prompt[run.prompt_start:run.prompt_start + run.length],
                         rows, run.held_start, holder, plan, beginning_rows, read)
