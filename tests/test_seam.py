"""The cache seam (kvhandoff.runtime.seam): `TransformersCache` implements the `KVCache` lifecycle on a DynamicCache —
export rows, append and write rows, the forward that recomputes pending positions and reads new tokens, truncate,
copy, the memory held; each model's fresh cache comes from the `CacheFactory` of the side that runs it (a handoff's
target cache never from the source's kind)."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvhandoff import HandoffPlan, KVCache, SwitchingSession, handoff_cache, map_for_target, prefill
from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_of
from kvhandoff.runtime import handoff, session
from kvhandoff.runtime.seam import Pending, TransformersCache, as_kv_cache, new_cache

from conftest import tiny_model


def ids_of(batch=1, tokens=24, seed=3):
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def junk_like(cache, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return cache_of((torch.randn(layer.keys.shape, generator=gen), torch.randn(layer.values.shape, generator=gen))
                    for layer in cache.layers)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", layers=2)


def test_export_append_and_write_move_rows(model):
    ids = ids_of(batch=2)
    own, _ = prefill(model, ids)
    kv = as_kv_cache(own)
    assert isinstance(kv, TransformersCache) and as_kv_cache(kv) is kv and kv.native is own
    assert (kv.length, kv.dtype, kv.geometry()) == (24, torch.float32, (2, 2, 16))
    rows = kv.export(10, 20)
    assert rows.get_seq_length() == 10
    assert rows.layers[0].keys.data_ptr() == own.layers[0].keys[:, :, 10:].data_ptr()  # views, no copy
    fresh = kv.empty()
    assert fresh.length == 0 and fresh.geometry() is None
    fresh.append(kv.export(0, 10))
    fresh.append(kv.export(10))
    assert fresh.length == 24 and torch.equal(fresh.export().layers[1].values, own.layers[1].values)
    junk = as_kv_cache(junk_like(own))
    junk.write(0, kv.export(0, 4))
    assert torch.equal(junk.export(0, 4).layers[0].keys, own.layers[0].keys[:, :, :4])
    assert not torch.equal(junk.export(4, 8).layers[0].keys, own.layers[0].keys[:, :, 4:8])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_batched_decode_step_equals_one_step_per_cache(family):
    """`read_batch` left-pads caches of different lengths into one forward: the logits and every cache's new rows
    equal those of reading each token on its own cache (≤ 1e-4), and the default (one by one) agrees too."""
    batch_model = tiny_model(family, layers=2)
    caches, alone = [], []
    for length, seed in ((5, 1), (17, 2), (9, 3)):
        ids = ids_of(tokens=length, seed=seed)
        for kept in (caches, alone):
            kept.append(TransformersCache())
            kept[-1].read(batch_model, ids)
    tokens = [3, 40, 7]
    untouched = [cache.copy() for cache in alone]
    together = TransformersCache.read_batch(batch_model, caches, tokens)
    apart = torch.cat([cache.read(batch_model, torch.tensor([[token]]), 1)[:, -1]
                       for cache, token in zip(alone, tokens, strict=True)])
    assert together.shape == (3, batch_model.config.vocab_size)
    torch.testing.assert_close(together, apart, atol=1e-4, rtol=0)
    for mine, theirs in zip(caches, alone, strict=True):
        assert mine.length == theirs.length
        for a, b in zip(mine.native.layers, theirs.native.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=0)
    one_by_one = KVCache.read_batch.__func__(TransformersCache, batch_model, untouched, tokens)
    torch.testing.assert_close(one_by_one, together, atol=1e-4, rtol=0)


def test_truncate_copy_and_storages(model):
    own, _ = prefill(model, ids_of())
    kv = as_kv_cache(own)
    twin = kv.copy()
    twin.truncate(10)
    assert twin.length == 10 and kv.length == 24
    shared = kv.storages()
    assert sum(shared.values()) == sum(t.untyped_storage().nbytes() for layer in own.layers
                                       for t in (layer.keys, layer.values))
    view = as_kv_cache(kv.export(0, 12))  # views of the same storage are counted once
    assert {**shared, **view.storages()} == shared
    with pytest.raises(ValueError):
        twin.truncate(11)


def test_read_recomputes_the_pending_positions_in_the_same_forward(model):
    """`read` with pending positions = `recompute` then the plain read; without, the plain read; an empty cache is
    a prefill."""
    ids = ids_of(tokens=30)
    context, new = ids[:, :26], ids[:, 26:]
    first = new_cache()
    logits = first.read(model, context)
    own, reference = prefill(model, context)
    assert first.length == 26 and (logits[:, -1] - reference).abs().max() <= 1e-5
    pending = Pending(context, torch.tensor([[0, 1, 2, 3, 20]]))
    assert pending and not Pending(context, torch.empty(1, 0, dtype=torch.long))
    fused, stepwise = as_kv_cache(junk_like(own)), as_kv_cache(junk_like(own))
    assert fused.supports_recompute(model)
    fused_logits = fused.read(model, new, 2, pending)
    stepwise.recompute(model, pending)
    assert stepwise.length == 26
    step_logits = stepwise.read(model, new, 2)
    assert fused.length == stepwise.length == 30 and (fused_logits - step_logits).abs().max() <= 1e-5


def test_generate_runs_the_engines_loop_with_a_first_read(model):
    ids = ids_of(tokens=20)
    own, _ = prefill(model, ids[:, :16])
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=prefill(model, ids[:, :16])[0],
                               max_new_tokens=3, do_sample=False)
    kv = as_kv_cache(own)
    reads = []

    def first_read(new_ids, keep):
        reads.append(new_ids.shape[1])
        return kv.read(model, new_ids, keep)

    out = kv.generate(model, ids, first_read, max_new_tokens=3, do_sample=False)
    assert out.tolist() == reference.tolist() and reads == [4] and "forward" not in model.__dict__


def test_the_handoff_and_the_session_touch_caches_only_through_the_seam():
    """No transformers cache internals outside the seam: the handoff and the session hold `KVCache` objects."""
    for module in (handoff, session):
        source = inspect.getsource(module)
        for internal in (".layers", ".keys", "].values", "DynamicCache", "get_seq_length", "cache_utils", "cache_copy",
                         "cache_view"):
            assert internal not in source, (module.__name__, internal)
    assert issubclass(TransformersCache, KVCache) and inspect.isabstract(KVCache)


# -- where a fresh cache comes from: the side that runs the model (`CacheFactory`) ---------------------------------
class EngineCache(TransformersCache):
    """A `TransformersCache` standing in for one engine's cache: it knows which engine (``engine``) made it."""

    def __init__(self, engine: str, cache=None) -> None:
        super().__init__(cache)
        self.engine = engine

    def empty(self) -> EngineCache:
        return EngineCache(self.engine)

    def copy(self) -> EngineCache:
        return EngineCache(self.engine, TransformersCache.copy(self).native)


