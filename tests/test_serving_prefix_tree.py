"""The tree of caches found by token prefix (kvhandoff.serving.prefix_tree): insert, match and split exactness, the
longest prefix of every model, exact-only lookups, namespaces apart, LRU eviction of leaves, locked paths, bytes
accounting against a reference model, answers grown token by token, threads."""

from __future__ import annotations

import json
import random
import sys
import threading

import pytest
import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.model.cache import cache_of
from kvhandoff.serving.prefix_reuse import choose_reuse
from kvhandoff.serving.prefix_tree import EXACT, PrefixTree, Provenance, derived_from, mapped_from
from kvhandoff.serving.row_ops import SEAM_ROWS, RowOps

LAYERS, HEAD_DIM = 2, 2
HEADS = {"a": 1, "b": 2, "c": 1}
TAGS = {"a": 1, "b": 2, "c": 3}


def position_bytes(model: str) -> int:
    return LAYERS * 2 * HEADS[model] * HEAD_DIM * 4  # keys and values, float32


def make_rows(tokens, model="a", start=0, mapped=False):
    """Rows of positions start..len(tokens)−1 whose values name the model, the provenance, the position and the
    token (so any slice is checkable)."""
    ids = torch.tensor(tokens[start:], dtype=torch.float32)
    positions = torch.arange(start, len(tokens), dtype=torch.float32)
    value = TAGS[model] * 100_000 + mapped * 10_000 + positions * 100 + ids
    count = len(tokens) - start
    layers = []
    for layer in range(LAYERS):
        keys = (value + layer / 4).view(1, 1, count, 1).expand(1, HEADS[model], count, HEAD_DIM).contiguous()
        layers.append((keys, -keys))
    return cache_of(layers)


def assert_rows(rows, expected):
    assert len(rows.layers) == len(expected.layers)
    for got, want in zip(rows.layers, expected.layers, strict=True):
        assert torch.equal(got.keys, want.keys)
        assert torch.equal(got.values, want.values)


def insert(tree, tokens, model="a", namespace="t", mapped=None, start=0, **kwargs):
    provenance = EXACT if mapped is None else mapped_from(mapped)
    return tree.insert(namespace, tokens, model, make_rows(tokens, model, start, mapped is not None), provenance,
                       start=start, **kwargs)


# -- insert, match, split ------------------------------------------------------------------------------------------
def test_a_prefix_is_served_with_the_slice_of_what_was_inserted():
    tree = PrefixTree()
    tokens = [5, 6, 7, 8, 9]
    handle = insert(tree, tokens)
    assert handle.length == 5
    match = tree.match("t", [5, 6, 7, 1, 2], "a")
    assert (match.own.length, match.own.exact, match.own.mapped) == (3, 3, False)
    assert_rows(match.rows("a"), make_rows(tokens[:3]))
    assert_rows(match.rows("a", 1, 3), SEAM_ROWS.slice(make_rows(tokens), 1, 3))
    full = tree.match("t", [*tokens, 4], "a")
    assert full.own.length == 5
    assert_rows(full.rows("a"), make_rows(tokens))
    with pytest.raises(ConfigError, match=r"holds positions 0\.\.4"):
        full.rows("a", 0, 6)


def test_a_split_keeps_every_models_rows_sliced_consistently():
    tree = PrefixTree()
    first = [1, 2, 3, 4, 5, 6]
    insert(tree, first, "a")
    insert(tree, first, "b")
    assert tree.stats().nodes == 1
    insert(tree, [1, 2, 3, 9, 9], "a")  # diverges inside the node: split after 3 tokens
    stats = tree.stats()
    assert stats.nodes == 3
    assert stats.models["b"].nodes == 2 and stats.models["a"].nodes == 3
    for model in ("a", "b"):
        match = tree.match("t", first, model)
        assert match.own.length == 6
        assert_rows(match.rows(model), make_rows(first, model))
    other = tree.match("t", [1, 2, 3, 9, 9], "a")
    assert other.own.length == 5 and other.hold("b").length == 3
    assert_rows(other.rows("a"), make_rows([1, 2, 3, 9, 9], "a"))
    assert_rows(other.rows("b"), make_rows([1, 2, 3], "b"))


