"""The cache seam (kvhandoff.runtime.seam): `TransformersCache` implements the `KVCache` lifecycle on a DynamicCache —
export rows, append and write rows, the forward that recomputes pending positions and reads new tokens, truncate,
copy, the memory held."""

import inspect

import pytest
import torch

from kvhandoff import KVCache, prefill
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