class SourceOnlyCache(EngineCache):
    """A source engine's cache whose kind cannot hold the target's K/V: asked for an empty one, it refuses."""

    def empty(self):
        raise AssertionError("the target's cache was made by the source's kind")


class SameRows:
    """A stand-in mapper between two models of one geometry: the rows as they are (cast to ``dtype``)."""

    exact_prefix = 3

    def transfer(self, rows, position_ids=None, dtype=None):
        return cache_of((layer.keys.to(dtype), layer.values.to(dtype)) for layer in rows.layers)


class Factory:
    """A `CacheFactory` that makes an `EngineCache` of the model's engine and records what it made for whom."""

    def __init__(self, engines) -> None:
        self.engines, self.made = engines, []

    def __call__(self, model) -> EngineCache:
        cache = EngineCache(self.engines[id(model)])
        self.made.append(cache)
        return cache


@pytest.fixture(scope="module")
def other(model):
    return tiny_model("qwen2", layers=2, seed=1)  # the geometry of ``model``, other weights


def test_the_mapped_cache_comes_from_the_targets_factory_not_the_sources_kind(model, other):
    ids = ids_of(tokens=20)
    source = SourceOnlyCache("source", prefill(model, ids[:, :16])[0])
    factory = Factory({id(model): "target"})
    mapped = map_for_target(model, model, SameRows(), ids[:, :16], HandoffPlan.of(3, "none"), source,
                            cache_factory=factory)
    assert [made.engine for made in factory.made] == ["target"] and mapped.cache is factory.made[0]
    assert mapped.pending.tolist() == [[0, 1, 2]]
    logits = mapped.read(model, ids[:, 16:])  # the target's pending recompute and read run on its own cache
    _, reference = prefill(model, ids)
    assert mapped.cache.length == 20 and (logits[:, -1] - reference).abs().max() <= 1e-5
    # without a source cache the source's prefill cache comes from the factory too, made for the source
    factory = Factory({id(model): "source", id(other): "target"})
    native = handoff_cache(model, other, SameRows(), ids, HandoffPlan.of(0, "none"), cache_factory=factory)
    assert [made.engine for made in factory.made] == ["source", "target"] and native is factory.made[1].native
    with pytest.raises(ConfigError, match="starts empty"):
        map_for_target(model, model, SameRows(), ids, source_cache=prefill(model, ids)[0],
                       cache_factory=lambda m: as_kv_cache(prefill(m, ids[:, :2])[0]))


def test_a_session_makes_each_models_cache_with_that_models_factory(model, other):
    factory = Factory({id(model): "a", id(other): "b"})
    mappers = {("a", "b"): SameRows(), ("b", "a"): SameRows()}
    conversation = SwitchingSession({"a": model, "b": other}, mappers, plan=HandoffPlan.of(0, "none"),
                                    cache_factory=factory)
    ids = ids_of(tokens=30)[0].tolist()
    conversation.read("a", ids[:12])  # a's first turn: a's own engine
    conversation.read("b", ids[12:20])  # the handover maps a's cache into one b's engine made
    conversation.read("a", ids[20:])  # a catches up on its own cache
    assert [made.engine for made in factory.made] == ["a", "b"]
    assert all(conversation.cache(name) is made.native for name, made in zip("ab", factory.made, strict=True))
    assert conversation.cached_length("a") == 30 and conversation.cached_length("b") == 20
    conversation.reprefill("b")
    assert [made.engine for made in factory.made] == ["a", "b", "b"]
    assert conversation.cache("b") is factory.made[2].native
    assert conversation.fork().cache_factory is factory
