"""Shared pieces of the serving tests: an exactly related tiny pair hosted as "small" and "large" with exact mappers
both ways, a server on a free loopback port, and reference answers computed without the server."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
import time

import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import HealSettings, ServeConfig

from conftest import chat_tokenizer, exactly_related, random_batches, tiny_model

#: an exact relation, fitted as exactly as float32 captures allow
EXACT_FIT = FitConfig(top_k="all", ridge_lambda=1e-10, token_stride=1)
#: the tiny models' vocabulary (the chat tokenizer's 259 ids fit)
VOCAB = 300
#: a context that holds tool schemas rendered byte by byte
AGENT_CONTEXT = 4096


@functools.cache
def tiny_family(max_position_embeddings: int = 512):
    """(models, mappers): "small" and "large" (an exactly related copy: equal outputs, a different cache) with the
    chat tokenizer, and exact mappers both ways. Cached: build once per test process (do not mutate). The default
    context is short enough that over-long prompts are cheap to send; tool schemas in a prompt need a longer one
    (`AGENT_CONTEXT`)."""
    small = tiny_model("qwen2", layers=3, vocab_size=VOCAB, seed=3, max_position_embeddings=max_position_embeddings)
    large = exactly_related(small)
    forward = fit_mapper(small, large, random_batches(), EXACT_FIT, progress=False)
    backward = fit_mapper(large, small, random_batches(), EXACT_FIT, progress=False)
    tokenizer = chat_tokenizer()
    return ({"small": (small, tokenizer), "large": (large, tokenizer)},
            {("small", "large"): forward, ("large", "small"): backward})


def with_record(mapper, **records):
    """A shallow copy of ``mapper`` (the shared tiny family's are never changed) whose manifest carries ``records``
    (guard=..., recompute=...)."""
    copied = copy.copy(mapper)
    copied.manifest = dataclasses.replace(mapper.manifest, **records)
    return copied


@contextlib.contextmanager
def running(models=None, mappers=None, **settings):
    """A server of the tiny family (or the given models/mappers) on a free 127.0.0.1 port; yields it (`.url`,
    `.engine`); shut down afterwards. ``settings``: `ServeConfig`'s and `SwitchSettings`' fields (the guard and
    healing off unless given: a test of what a switch leaves sees it before idle time heals it)."""
    if models is None:
        models, mappers = tiny_family()
    switch_fields = {item.name for item in dataclasses.fields(SwitchSettings)}
    switch = SwitchSettings(**{"guard": False, **{k: v for k, v in settings.items() if k in switch_fields}})
    served = {"heal": HealSettings(0), **{k: v for k, v in settings.items() if k not in switch_fields}}
    engine = Engine(models, mappers, ServeConfig(**served, switch=switch))
    server = serve_in_thread(engine)
    try:
        yield server
    finally:
        server.close()


def chat_ids(tokenizer, messages) -> list[int]:
    """The prompt ids the server builds for ``messages`` (ChatML, the generation prompt added)."""
    text = tokenizer.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_answer(model, tokenizer, ids, max_tokens: int) -> str:
    """``model.generate(do_sample=False)`` on ``ids`` alone (a full prefill), stopping at the tokenizer's EOS."""
    input_ids = torch.tensor([list(ids)])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    answer = out[0, input_ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in answer:
        answer = answer[: answer.index(tokenizer.eos_token_id)]
    return tokenizer.decode(answer, skip_special_tokens=True)


class GatedModel:
    """A model whose forward passes wait on `gate` once `free` calls have gone through (the worker is then busy)."""

    def __init__(self, model, free: int) -> None:
        self.model, self.free, self.calls = model, free, 0
        self.gate, self.waiting = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.free:
            self.waiting.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def wait_for(condition, what: str, tries: int = 1000) -> None:
    """Poll ``condition`` (bounded: tries × 10 ms) — the server acts on another thread."""
    for _ in range(tries):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