def test_inserting_a_prefix_already_held_is_a_no_op():
    tree = PrefixTree()
    insert(tree, [1, 2, 3, 4])
    before = tree.stats()
    handle = tree.insert("t", [1, 2], "a", make_rows([1, 2], "c"))  # other values: they must not replace the held
    assert handle.length == 2
    assert tree.stats() == before
    assert_rows(tree.match("t", [1, 2, 3, 4], "a").rows("a"), make_rows([1, 2, 3, 4]))


def test_the_tree_keeps_copies_of_the_rows_it_is_given():
    tree = PrefixTree()
    rows = make_rows([1, 2, 3])
    tree.insert("t", [1, 2, 3], "a", rows)
    rows.layers[0].keys.zero_()  # the caller's cache changes afterwards (a write, a reuse of its buffers)
    assert_rows(tree.match("t", [1, 2, 3], "a").rows("a"), make_rows([1, 2, 3]))


def test_an_insert_past_what_the_model_holds_keeps_nothing():
    tree = PrefixTree()
    insert(tree, [1, 2], "a")
    handle = insert(tree, [1, 2, 3, 4, 5], "a", start=3)  # position 2 is missing
    assert handle.length == 2
    assert tree.total_bytes() == 2 * position_bytes("a")
    handle = insert(tree, [7, 8, 9], "b", start=1)  # nothing of this prompt is held
    assert handle.length == 0
    assert tree.match("t", [7, 8, 9], "b").own.length == 0


# -- several models ------------------------------------------------------------------------------------------------
def test_every_model_reports_its_longest_prefix_and_a_longer_one_elsewhere_is_a_handoff():
    tree = PrefixTree()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    insert(tree, prompt[:8], "a")
    insert(tree, prompt[:3], "b")
    match = tree.match("t", prompt, "b")
    assert match.own.length == 3 and match.hold("a").length == 8 and match.hold("c").length == 0
    reuse = choose_reuse(match, limit=len(prompt) - 1)
    assert (reuse.kind, reuse.own, reuse.source, reuse.source_length, reuse.reused) == ("handoff", 3, "a", 8, 8)
    assert_rows(match.rows("a", reuse.own, reuse.source_length), make_rows(prompt[:8], "a", start=3))
    assert choose_reuse(match, limit=3).kind == "own"  # capped: a's longer prefix no longer counts
    assert choose_reuse(match, sources={"c"}).kind == "own"  # no mapper from a
    assert choose_reuse(match, min_gain=6).kind == "own"
    assert choose_reuse(tree.match("t", prompt, "a")).kind == "own"
    cold = tree.match("t", prompt, "c")
    assert choose_reuse(cold) == choose_reuse(cold, sources={"a"})
    assert (choose_reuse(cold).kind, choose_reuse(cold).own) == ("handoff", 0)
    assert choose_reuse(tree.match("t", [42], "c")).kind == "miss"


def test_derived_rows_may_be_handed_over_and_a_mappers_output_never():
    """b's rows 0..3 are a's mapped, 4..7 computed by b on top (derived): from 4 on, b may hand over to a; from 2
    on it may not (its rows 2..3 are a mapper's output)."""
    tree = PrefixTree()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    insert(tree, prompt[:4], "a")
    insert(tree, prompt[:4], "b", mapped="a")
    tree.insert("t", prompt[:8], "b", make_rows(prompt[:8], "b", 4, True), derived_from("a"), start=4)
    match = tree.match("t", prompt, "a")
    b = match.hold("b")
    assert (b.length, b.exact, b.mapped_until, b.sources) == (8, 0, 4, ("a",))
    assert b.transferable(4) == 8 and b.transferable(2) == 2
    reuse = choose_reuse(match, limit=len(prompt) - 1)
    assert (reuse.kind, reuse.own, reuse.source, reuse.source_length) == ("handoff", 4, "b", 8)
    short = PrefixTree()
    insert(short, prompt[:2], "a")
    insert(short, prompt[:4], "b", mapped="a")
    short.insert("t", prompt[:8], "b", make_rows(prompt[:8], "b", 4, True), derived_from("a"), start=4)
    assert choose_reuse(short.match("t", prompt, "a")).kind == "own"  # b's rows 2..3 would go back through a mapper
    assert tree.stats().models["a"].handoff_candidates == 1
    with pytest.raises(ConfigError, match="derived provenance"):
        Provenance("derived")


