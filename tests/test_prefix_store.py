"""The store of the target's own exact-prefix K/V (kvhandoff.runtime.prefix_store): rows by model and token ids,
least recently used dropped first, primed by a prefill."""

import pytest
import torch

from kvhandoff import PrefixStore, prefill
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.seam import as_kv_cache

from conftest import tiny_model


def ids_of(batch=1, tokens=4, seed=3):
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", layers=2)


def test_rows_are_stored_per_model_and_looked_up_whole(model):
    other = tiny_model("qwen2", layers=2, seed=5)
    store = PrefixStore(capacity=2)
    ids = ids_of(batch=2, tokens=10)
    own, _ = prefill(model, ids)
    store.remember(model, ids[:, :4], as_kv_cache(own))  # a KVCache, or the engine's own cache
    assert len(store) == 2
    rows = store.lookup(model, ids[:, :4], torch.float32)
    assert rows.get_seq_length() == 4 and torch.equal(rows.layers[1].values, own.layers[1].values[:, :, :4])
    assert store.lookup(other, ids[:, :4], torch.float32) is None  # another model's are its own
    assert store.lookup(model, ids[:, :4], torch.bfloat16) is None  # and another dtype's
    assert store.lookup(model, ids_of(batch=2, seed=9), torch.float32) is None  # a row not stored: nothing
    assert (store.hits, store.misses) == (1, 3)
    with torch.inference_mode():
        own.layers[0].keys.zero_()  # the store keeps copies
    assert store.lookup(model, ids[:1, :4], torch.float32).layers[0].keys.abs().max() > 0


def test_the_least_recently_used_opening_is_dropped_first(model):
    store = PrefixStore(capacity=2)
    openings = [ids_of(seed=s) for s in range(3)]
    for opening in openings[:2]:
        store.prime(model, opening)
    assert store.lookup(model, openings[0], torch.float32) is not None  # opening 0 used again: 1 is the oldest
    store.prime(model, openings[2])
    assert len(store) == 2 and store.lookup(model, openings[1], torch.float32) is None
    own, _ = prefill(model, openings[2])
    assert torch.equal(store.lookup(model, openings[2], torch.float32).layers[0].keys, own.layers[0].keys)
    store.clear()
    assert len(store) == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="capacity"):
            PrefixStore(capacity=bad)


def test_a_namespace_sees_only_its_own_openings_and_trim_bounds_the_bytes(model):
    store = PrefixStore(capacity=4)
    alice, bob = store.within("alice"), store.within("bob")
    opening = ids_of(seed=7)
    alice.prime(model, opening)
    assert bob.lookup(model, opening, torch.float32) is None  # another tenant's opening is not found
    assert store.lookup(model, opening, torch.float32) is None  # nor by the store's own (namespace None)
    assert alice.lookup(model, opening, torch.float32) is not None
    assert (store.hits, store.misses) == (1, 2) and len(store) == len(bob) == 1  # counters and entries shared
    one = store.bytes()
    assert one == sum(t.numel() * t.element_size() for layer in prefill(model, opening)[0].layers
                      for t in (layer.keys, layer.values))
    bob.prime(model, opening)
    store.prime(model, ids_of(seed=8))
    assert len(store) == 3 and store.bytes() == 3 * one
    assert alice.lookup(model, opening, torch.float32) is not None  # alice's is now the most recently used
    assert store.trim(one) == 2 and store.bytes() == one
    assert alice.lookup(model, opening, torch.float32) is not None and bob.lookup(model, opening, torch.float32) is None
    store.clear()
    assert store.bytes() == 0 and len(alice) == 0
