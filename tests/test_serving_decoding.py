"""Choosing tokens (greedy, seeded top-p sampling), end ids, and stop strings while streaming."""

from __future__ import annotations

import pytest
import torch

from kvhandoff.serving.decoding import choose_token, end_ids, held_back, make_generator, stop_index

from conftest import chat_tokenizer, tiny_model

pytestmark = pytest.mark.timeout(30)


def test_greedy_and_seeded_sampling():
    logprobs = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()
    assert choose_token(logprobs) == 1 and choose_token(logprobs, temperature=0.0, top_p=0.1) == 1
    draws = [choose_token(logprobs, 1.0, 1.0, make_generator(3)) for _ in range(3)]
    assert len(set(draws)) == 1  # one seed, one draw
    generator = make_generator(0)
    assert {choose_token(logprobs, 1.0, 0.5, generator) for _ in range(50)} == {1}  # top-p keeps the top token
    generator = make_generator(0)
    # top 0.75: 0.5 + 0.2 falls short, so the third token (0.2) joins; the least likely (0.1) never comes
    assert {choose_token(logprobs, 1.0, 0.75, generator) for _ in range(200)} == {1, 2, 3}
    seen = {choose_token(logprobs, 5.0, 1.0, make_generator(s)) for s in range(200)}
    assert seen == {0, 1, 2, 3}


def test_end_ids_join_the_tokenizer_and_the_generation_config():
    model, tokenizer = tiny_model("qwen2", vocab_size=300), chat_tokenizer()
    model.generation_config.eos_token_id = [7, 8]
    assert end_ids(model, tokenizer) == {7, 8, tokenizer.eos_token_id}


def test_stop_strings():
    assert stop_index("hello world", ["wor", "lo"]) == 3 and stop_index("abc", ["x"]) is None
    assert stop_index("a-b-c", ["-"], start=2) == 3
    assert held_back("answer: EN", ["END"]) == 2 and held_back("answer", ["END"]) == 0
    assert held_back("caf\ufffd", []) == 1