def test_exact_only_lookups_never_see_mapped_rows():
    tree = PrefixTree()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    insert(tree, prompt, "a")
    insert(tree, prompt[:3], "b")
    insert(tree, prompt[:6], "b", mapped="a", start=3)  # a handoff: a's rows of positions 3..5 mapped for b
    insert(tree, prompt, "c", mapped="a")
    loose = tree.match("t", prompt, "b")
    assert (loose.own.length, loose.own.exact, loose.own.sources) == (6, 3, ("a",))
    expected = make_rows(prompt[:3], "b").layers, make_rows(prompt[:6], "b", 3, mapped=True).layers
    assert_rows(loose.rows("b"), cache_of((torch.cat([x.keys, y.keys], -2), torch.cat([x.values, y.values], -2))
                                          for x, y in zip(*expected, strict=True)))
    strict = tree.match("t", prompt, "b", exact_only=True)
    assert (strict.own.length, strict.own.exact) == (3, 3)
    assert "c" not in strict.holds  # another model's mapped rows are not offered either
    with pytest.raises(ConfigError, match="exactly"):
        strict.rows("b", 0, 6)
    assert choose_reuse(strict).kind == "own"  # no handoff for an exact-only request, though a holds 8
    assert choose_reuse(strict).own == 3
    assert loose.hold("c").mapped_until == 8 and loose.own.mapped_until == 6
    # mapped rows are never a handoff's source: c holds all 8, mapped
    assert choose_reuse(tree.match("t", prompt, "b"), sources={"c"}).kind == "own"


def test_exact_rows_replace_mapped_ones():
    tree = PrefixTree()
    prompt = [4, 5, 6, 7, 8, 9]
    insert(tree, prompt, "b", mapped="a")
    before = tree.total_bytes()
    insert(tree, prompt[:4], "b")
    assert tree.total_bytes() == before
    match = tree.match("t", prompt, "b")
    assert (match.own.length, match.own.exact) == (6, 4)
    assert_rows(match.rows("b", 0, 4), make_rows(prompt[:4], "b"))
    assert_rows(match.rows("b", 4), make_rows(prompt, "b", 4, mapped=True))
    insert(tree, prompt[:5], "b", mapped="c")  # mapped rows over exact ones: nothing changes
    assert tree.match("t", prompt, "b").own.exact == 4


def test_namespaces_are_isolated():
    tree = PrefixTree()
    insert(tree, [1, 2, 3], "a", namespace="alice")
    assert tree.match("bob", [1, 2, 3], "a").own.length == 0
    assert tree.match("alice", [1, 2, 3], "a").own.length == 3
    insert(tree, [1, 2, 3, 4], "a", namespace="bob", mapped="b")
    assert tree.match("alice", [1, 2, 3, 4], "a").own.exact == 3
    stats = tree.stats()
    assert stats.namespaces == 2 and stats.nodes == 2
    assert tree.evict(0) == 7 * position_bytes("a")
    assert tree.stats().namespaces == 0


# -- eviction and locks --------------------------------------------------------------------------------------------
def three_branches():
    tree = PrefixTree()
    for tail in ([3, 4], [5, 6], [7, 8]):
        insert(tree, [1, 2, *tail])
    return tree


