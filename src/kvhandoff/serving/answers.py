"""A request's answers, token by token on its session's cache, as the model's worker runs them: sampling under the
request's parameters and grammar, stop strings, streaming pieces to the `Generation`, and a cancel that rolls the
session back to what the client received; the echoed prompt with its log-probs."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvhandoff.runtime.seam import new_cache
from kvhandoff.serving.decoding import Sampler, held_back, stop_index
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.requests import GenerationRequest, TokenEntry, token_entry
from kvhandoff.serving.worker import HostedModel, Read

#: prompt positions an echo reads at a time: only one chunk's logits ([chunk, vocab]) are held at once
ECHO_CHUNK = 256


def echo(hosted: HostedModel, request: GenerationRequest, prompt: list[int], chunk: int = ECHO_CHUNK):
    """(the prompt's text, its log-prob entries): each token under the model's distribution after the tokens
    before it; no entries without log-probs. The prompt is read ``chunk`` positions at a time on a cache of its own
    (apart from the session's), so each forward runs only its chunk's positions and only that chunk's logits are
    held, turned into entries, then let go. A generator on the model's worker (see `ModelWorker`): it yields after
    each chunk, so the worker's other requests step meanwhile, and returns the pair."""
    text = request.prompt if isinstance(request.prompt, str) else hosted.tokenizer.decode(prompt)
    if request.logprobs is None:
        return text, []
    entries = [token_entry(hosted.tokenizer, None, prompt[0], 0)]
    cache = new_cache(hosted.model)
    for start in range(0, len(prompt) - 1, chunk):  # the last token's logits are the answer's, not the echo's
        ids = prompt[start : min(start + chunk, len(prompt) - 1)]
        logprobs = cache.read(hosted.model, torch.tensor([ids]), len(ids))[0].float().log_softmax(-1).cpu()
        entries += [token_entry(hosted.tokenizer, logprobs[offset], prompt[start + offset + 1], request.logprobs)
                    for offset in range(len(ids))]
        del logprobs
        yield
    return text, entries


def answers(session, hosted, logprobs, prompt, max_new, request, generation, constraints, metrics: ServingMetrics):
    """Each of the request's answers in turn, from the same distribution after the prompt (the session's cache
    rolled back to the prompt between them); stops early when the client goes away."""
    for index in range(request.choices):
        if index:
            session.truncate(len(prompt))
        params = request.sampling
        if index and params.seed is not None:  # one seed, different answers
            params = replace(params, seed=params.seed + index)
        sampler = Sampler(params, hosted.stop_ids, hosted.vocab_size, prompt)
        constraint = constraints[index] if constraints else None
        if not (yield from answer(session, hosted, logprobs, len(prompt), max_new, request, generation, index,
                                  sampler, constraint, metrics)):
            break


def answer(session, hosted, logprobs, prompt_length, max_new, request, generation, index, sampler, constraint,
           metrics: ServingMetrics):
    """One answer, token by token on the session's cache (a generator yielding each decode step as a `Read`):
    stops at a stop id, a stop string, the end of the grammar, ``max_new`` tokens, or a cancel (then returns
    False, else True)."""
    answer: list[int] = []
    entries: list[TokenEntry] = []
    text, sent, finish = "", 0, "length"
    for step in range(max_new):
        token = sampler.next_token(logprobs, answer, constraint.allowed() if constraint else None)
        if token in sampler.stop_ids:
            finish = "stop"
            break
        if request.logprobs is not None:
            entries.append(token_entry(hosted.tokenizer, logprobs, token, request.logprobs))
        answer.append(token)
        if constraint is not None:
            constraint.accept(token)
        text = hosted.tokenizer.decode(answer, skip_special_tokens=True)
        cut = stop_index(text, request.stop, sent) if request.stop else None
        if cut is not None:
            text, finish = text[:cut], "stop"
            break
        ready = len(text) - held_back(text, request.stop)
        if ready > sent:
            generation.post("delta", index, text[sent:ready], len(answer), entries)
            entries, sent = [], ready
        if generation.cancelled.is_set():
            keep = min(len(session.tokens), prompt_length + generation.delivered[index])
            session.truncate(keep)  # what the client received, no more
            metrics.cancelled.inc()
            generation.post("done", index, "cancelled", len(answer), entries)
            return False
        if constraint is not None and constraint.done():
            finish = "stop"
            break
        if step + 1 < max_new:
            logprobs = yield Read(session, token)  # one decode step, batched with the worker's others
    if len(text) > sent:
        generation.post("delta", index, text[sent:], len(answer), entries)
        entries = []
    generation.post("done", index, finish, len(answer), entries)
    return True
