"""Reading a turn's attention in llama.cpp (`kvhandoff.runtime.llama_cpp.attention`), on tiny GGUF models written in
the test: the attention and log-probs are the transformers engine's, the conversation is left as it was, the reading
context grows to the longest read, and the recorded `turn_attention` rule ranks a llama.cpp source as a transformers
one."""

import pytest
import torch

from _llama_support import llama_model
from _runtime_support import exact_pair, ids_of, max_kv_diff
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import SelectionInfo, TurnAttention
from kvhandoff.runtime.seam import TransformersCache

pytest.importorskip("llama_cpp")

from kvhandoff.runtime.llama_cpp.attention import _watched


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    source, _, _ = exact_pair()
    small = llama_model(source, tmp_path_factory.mktemp("gguf"), "small", context=4096)
    yield source, small
    small.close()


def _prefilled(model, ids):
    cache = model.new_cache()
    cache.read(model, ids)
    return cache


def test_a_turns_attention_read_in_llama_cpp_is_the_transformers_engines(pair):
    """read_turn in llama.cpp (the queries and keys its callback shows): the attention each cached position
    receives and the log-probs after the turn as the transformers engine reads them — with a lookahead, with a turn
    longer than one decode call, on an empty cache; the sequence is left as it was."""
    source, small = pair
    ids = ids_of(tokens=110, seed=3)
    history = ids[:, :30]
    cache = _prefilled(small, history)
    before = cache.export()
    reference = TransformersCache()
    reference.read(source, history)
    for turn, keep, lookahead in ((ids[:, 30:36], 2, 0), (ids[:, 30:36], 1, 3), (ids[:, 30:110], 1, 0)):
        mine, theirs = cache.read_turn(small, turn, keep, lookahead), reference.read_turn(source, turn, keep, lookahead)
        assert mine.scores.shape == (1, 30) and mine.logprobs.shape == theirs.logprobs.shape
        torch.testing.assert_close(mine.scores, theirs.scores, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=2e-3, rtol=0)
    assert cache.length == 30 and max_kv_diff(cache.export(), before) == 0
    empty = small.new_cache().read_turn(small, ids[:, :5])
    assert empty.scores.shape == (1, 0)
    torch.testing.assert_close(empty.logprobs[0, -1], source(input_ids=ids[:, :5]).logits[0, -1].log_softmax(-1),
                               atol=2e-3, rtol=0)
    with pytest.raises(ConfigError, match="keep"):
        cache.read_turn(small, ids[:, :4], keep=5)


def test_turn_attention_ranks_a_llama_cpp_source_as_a_transformers_one(pair):
    """The recorded rule on a llama.cpp source picks the positions it picks on the transformers source; without
    the new turn it is refused (llama.cpp does not re-read the history's last queries)."""
    source, small = pair
    ids = ids_of(tokens=48, seed=4)
    history, turn = ids[:, :40], tuple(ids[0, 40:].tolist())
    cache = _prefilled(small, history)
    reference = TransformersCache()
    reference.read(source, history)
    policy, info = TurnAttention(0.25), SelectionInfo(new_turn=turn)
    picked = policy.positions(None, reference.export(), history, info, small, cache)
    assert picked.shape == (1, 10)
    assert torch.equal(picked, policy.positions(None, reference.export(), history, info, source, reference))
    with pytest.raises(ConfigError, match="new turn"):
        policy.positions(None, reference.export(), history, SelectionInfo(), small, cache)


def test_the_reading_context_grows_to_the_longest_read_and_is_reused(pair):
    source, small = pair
    ids = ids_of(tokens=1500, seed=5)
    short = _prefilled(small, ids[:, :20])
    short.read_turn(small, ids[:, 20:24])
    reader = small._reader
    assert reader._cells == 1024
    long = _prefilled(small, ids[:, :1400])
    read = long.read_turn(small, ids[:, 1400:1410])
    assert small._reader is reader and reader._cells == 2048
    reference = TransformersCache()
    reference.read(source, ids[:, :1400])
    torch.testing.assert_close(read.scores, reference.read_turn(source, ids[:, 1400:1410]).scores, atol=2e-3,
                               rtol=1e-3)
    short.read_turn(small, ids[:, 20:24])  # a shorter read reuses the larger context
    assert reader._cells == 2048


def test_only_the_rope_applied_rows_of_a_layer_are_watched():
    assert _watched(b"Qcur-3") == ("Qcur", 3) and _watched(b"Kcur-12") == ("Kcur", 12)
    assert _watched(b"Vcur-3") is None and _watched(b"Qcur_normed-3") is None and _watched(b"Qcur") is None


def test_the_read_is_the_same_with_flash_attention(pair, tmp_path):
    """With llama.cpp's flash attention (V not transposed in the state) the reading context is made alike."""
    source, small = pair
    flash = llama_model(source, tmp_path, "flash", flash_attn=True)
    try:
        ids = ids_of(tokens=40, seed=6)
        plain, fast = _prefilled(small, ids[:, :30]), _prefilled(flash, ids[:, :30])
        torch.testing.assert_close(fast.read_turn(flash, ids[:, 30:]).scores,
                                   plain.read_turn(small, ids[:, 30:]).scores, atol=2e-3, rtol=1e-3)
    finally:
        flash.close()