def test_eviction_drops_least_recently_used_leaves_first_then_parents():
    tree = three_branches()
    unit = position_bytes("a")
    assert tree.stats().nodes == 4 and tree.total_bytes() == 8 * unit
    tree.match("t", [1, 2, 3, 4], "a")  # [3, 4] is now the most recently used leaf; [5, 6] the least
    assert tree.evict(6 * unit) == 2 * unit
    assert tree.match("t", [1, 2, 5, 6], "a").own.length == 2
    tree.match("t", [1, 2, 3, 4], "a")
    assert tree.evict(4 * unit) == 2 * unit
    assert tree.match("t", [1, 2, 7, 8], "a").own.length == 2
    assert tree.evict(3 * unit) == 2 * unit  # the parent [1, 2] is no leaf until [3, 4] goes
    assert tree.match("t", [1, 2, 3, 4], "a").own.length == 2
    assert tree.evict(0) == 2 * unit
    stats = tree.stats()
    assert (stats.bytes, stats.nodes, stats.evictions, stats.models["a"].evictions) == (0, 0, 4, 4)
    assert tree.evict(0) == 0


def test_locked_paths_are_never_evicted():
    tree = three_branches()
    unit = position_bytes("a")
    match = tree.match("t", [1, 2, 3, 4, 9], "a", lock=True)
    assert tree.stats().locked == 1
    tree.evict(0)
    assert tree.total_bytes() == 4 * unit
    assert tree.match("t", [1, 2, 3, 4], "a").own.length == 4
    tree.lock(match.handle)  # a reference count: two locks need two unlocks
    tree.unlock(match.handle)
    tree.evict(0)
    assert tree.total_bytes() == 4 * unit
    tree.unlock(match.handle)
    with pytest.raises(KVHandoffError, match="not locked"):
        tree.unlock(match.handle)
    assert tree.evict(0) == 4 * unit
    with pytest.raises(KVHandoffError, match="evicted"):
        tree.lock(match.handle)
    with pytest.raises(ConfigError, match="not one of this"):
        PrefixTree().lock(match.handle)


def test_a_lock_holds_across_a_split_of_its_node():
    tree = PrefixTree()
    handle = insert(tree, [1, 2, 3, 4], lock=True)
    insert(tree, [1, 2, 9])  # splits the locked node: its new parent is on the locked path too
    tree.evict(0)
    assert tree.match("t", [1, 2, 3, 4], "a").own.length == 4
    assert tree.match("t", [1, 2, 9], "a").own.length == 2
    tree.unlock(handle)
    tree.evict(0)
    assert tree.stats().nodes == 0


def test_a_short_match_locks_only_its_path():
    tree = three_branches()
    match = tree.match("t", [1, 2, 0], "a", lock=True)
    tree.evict(0)
    assert tree.total_bytes() == 2 * position_bytes("a")
    tree.unlock(match.handle)


def test_evicting_one_models_rows_keeps_the_node_for_the_others():
    tree = PrefixTree()
    insert(tree, [1, 2, 3, 4], "b")
    insert(tree, [1, 2, 3, 4, 5, 6], "a")  # node [1..4] (a, b), child [5, 6] (a)
    nodes = tree.stats().nodes
    assert tree.evict(0, model="b") == 4 * position_bytes("b")
    stats = tree.stats()
    assert stats.nodes == nodes and stats.models["b"].bytes == 0 and stats.models["b"].evictions == 1
    assert tree.match("t", [1, 2, 3, 4, 5, 6], "a").own.length == 6
    insert(tree, [1, 2, 3, 4], "b")
    tree.match("t", [1, 2, 3, 4], "b")  # the shared node is newer than a's leaf [5, 6]
    tree.evict(tree.total_bytes() - 1)
    assert tree.match("t", [1, 2, 3, 4, 5, 6], "a").own.length == 4
    assert tree.match("t", [1, 2, 3, 4], "b").own.length == 4


