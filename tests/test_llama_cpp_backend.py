"""The llama.cpp engine behind the cache seam, on tiny GGUF models written in the test: llama.cpp reads them as
transformers does, its cache's rows leave and enter the context bit for bit, and a handoff through it — the
exactly related pair's exact mapper — reproduces the target's own llama.cpp logits and greedy answer."""

import pytest
import torch

from _llama_support import llama_model
from _runtime_support import exact_pair, ids_of, max_kv_diff
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.handoff import map_for_target
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.recompute import recompute_positions
from kvhandoff.runtime.seam import Pending, TransformersCache, rows_of
from kvhandoff.runtime.session import SwitchingSession

pytest.importorskip("llama_cpp")

from kvhandoff.runtime.llama_cpp import state
from kvhandoff.runtime.llama_cpp.backend import LlamaCppCache, LlamaCppError
from kvhandoff.runtime.llama_cpp.state import StateFormatError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    source, target, mapper = exact_pair()
    small, large = llama_model(source, folder, "small"), llama_model(target, folder, "large")
    yield source, target, mapper, small, large
    small.close()
    large.close()


def _prefilled(model, ids):
    cache = model.new_cache()
    logits = cache.read(model, ids)
    return cache, logits


def test_llama_cpp_reads_the_gguf_as_transformers_does(pair):
    source, _, _, small, _ = pair
    ids = ids_of(tokens=24)
    cache, logits = _prefilled(small, ids)
    reference = source(input_ids=ids, use_cache=True)
    assert logits.shape == (1, 1, small.vocab_size)
    assert torch.allclose(logits[0, -1], reference.logits[0, -1], atol=2e-4)
    # the cached keys are the transformers model's, RoPE applied: the same content space
    assert max_kv_diff(cache.export(), reference.cache) < 2e-4


def test_rows_leave_and_enter_the_context_bit_for_bit(pair):
    _, _, _, small, _ = pair
    cache, _ = _prefilled(small, ids_of(tokens=16))
    rows = cache.export()
    twin = small.new_cache()
    twin.append(cache.export(0, 10))
    twin.append(cache.export(10))
    assert twin.length == 16
    assert max_kv_diff(twin.export(), rows) == 0
    assert max_kv_diff(cache.export(4, 9), rows_of((k[:, :, 4:9], v[:, :, 4:9]) for k, v in
                                                   ((layer.keys, layer.values) for layer in rows.layers))) == 0


@pytest.mark.parametrize("flash_attn", [False, True])
def test_llama_cpp_state_parses_and_writes_back_bit_for_bit(pair, tmp_path, flash_attn):
    source = pair[0]
    model = llama_model(source, tmp_path, "f16", cache_type="f16", flash_attn=flash_attn)
    try:
        cache, _ = _prefilled(model, ids_of(tokens=9))
        blob = model.state_bytes(cache.seq)
        parsed = state.parse(blob, model.layout)
        assert parsed.positions.tolist() == list(range(9)) and model.layout.v_trans is not flash_attn
        assert state.write(parsed, model.layout, cache.seq) == blob
    finally:
        model.close()


def test_copy_truncate_and_batched_reads(pair):
    _, _, _, small, _ = pair
    cache, _ = _prefilled(small, ids_of(tokens=12))
    twin = cache.copy()
    twin.truncate(5)
    assert (cache.length, twin.length) == (12, 5)
    alone = [c.copy().read(small, torch.tensor([[7]]))[0, -1] for c in (cache, twin)]
    together = LlamaCppCache.read_batch(small, [cache, twin], [7, 7])
    assert torch.allclose(together, torch.stack(alone), atol=1e-5)
    assert (cache.length, twin.length) == (13, 6)
    assert list(cache.storages().values()) == [13 * small.bytes_per_token]


def test_runs_of_positions_recompute_as_the_transformers_engine_does(pair):
    source, _, _, small, _ = pair
    ids = ids_of(tokens=20)
    own = source(input_ids=ids, use_cache=True).cache
    gen = torch.Generator().manual_seed(0)
    noisy = rows_of((k + 0.3 * torch.randn(k.shape, generator=gen), v + 0.3 * torch.randn(v.shape, generator=gen))
                    for k, v in ((layer.keys, layer.values) for layer in own.layers))
    positions = torch.tensor([[0, 1, 2, 9, 10, 17, 18, 19]])
    expected = TransformersCache(rows_of((layer.keys.clone(), layer.values.clone()) for layer in noisy.layers))
    recompute_positions(source, expected.cache, ids, positions)
    cache = small.new_cache()
    cache.append(noisy)
    cache.recompute(small, Pending(ids, positions))
    assert cache.length == 20
    assert max_kv_diff(cache.export(), expected.export()) < 2e-4


def test_a_handoff_through_llama_cpp_reproduces_the_target(pair):
    _, _, mapper, small, large = pair
    ids = ids_of(tokens=30)
    own, own_logits = _prefilled(large, ids[:, :-1])
    own_logits = own.read(large, ids[:, -1:])
    mapped = map_for_target(small, large, mapper, ids[:, :-1], HandoffPlan.of(recompute="recent:10%"),
                            cache_factory=lambda model: model.new_cache())
    logits = mapped.read(large, ids[:, -1:])
    assert isinstance(mapped.cache, LlamaCppCache)
    assert torch.allclose(logits, own_logits, atol=2e-3)
    with pytest.raises(ConfigError, match=r"layers:50%.*positions"):  # whole layers need a transformers forward
        map_for_target(small, large, mapper, ids[:, :-1], HandoffPlan.of(recompute="layers:50%"),
                       cache_factory=lambda model: model.new_cache())


