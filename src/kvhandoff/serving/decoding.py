"""Token-by-token decoding on a session's cache: choosing the next token (greedy, or sampled with temperature and
top-p from a seeded generator), the end-of-text ids, and stop strings in a growing text."""

from __future__ import annotations

import torch


def end_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end an answer: the tokenizer's EOS and every id the model's generation config lists."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if configured is not None:
        ids.update([int(configured)] if isinstance(configured, int) else [int(i) for i in configured])
    return frozenset(ids)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by ``seed`` (None: a fresh random seed)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % 2**63)
    return generator


def choose_token(logprobs: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """The next token from log-probs [vocab]: the argmax when ``temperature`` is 0 (what `generate(do_sample=False)`
    picks), else a sample from softmax(logprobs / temperature) restricted to the smallest set of most likely tokens
    whose probability reaches ``top_p``."""
    if temperature <= 0:
        return int(logprobs.argmax())
    probs = torch.softmax(logprobs.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        sorted_probs[before >= top_p] = 0.0  # keeps at least the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_index(text: str, stops, start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or None."""
    found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops) -> int:
    """Characters at the end of ``text`` to hold back while streaming: an incomplete UTF-8 character (decoded as
    U+FFFD) or the beginning of a stop string, which the next tokens may complete."""
    held = 0
    while held < len(text) and text[len(text) - 1 - held] == "\ufffd":
        held += 1
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                held = max(held, size)
                break
    return held


def greedy_answer(session, server: str, logprobs: torch.Tensor, max_new_tokens: int, stop_ids,
                  feed_last: bool = False) -> list[int]:
    """``server`` answers greedily on ``session`` from ``logprobs`` (the distribution after the conversation so
    far), at most ``max_new_tokens`` tokens, stopping before any of ``stop_ids``. Every answer token but the last is
    fed (cached and appended to the session's tokens); the last too with ``feed_last``."""
    answer: list[int] = []
    for step in range(max_new_tokens):
        token = choose_token(logprobs)
        if token in stop_ids:
            break
        answer.append(token)
        if step + 1 < max_new_tokens or feed_last:
            logprobs = session.read_logprobs(server, [token])[-1]
    return answer