# -- answers grown token by token ----------------------------------------------------------------------------------
def test_generated_tokens_are_appended_in_place():
    tree = PrefixTree()
    tokens = [3, 1, 4, 1, 5]
    insert(tree, tokens, lock=True)
    for step in range(300):
        tokens.append(step % 7)
        handle = insert(tree, tokens, start=len(tokens) - 1)
        assert handle.length == len(tokens)
    stats = tree.stats()
    assert stats.nodes == 1 and stats.bytes == len(tokens) * position_bytes("a")
    assert_rows(tree.match("t", tokens, "a").rows("a"), make_rows(tokens))
    assert_rows(tree.match("t", tokens[:150], "a").rows("a", 100), make_rows(tokens[:150], start=100))


def test_an_answer_grows_a_child_where_another_model_shares_the_leaf():
    tree = PrefixTree()
    insert(tree, [1, 2, 3], "a")
    insert(tree, [1, 2, 3], "b")
    insert(tree, [1, 2, 3, 4], "a", start=3)
    insert(tree, [1, 2, 3, 4, 5], "a", start=4)
    assert tree.stats().nodes == 2
    insert(tree, [1, 2, 3, 4], "b", mapped="a", start=3)  # b now shares [4, 5] up to 4: a split
    assert tree.stats().nodes == 3
    assert_rows(tree.match("t", [1, 2, 3, 4, 5], "a").rows("a"), make_rows([1, 2, 3, 4, 5], "a"))


# -- stats and validation ------------------------------------------------------------------------------------------
def test_stats_count_own_and_mapped_hits_misses_and_bytes():
    tree = PrefixTree()
    insert(tree, [1, 2, 3, 4], "a")
    insert(tree, [1, 2], "b")
    insert(tree, [1, 2, 3], "b", mapped="a", start=2)
    tree.match("t", [1, 2, 3, 4], "a")
    tree.match("t", [1, 2, 3, 4], "b")
    tree.match("t", [1, 2, 3, 4], "b", exact_only=True)
    tree.match("t", [9], "b")
    stats = tree.stats()
    a, b = stats.models["a"], stats.models["b"]
    assert (a.hits_own, a.hits_mapped, a.misses, a.hit_tokens, a.queried_tokens) == (1, 0, 0, 4, 4)
    assert (b.hits_own, b.hits_mapped, b.misses, b.handoff_candidates) == (1, 1, 1, 2)
    assert (b.hit_tokens, b.queried_tokens) == (5, 9)
    assert (a.bytes, b.bytes) == (4 * position_bytes("a"), 3 * position_bytes("b"))
    assert stats.bytes == a.bytes + b.bytes == tree.total_bytes()
    assert json.loads(json.dumps(stats.to_dict()))["models"]["b"]["bytes"] == b.bytes


@pytest.mark.parametrize(("call", "message"), [
    (lambda t: t.match("", [1], "a"), "namespace"),
    (lambda t: t.match("t", [], "a"), "at least one"),
    (lambda t: t.match("t", [1, -2], "a"), "non-negative"),
    (lambda t: t.match("t", [1, True], "a"), "non-negative"),
    (lambda t: t.match("t", "abc", "a"), "sequence of integers"),
    (lambda t: t.match("t", torch.ones(2, 2, dtype=torch.long), "a"), "1-D"),
    (lambda t: t.match("t", [1], None), "model"),
    (lambda t: t.insert("t", [1, 2], "a", make_rows([1, 2, 3])), "3 positions"),
    (lambda t: t.insert("t", [1, 2], "a", make_rows([1]), start=2), "start"),
    (lambda t: t.insert("t", [1, 2], "a", make_rows([1, 2]), "exact"), "Provenance"),
    (lambda t: t.insert("t", [1, 2], "a", make_rows([1, 2]), mapped_from("a")), "itself"),
    (lambda t: Provenance("guessed"), "exact, mapped"),
    (lambda t: Provenance("exact", "a"), "no source"),
    (lambda t: mapped_from(""), "source"),
    (lambda t: t.evict(-1), "limit_bytes"),
    (lambda t: choose_reuse(t.match("t", [1], "a"), limit=-1), "limit"),
    (lambda t: choose_reuse(t.match("t", [1], "a"), min_gain=0), "min_gain"),
    (lambda t: PrefixTree(ops=object()), "row operations"),
])
def test_bad_input_is_refused_by_name(call, message):
    with pytest.raises(ConfigError, match=message):
        call(PrefixTree())


