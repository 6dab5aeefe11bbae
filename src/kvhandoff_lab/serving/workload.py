"""Real text for the serving measurements: CoQA conversations (stories with their questions; held out from
calibration, as in `kvhandoff.demo`) and documents of an exact token length cut from its stories."""

from __future__ import annotations

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation.multiturn import Conversation, load_coqa_conversations


def coqa_dialogues(count: int | None = None, min_turns: int = 5) -> list[Conversation]:
    """CoQA validation conversations with at least ``min_turns`` questions, in a fixed order (by id); the first
    ``count`` (None: all)."""
    conversations = sorted(load_coqa_conversations(min_turns=min_turns, num_turns=None), key=lambda c: c.id)
    if count is not None and len(conversations) < count:
        raise ConfigError(f"conversations: CoQA has {len(conversations)} with {min_turns}+ turns, asked for {count}")
    return conversations if count is None else conversations[:count]


def document(tokenizer, tokens: int, conversations: list[Conversation]) -> str:
    """Real prose of ``tokens`` tokens (as ``tokenizer`` counts them without special tokens): the stories of
    ``conversations`` one after another, cut there."""
    if tokens < 1:
        raise ConfigError(f"document length must be positive, got {tokens}")
    ids: list[int] = []
    for conversation in conversations:
        ids += tokenizer(conversation.story + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])
    raise ConfigError(f"the stories hold {len(ids)} tokens, fewer than {tokens}")
