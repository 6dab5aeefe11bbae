"""Choosing tokens (greedy, seeded top-p sampling, the full sampling settings), end ids, and stop strings while
streaming."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from kvhandoff.errors import ConfigError
from kvhandoff.serving.decoding import (
    GenerationDefaults,
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_openai_penalties,
    choose_token,
    end_ids,
    generation_config_defaults,
    held_back,
    make_generator,
    stop_index,
)

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


def test_generation_config_defaults_are_the_sampling_fields_it_sets():
    model = tiny_model("qwen2", vocab_size=300)
    assert generation_config_defaults(model) == GenerationDefaults()  # a fresh config: transformers' defaults
    model.generation_config = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                               max_new_tokens=64, eos_token_id=5, do_sample=True)
    assert generation_config_defaults(model) == GenerationDefaults(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}, max_tokens=64)
    assert generation_config_defaults(object()) == GenerationDefaults()  # a backend without a generation config
    model.generation_config = GenerationConfig(temperature=5.0, do_sample=True)
    with pytest.raises(ConfigError, match=r"generation config of tiny: .*temperature.*--generation-config vllm"):
        generation_config_defaults(model, "tiny")


def test_stop_strings():
    assert stop_index("hello world", ["wor", "lo"]) == 3 and stop_index("abc", ["x"]) is None
    assert stop_index("a-b-c", ["-"], start=2) == 3
    assert held_back("answer: EN", ["END"]) == 2 and held_back("answer", ["END"]) == 0
    assert held_back("caf\ufffd", []) == 1
    long_stop = "ab" * 500  # only the sizes ending in the text's last character are tried
    assert held_back("xx" + long_stop[:777], [long_stop]) == 777 and held_back("x" * 2000, [long_stop]) == 0


def test_a_top_p_that_is_zero_in_float32_is_greedy():
    logprobs = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()
    for top_p in (1e-300, 5e-324, 1e-40):
        assert {choose_token(logprobs, 1.0, top_p, make_generator(seed)) for seed in range(20)} == {1}
        draws = {sampler(temperature=1.0, top_p=top_p, seed=seed).next_token(logprobs, []) for seed in range(20)}
        assert draws == {1}
    assert choose_token(logprobs, 1e-300) == 1  # a temperature too small to divide by is greedy


EOS = 3


def sampler(vocab_size=4, prompt=(), end=frozenset({EOS}), **settings) -> Sampler:
    return Sampler(SamplingParams(**settings), end, vocab_size, list(prompt))


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "1"), ("temperature", True),
    ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1),
    ("min_p", 1.1), ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5), ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", ((1, 1.0), (1, 2.0))), ("logit_bias", ((1,),)), ("logit_bias", "1:2"), ("min_tokens", -1),
    ("min_tokens", 1.0), ("ignore_eos", 1), ("stop_token_ids", (-1,)), ("stop_token_ids", ("2",)),
    ("stop_token_ids", 2), ("seed", "7"), ("seed", 1.5),
])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"sampling {field}") as error:
        SamplingParams(**{field: value})
    assert repr(value)[:20] in str(error.value) or field in ("logit_bias", "stop_token_ids")


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(temperature=1, logit_bias={5: -100}, stop_token_ids=[9, 10], top_k=-1)
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.logit_bias == ((5, -100.0),) and params.stop_token_ids == (9, 10)
    assert hash(params) == hash(SamplingParams(temperature=1.0, logit_bias=((5, -100),), stop_token_ids=(9, 10),
                                               top_k=-1))
    with pytest.raises(ConfigError, match=r"temperature must be a number in \[0, 2\], got 3"):
        SamplingParams(temperature=3)
    with pytest.raises(ConfigError, match=r"repetition_penalty must be a number in \(0, inf\), got 0"):
        SamplingParams(repetition_penalty=0)


def test_greedy_is_the_argmax_and_choose_token():
    for seed in range(20):
        logprobs = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(seed)), -1)
        token = sampler(50, temperature=0.0).next_token(logprobs, [])
        assert token == int(logprobs.argmax()) == choose_token(logprobs)
    logprobs = torch.tensor([0.1, 0.5, 0.2, 0.2]).log().to(torch.bfloat16)
    assert sampler(temperature=0.0, top_p=0.1).next_token(logprobs, [0, 0]) == 1


def test_seeded_sampling_is_reproducible_and_draws_what_choose_token_draws():
    logprobs = torch.log_softmax(torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2, -1)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9), (1.6, 0.5)]:
        first, second = (sampler(64, temperature=temperature, top_p=top_p, seed=11) for _ in range(2))
        draws = [first.next_token(logprobs, [7] * i) for i in range(30)]
        assert draws == [second.next_token(logprobs, [7] * i) for i in range(30)]
        generator = make_generator(11)
        assert draws == [choose_token(logprobs, temperature, top_p, generator) for _ in range(30)]
        assert len(set(draws)) > 1
    assert sampler(64, seed=12).next_token(logprobs, []) == choose_token(logprobs, 1.0, 1.0, make_generator(12))


def test_top_k_one_is_the_argmax_even_when_hot():
    logprobs = torch.tensor([0.3, 0.25, 0.25, 0.2]).log()
    assert {sampler(temperature=2.0, top_k=1, seed=s).next_token(logprobs, []) for s in range(200)} == {0}
    assert {sampler(temperature=2.0, top_k=2, seed=s).next_token(logprobs, []) for s in range(200)} == {0, 1, 2}
    assert {sampler(temperature=2.0, seed=s).next_token(logprobs, []) for s in range(200)} == {0, 1, 2, 3}


def test_min_p_keeps_tokens_at_least_that_share_of_the_top_one():
    logprobs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = sampler(min_p=0.2, seed=0)  # threshold 0.1: the 0.05 token goes
    assert {draws.next_token(logprobs, []) for _ in range(500)} == {0, 1, 2}
    draws = sampler(min_p=0.5, seed=0)  # threshold 0.25
    assert {draws.next_token(logprobs, []) for _ in range(500)} == {0, 1}
    draws = sampler(min_p=0.0, seed=0)
    assert {draws.next_token(logprobs, []) for _ in range(500)} == {0, 1, 2, 3}


def test_repetition_penalty_counts_the_prompt_and_the_answer():
    logprobs = torch.tensor([0.5, 0.4, 0.05, 0.05]).log()
    assert sampler(temperature=0.0).next_token(logprobs, []) == 0
    # log-probs are negative, so the penalty multiplies: 1.5 · log 0.5 = -1.04 < log 0.4 = -0.92
    assert sampler(prompt=[0, 2], temperature=0.0, repetition_penalty=1.5).next_token(logprobs, []) == 1
    assert sampler(temperature=0.0, repetition_penalty=1.5).next_token(logprobs, [2, 0]) == 1
    assert sampler(prompt=[0], temperature=0.0, repetition_penalty=1.1).next_token(logprobs, []) == 0  # -0.76
    assert sampler(prompt=[1], temperature=0.0, repetition_penalty=1.5).next_token(logprobs, [1]) == 0


def test_presence_and_frequency_penalties_follow_openai():
    logprobs = torch.tensor([-1.0, -1.25, -1.5, -4.0])
    assert apply_openai_penalties(logprobs, [0, 0, 1], 0.5, 0.25).tolist() == [-2.0, -2.0, -1.5, -4.0]
    assert apply_openai_penalties(logprobs, [], 0.5, 0.25) is logprobs
    answer = [0, 0, 0, 1]
    # presence 0.2: -1.2 vs -1.45 (token 0 stays); frequency 0.2: -1.6 vs -1.45 (token 1 wins)
    assert sampler(temperature=0.0, presence_penalty=0.2).next_token(logprobs, answer) == 0
    assert sampler(temperature=0.0, frequency_penalty=0.2).next_token(logprobs, answer) == 1
    assert sampler(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25).next_token(logprobs, [0, 0, 1]) == 2
    assert sampler(temperature=0.0, presence_penalty=-0.5).next_token(logprobs, [1]) == 1  # -0.75: repeats gain
    assert sampler(prompt=[0, 0], temperature=0.0, frequency_penalty=2.0).next_token(logprobs, []) == 0  # answer only


def test_logit_bias_forces_and_forbids():
    logprobs = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert apply_logit_bias(logprobs, [(2, 1.5)]).tolist() == pytest.approx([math.log(0.4), math.log(0.3),
                                                                             math.log(0.2) + 1.5, math.log(0.1)])
    assert sampler(temperature=0.0, logit_bias={2: 100}).next_token(logprobs, []) == 2
    forced = sampler(logit_bias={3: 100}, seed=0)
    assert {forced.next_token(logprobs, []) for _ in range(200)} == {3}
    assert sampler(temperature=0.0, logit_bias={0: -100}).next_token(logprobs, []) == 1
    forbidden = sampler(logit_bias={0: -100}, seed=0)
    assert {forbidden.next_token(logprobs, []) for _ in range(300)} == {1, 2, EOS}


def test_min_tokens_masks_the_stop_ids_for_the_first_steps():
    logprobs = torch.tensor([0.05, 0.15, 0.1, 0.7]).log()  # EOS is the most likely
    draws = sampler(temperature=0.0, min_tokens=2)
    assert [draws.next_token(logprobs, [1] * n) for n in range(4)] == [1, 1, EOS, EOS]
    draws = sampler(temperature=0.0, min_tokens=1, stop_token_ids=(1,))  # stop_token_ids are held too
    assert draws.next_token(logprobs, []) == 2 and draws.next_token(logprobs, [2]) == EOS
    sampled = sampler(min_tokens=3, seed=0)
    assert EOS not in {sampled.next_token(logprobs, [0, 1]) for _ in range(200)}


def test_ignore_eos_keeps_the_end_ids_out_of_the_stop_ids():
    assert sampler(end=frozenset({EOS, 2})).stop_ids == {EOS, 2}
    assert sampler(end=frozenset({EOS, 2}), stop_token_ids=(1,)).stop_ids == {EOS, 2, 1}
    assert sampler(end=frozenset({EOS, 2}), ignore_eos=True, stop_token_ids=(1,)).stop_ids == {1}
    assert sampler(ignore_eos=True).stop_ids == frozenset()
    logprobs = torch.tensor([0.05, 0.15, 0.1, 0.7]).log()
    assert sampler(temperature=0.0, ignore_eos=True, min_tokens=5).next_token(logprobs, []) == EOS  # not a stop


def test_allowed_mask_restricts_and_beats_min_tokens():
    logprobs = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    allowed = torch.tensor([False, False, True, True])
    assert sampler(temperature=0.0).next_token(logprobs, [], allowed) == 2
    draws = sampler(seed=0)
    assert {draws.next_token(logprobs, [], allowed) for _ in range(200)} == {2, EOS}
    only_eos = torch.tensor([False, False, False, True])
    assert sampler(temperature=0.0, min_tokens=5).next_token(logprobs, [], only_eos) == EOS
    assert sampler(min_tokens=5, seed=0).next_token(logprobs, [], only_eos) == EOS
    assert sampler(temperature=0.0, min_tokens=5).next_token(logprobs, [], allowed) == 2
    with pytest.raises(ConfigError, match="no token"):
        sampler().next_token(logprobs, [], torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ConfigError, match="bool mask"):
        sampler().next_token(logprobs, [], torch.ones(5, dtype=torch.bool))


def test_sampler_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ConfigError, match=r"logit_bias token id 4 is outside the vocabulary 0\.\.3"):
        sampler(4, logit_bias={4: 1.0})
    with pytest.raises(ConfigError, match=r"stop_token_ids token id 9 is outside the vocabulary 0\.\.3"):
        sampler(4, stop_token_ids=(1, 9))
    assert sampler(4, logit_bias={3: 1.0}, stop_token_ids=(3,)).stop_ids == {EOS}
    with pytest.raises(ConfigError, match=r"shape \(4,\)"):
        sampler(4).next_token(torch.zeros(5), [])