def test_tensor_token_ids_are_accepted():
    tree = PrefixTree()
    insert(tree, [1, 2, 3])
    assert tree.match("t", torch.tensor([1, 2, 7]), "a").own.length == 2


# -- another row type ----------------------------------------------------------------------------------------------
class TupleRows:
    """Rows as a tuple of numbers, one per position: an engine's own row type behind `RowOps`."""

    def positions(self, rows):
        return len(rows)

    def slice(self, rows, start, end):
        return rows[start:end]

    def concat(self, parts):
        return tuple(value for part in parts for value in part)

    def nbytes(self, rows):
        return 8 * len(rows)


def test_an_engines_own_row_type_works_through_the_protocol():
    assert isinstance(TupleRows(), RowOps)
    tree = PrefixTree(model_ops={"e": TupleRows()})
    tree.insert("t", [1, 2, 3, 4], "e", (10, 20, 30, 40))
    tree.insert("t", [1, 2, 5], "e", (10, 20, 50))
    insert(tree, [1, 2, 3], "a")  # the default seam rows next to the engine's
    match = tree.match("t", [1, 2, 3, 4], "e")
    assert match.rows("e") == (10, 20, 30, 40) and match.rows("e", 1, 3) == (20, 30)
    assert tree.match("t", [1, 2, 5], "e").rows("e") == (10, 20, 50)
    assert tree.stats().models["e"].bytes == 8 * 5
    assert_rows(match.rows("a"), make_rows([1, 2, 3]))


# -- a randomized run against a reference model --------------------------------------------------------------------
class Reference:
    """What each (namespace, model) holds: token tuple of every held prefix → mapped (True) or exact."""

    def __init__(self):
        self.held: dict[tuple[str, str], dict[tuple[int, ...], bool]] = {}

    def of(self, namespace, model):
        return self.held.setdefault((namespace, model), {})

    def insert(self, namespace, model, tokens, mapped, start):
        held = self.of(namespace, model)
        if any(tuple(tokens[:i]) not in held for i in range(1, start + 1)):
            return self.length(namespace, model, tokens)
        for i in range(start + 1, len(tokens) + 1):
            prefix = tuple(tokens[:i])
            if prefix not in held or (held[prefix] and not mapped):
                held[prefix] = mapped
        return len(tokens)

    def length(self, namespace, model, tokens):
        held = self.of(namespace, model)
        return next((i for i in range(len(tokens), 0, -1) if tuple(tokens[:i]) in held), 0)

    def exact(self, namespace, model, tokens):
        held, count = self.of(namespace, model), 0
        while count < len(tokens) and held.get(tuple(tokens[: count + 1])) is False:
            count += 1
        return count

    def bytes(self, model=None):
        return sum(len(held) * position_bytes(name) for (_, name), held in self.held.items()
                   if model is None or name == model)

    def expected_rows(self, namespace, model, tokens, end):
        held = self.of(namespace, model)
        parts = [make_rows(tokens[: i + 1], model, i, held[tuple(tokens[: i + 1])]) for i in range(end)]
        return SEAM_ROWS.concat(parts)