def _switching(pair) -> SwitchingSession:
    """A conversation of the llama.cpp pair that switches small → large."""
    _, _, mapper, small, large = pair
    return SwitchingSession({"small": small, "large": large}, {("small", "large"): mapper},
                            cache_factory=lambda model: model.new_cache())


def test_a_conversation_switches_in_llama_cpp_and_answers_as_the_target_alone(pair):
    large = pair[4]
    session = _switching(pair)
    history, turn = ids_of(tokens=40, seed=5)[0].tolist(), ids_of(tokens=6, seed=6)[0].tolist()
    session.read("small", history)
    answer = session.generate("large", turn, max_new_tokens=8)
    alone = large.new_cache().generate(large, torch.tensor([history + turn]), max_new_tokens=8)
    assert answer == alone[0, len(history + turn):].tolist()
    assert session.cached_length("large") == len(history + turn) + len(answer)


def test_a_llama_cpp_cache_heals_in_chunks_into_its_own_prefill(pair):
    large = pair[4]
    session = _switching(pair)
    history, turn = ids_of(tokens=40, seed=7)[0].tolist(), ids_of(tokens=6, seed=8)[0].tolist()
    session.read("small", history)
    session.read("large", turn)
    assert session.own_length("large") == 0
    assert session.heal("large", limit=16) == 16 and session.own_length("large") == 16
    assert session.heal("large") == len(history + turn) - 16
    assert session.own_length("large") == session.cached_length("large") == len(history + turn)
    prefilled, _ = _prefilled(large, torch.tensor([history + turn]))
    for mine, own in zip(session.export("large").layers, prefilled.export().layers, strict=True):
        torch.testing.assert_close(mine.keys, own.keys, atol=1e-3, rtol=0)
        torch.testing.assert_close(mine.values, own.values, atol=1e-3, rtol=0)


def test_a_refused_import_leaves_the_cache_as_it_was(pair):
    _, _, _, small, large = pair
    cache, _ = _prefilled(small, ids_of(tokens=10))
    before = cache.export()
    with pytest.raises(StateFormatError, match="KV heads"):
        cache.append(rows_of((k[:, :1], v[:, :1]) for k, v in ((layer.keys, layer.values) for layer in
                                                                before.layers)))
    free = len(small._free_seqs)
    with pytest.raises(LlamaCppError, match="no room"):
        cache.append(rows_of((k.repeat(1, 1, 200, 1), v.repeat(1, 1, 200, 1)) for k, v in
                             ((layer.keys, layer.values) for layer in before.layers)))
    assert len(small._free_seqs) == free  # the scratch sequence went back
    assert cache.length == 10
    assert max_kv_diff(cache.export(), before) == 0
    with pytest.raises(ConfigError, match="cannot read it"):
        cache.read(large, torch.tensor([[1]]))


def test_a_failed_read_leaves_the_cache_as_it_was(pair, tmp_path):
    source = pair[0]
    model = llama_model(source, tmp_path, "cramped", context=64, batch=16, sequences=4)
    try:
        cache, _ = _prefilled(model, ids_of(tokens=20))
        before = cache.export()
        with pytest.raises(LlamaCppError, match="no room"):
            cache.read(model, ids_of(tokens=300, seed=4))  # llama.cpp pads the context to 256 cells: it fills midway
        assert cache.length == 20 and max_kv_diff(cache.export(), before) == 0
        assert cache.read(model, torch.tensor([[3]])).shape == (1, 1, model.vocab_size)
    finally:
        model.close()
    with pytest.raises(LlamaCppError, match="closed"):
        cache.read(model, torch.tensor([[3]]))


def test_write_replaces_rows_in_place(pair):
    _, _, _, small, _ = pair
    cache, _ = _prefilled(small, ids_of(tokens=12))
    other, _ = _prefilled(small, ids_of(tokens=12, seed=9))
    cache.write(3, other.export(3, 7))
    rows, theirs = cache.export(), other.export()
    assert cache.length == 12
    assert max_kv_diff(rows, theirs, slice(3, 7)) == 0 and max_kv_diff(rows, theirs, slice(7, None)) > 0
    with pytest.raises(ConfigError, match="past a cache"):
        cache.write(10, other.export(0, 4))


def test_settings_are_checked_where_they_enter():
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings

    with pytest.raises(ConfigError, match="batch 512 is past the context's 100"):
        LlamaCppSettings(context=100)
    with pytest.raises(ConfigError, match="cache_type"):
        LlamaCppSettings(cache_type="q8_0")
    with pytest.raises(ConfigError, match="sequences"):
        LlamaCppSettings(sequences=1)


def test_sequences_are_returned_to_the_context(pair):
    _, _, _, small, _ = pair
    free = len(small._free_seqs)
    caches = [small.new_cache() for _ in range(3)]
    assert len(small._free_seqs) == free - 3
    del caches
    assert len(small._free_seqs) == free