def test_randomized_operations_agree_with_a_reference_model():
    rng = random.Random(7)
    tree, ref = PrefixTree(), Reference()
    namespaces, models = ["n1", "n2"], ["a", "b"]
    locked = []  # (match, namespace, tokens) pinned

    def random_tokens():
        return [rng.randrange(4) for _ in range(rng.randint(1, 9))]

    for step in range(600):
        namespace, model = rng.choice(namespaces), rng.choice(models)
        other = "b" if model == "a" else "a"
        action = rng.random()
        if action < 0.35:
            tokens, mapped = random_tokens(), rng.random() < 0.3
            handle = insert(tree, tokens, model, namespace, other if mapped else None)
            assert handle.length == ref.insert(namespace, model, tokens, mapped, 0) == len(tokens)
        elif action < 0.55:  # an answer's tokens, or rows past a gap
            held = [list(p) for p in ref.of(namespace, model)] or [random_tokens()]
            base = rng.choice(held)
            tokens = base + [rng.randrange(4) for _ in range(rng.randint(1, 3))]
            start = len(base) if rng.random() < 0.8 else rng.randint(1, len(tokens) - 1)
            prefix_mapped = ref.of(namespace, model).get(tuple(tokens[:start]))
            mapped = True if prefix_mapped else rng.random() < 0.2 if prefix_mapped is None else False
            handle = insert(tree, tokens, model, namespace, other if mapped else None, start=start)
            assert handle.length == ref.insert(namespace, model, tokens, mapped, start), step
        elif action < 0.9:
            tokens, exact_only = random_tokens(), rng.random() < 0.3
            match = tree.match(namespace, tokens, model, exact_only, lock=rng.random() < 0.1)
            for name in models:
                length, exact = ref.length(namespace, name, tokens), ref.exact(namespace, name, tokens)
                hold = match.hold(name)
                assert (hold.length, hold.exact) == ((exact, exact) if exact_only else (length, exact)), step
                if hold.length:
                    assert_rows(match.rows(name), ref.expected_rows(namespace, name, tokens, hold.length))
            if match.handle.locks:
                locked.append((match, namespace, tokens))
        elif action < 0.95 and locked:
            match, _, _ = locked.pop(rng.randrange(len(locked)))
            tree.unlock(match.handle)
        else:
            limit = rng.randint(0, tree.total_bytes())
            tree.evict(limit, model=rng.choice([None, model]))
            for (ns, name), held in ref.held.items():  # what is still held must be a prefix-closed subset
                for prefix in list(held):
                    if tree.match(ns, prefix, name).own.length < len(prefix):
                        del held[prefix]
                assert all(prefix[:-1] in held for prefix in held if len(prefix) > 1)
            if not locked:
                assert tree.total_bytes() <= limit or tree.stats().models[model].bytes <= limit
            for match, ns, tokens in locked:  # pinned paths keep every model's rows
                again = tree.match(ns, tokens, match.model, match.exact_only)
                assert all(again.hold(name).length >= hold.length for name, hold in match.holds.items())
        stats = tree.stats()
        assert stats.bytes == ref.bytes(), step
        for name in models:
            assert stats.models.get(name, None) is None or stats.models[name].bytes == ref.bytes(name), step
    for match, _, _ in locked:
        tree.unlock(match.handle)
    tree.evict(0)
    stats = tree.stats()
    assert (stats.bytes, stats.nodes, stats.namespaces, stats.locked) == (0, 0, 0, 0)


# -- threads -------------------------------------------------------------------------------------------------------
def test_threads_share_one_tree_safely():
    tree = PrefixTree()
    errors = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many interleavings

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                tokens = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
                model = rng.choice(["a", "b"])
                roll = rng.random()
                if roll < 0.4:
                    insert(tree, tokens, model)
                elif roll < 0.85:
                    match = tree.match("t", tokens, model, lock=True)
                    if match.own.length:
                        assert_rows(match.rows(model), make_rows(tokens[: match.own.length], model))
                    tree.unlock(match.handle)
                else:
                    tree.evict(rng.randint(0, 40) * 32)
        except Exception as exc:  # reported below, with the thread's seed
            errors.append((seed, exc))

    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    stats = tree.stats()
    assert stats.locked == 0
    assert stats.bytes == sum(model.bytes for model in stats.models.values())
    tree.evict(0)
    stats = tree.stats()
    assert (stats.bytes, stats.nodes, stats.namespaces) == (0, 0, 0)
    assert all(model.bytes == 0 and model.nodes == 0 for model in stats.models.values())
