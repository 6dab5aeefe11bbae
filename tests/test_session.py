import pytest
import torch

from kvhandoff import FitConfig, HandoffPlan, SwitchingSession, fit_mapper
from kvhandoff.errors import ConfigError, ContextTooLongError, MapperMismatchError
from kvhandoff.runtime.policy import NoRecompute, Recent, SourceAttention

from conftest import random_batches, tiny_model


@pytest.fixture(scope="module")
def trio():
    """Models a (source) and b (target) with a mapper a → b, and c: b's geometry, other weights."""
    a = tiny_model("qwen2", layers=2, max_position_embeddings=64)
    b = tiny_model("qwen2", layers=3, head_dim=32, seed=4, max_position_embeddings=64)
    c = tiny_model("qwen2", layers=3, head_dim=32, seed=12, max_position_embeddings=64)
    return a, b, c, fit_mapper(a, b, random_batches(2, tokens=32), FitConfig(), progress=False)


def test_a_mapper_for_another_pair_is_refused_when_the_session_starts(trio):
    a, b, c, mapper = trio
    with pytest.raises(MapperMismatchError, match="different target model"):
        SwitchingSession({"a": a, "c": c}, {("a", "c"): mapper})
    with pytest.raises(MapperMismatchError, match="different source model"):
        SwitchingSession({"c": c, "b": b}, {("c", "b"): mapper})
    with pytest.raises(ConfigError, match="unknown model"):
        SwitchingSession({"a": a}, {("a", "b"): mapper})
    SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper})  # the right pair starts


def test_the_pair_is_fingerprinted_once_per_mapper_and_model(trio, monkeypatch):
    import kvhandoff.mapper.pairing as mapper_module

    a, b, _, mapper = trio
    fresh = type(mapper)(mapper.weight, mapper.bias, mapper.selected, mapper.manifest)
    back = fit_mapper(b, a, random_batches(2, tokens=32), FitConfig(), progress=False)
    calls = []
    real = mapper_module.model_fingerprint
    monkeypatch.setattr(mapper_module, "model_fingerprint", lambda model, tok=None: calls.append(model) or real(model))
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): fresh, ("b", "a"): back}, plan=HandoffPlan(0))
    assert calls == [a, b, b, a]  # each mapper checked against its two models when the session starts
    ids = torch.randint(0, 128, (30,)).tolist()
    session.read("a", ids[:10])
    session.read("b", ids[10:15])
    session.read("a", ids[15:20])
    session.read("b", ids[20:])  # a second switch a → b: catch_up, no new fingerprint
    assert calls == [a, b, b, a] and session.cache("b").get_seq_length() == 30


def test_a_turn_past_the_window_is_refused_before_any_work(trio):
    a, b, _, mapper = trio
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=HandoffPlan(0))
    session.read("a", torch.randint(0, 128, (50,)).tolist())
    before = (list(session.tokens), session.owner, session.cache("a").get_seq_length())
    with pytest.raises(ContextTooLongError, match="65 tokens"):
        session.read("b", list(range(15)))
    with pytest.raises(ContextTooLongError, match="70 tokens"):
        session.generate("a", list(range(20)), max_new_tokens=1)
    assert (list(session.tokens), session.owner, session.cache("a").get_seq_length()) == before
    assert session.cache("b") is None  # nothing was handed over
    session.read("b", list(range(14)))  # up to the window is fine
    assert len(session.tokens) == 64 and session.cache("b").get_seq_length() == 64


def _count_forwards(model):
    """A list that grows by one per forward of ``model``'s decoder body (hook handle second)."""
    calls = []
    handle = model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize(("handover", "recompute"), [("all", None), ("incremental", None),
                                                     ("incremental", "sinks:30%"), ("all", "deviation:20%")])
def test_a_switch_is_one_forward_of_the_receiving_model_with_the_two_step_logits(trio, handover, recompute):
    """At a handover the receiving model recomputes the exact prefix (and the policy's picks) in the forward that
    reads the turn: one forward, not two, and the log-probs of the handover that recomputes first."""
    a, b, _, mapper = trio
    back = fit_mapper(b, a, random_batches(2, tokens=32), FitConfig(), progress=False)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    plan = HandoffPlan.of(recompute=recompute)
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper, ("b", "a"): back}, handover, plan)
    reference = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper, ("b", "a"): back}, handover, plan)
    for who, turn in (("a", ids[:12]), ("b", ids[12:20]), ("a", ids[20:28]), ("b", ids[28:])):
        calls, handle = _count_forwards(session.models[who])
        fused = session.read(who, turn)
        handle.remove()
        assert len(calls) == 1  # the recompute and the read in one forward, at a switch too
        reference.switch_to(who)  # the two-step handover: recompute first, then the read (no handover left)
        calls, handle = _count_forwards(reference.models[who])
        logits = reference.read(who, turn)
        handle.remove()
        assert len(calls) == 1 and (fused - logits).abs().max() <= 1e-5
    assert session.cache("b").get_seq_length() == 40


def test_a_fork_hands_over_and_reads_without_touching_the_session(trio):
    a, b, _, mapper = trio
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=HandoffPlan(0))
    ids = torch.randint(0, 128, (40,)).tolist()
    session.read("a", ids[:30])
    before = (list(session.tokens), session.owner, session.cache("a").layers[0].keys.clone())
    twin = session.fork()
    twin.plan = twin.plan.with_recompute(Recent(0.5))
    forked = twin.read("b", ids[30:])
    twin.read("b", ids[:3])  # the fork goes on; the session does not
    assert (list(session.tokens), session.owner) == before[:2] and session.cache("b") is None
    assert session.cache("a").get_seq_length() == 30 and torch.equal(session.cache("a").layers[0].keys, before[2])
    assert twin.cache("b").get_seq_length() == 43 and len(twin.tokens) == 43
    # the session itself hands over the same way as the fork did
    session.plan = session.plan.with_recompute(Recent(0.5))
    torch.testing.assert_close(session.read("b", ids[30:]), forked)


def test_a_session_holds_one_validated_plan_of_policy_objects(trio):
    """The plan is built and validated at the edge (`HandoffPlan.of` reads a spec once); a session takes the plan as
    it is and refuses a spec, a bare policy or settings of the wrong kind."""
    a, b, _, mapper = trio
    plan = HandoffPlan.of(2, "source_attention:10%:window=8")
    assert plan == HandoffPlan(2, SourceAttention(0.1, source_window=8))
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=plan)
    assert session.plan is plan and isinstance(session.plan.recompute, SourceAttention)
    assert SwitchingSession({"a": a}, {}).plan == HandoffPlan()
    for bad in ("recent:5%", Recent(0.05), {"exact_prefix": 0}):
        with pytest.raises(ConfigError, match="HandoffPlan"):
            SwitchingSession({"a": a}, {}, plan=bad)
    for bad in ({"recompute": "recent:5%"}, {"recompute": None}, {"exact_prefix": -1}, {"exact_prefix": 1.5},
                {"exact_prefix": True}, {"prefix_store": "store"}):
        with pytest.raises(ConfigError):
            HandoffPlan(**bad)
    assert HandoffPlan.of(recompute="none").recompute == NoRecompute()
    assert HandoffPlan.of(4).with_recompute(Recent(0.5)) == HandoffPlan(4, Recent(0.5))
    assert HandoffPlan().prefix_length(mapper, 100) == mapper.exact_prefix
    assert HandoffPlan(7).prefix_length(mapper, 5) == 5


def test_a_model_knows_its_own_positions_and_a_reprefill_reads_only_the_rest(trio):
    """own_length: what a model read on a cache of its own positions only; mapped positions, and those read on top
    of them, are not its own. A re-prefill keeps its own positions bit for bit and reads only the rest, ending where
    a prefill of the whole conversation ends."""
    a, b, _, forward = trio
    back = fit_mapper(b, a, random_batches(2, tokens=32), FitConfig(), progress=False)
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): forward, ("b", "a"): back}, plan=HandoffPlan(2))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    session.read("a", ids[:10])
    session.read("a", ids[10:14])  # on its own cache: still all its own
    assert session.own_length("a") == 14 and session.own_length("b") == 0
    session.read("b", ids[14:20])  # b's cache is mapped from its first position (its exact prefix recomputed)
    assert session.own_length("b") == 0 and session.cached_length("b") == 20
    session.read("a", ids[20:26])  # back to a: positions 14..19 mapped, 20..25 read on top of them
    assert (session.own_length("a"), session.cached_length("a")) == (14, 26)
    twin = session.fork()
    session.truncate(12)
    assert session.own_length("a") == 12 and twin.own_length("a") == 14  # the fork keeps its own account
    session.read("b", ids[12:18])
    session.read("a", ids[18:22])
    assert (session.own_length("a"), session.reprefill_start("a"), session.reprefill_start("a", keep_own=False)) \
        == (12, 12, 0)
    own_before = [(layer.keys[:, :, :12].clone(), layer.keys[:, :, 12:18].clone()) for layer in
                  session.cache("a").layers]
    got = session.reprefill("a")
    full = a(input_ids=torch.tensor([ids[:22]]), use_cache=True)
    torch.testing.assert_close(got, full.logits[0, -1].float().log_softmax(-1), atol=1e-4, rtol=0)
    for layer, prefilled, (kept, mapped) in zip(session.cache("a").layers, full.past_key_values.layers, own_before,
                                                 strict=True):
        assert torch.equal(layer.keys[:, :, :12], kept)  # kept, not read again
        assert not torch.allclose(layer.keys[:, :, 12:18], mapped, atol=1e-3)  # the mapped ones were replaced
        torch.testing.assert_close(layer.keys, prefilled.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(layer.values, prefilled.values, atol=1e-4, rtol=0)
    assert session.own_length("a") == 22 and session.owner == "a"
    session.generate("b", ids[22:24], max_new_tokens=2, do_sample=False)  # on b's mapped cache: not its own
    assert session.own_length("b") == 0
    session.reprefill("b", keep_own=False)
    assert session.own_length("b") == session.cached_length("b") == len(session.tokens)


def test_a_handover_taken_back_is_made_again_under_another_plan(trio):
    """undo_handover returns the conversation, the receiving model's cache and the owner to where the handover
    found them; the next read hands over again, here under a larger budget, as a fresh session would."""
    a, b, _, forward = trio
    back = fit_mapper(b, a, random_batches(2, tokens=32), FitConfig(), progress=False)
    mappers = {("a", "b"): forward, ("b", "a"): back}
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    session = SwitchingSession({"a": a, "b": b}, mappers, plan=HandoffPlan(0))
    session.read("a", ids[:20])
    session.read_logprobs("b", ids[20:26], keep=3)  # b's first handover: mapped from its first position
    session.undo_handover()
    assert (session.tokens, session.owner, session.cache("b")) == (ids[:20], "a", None)
    again = session.read_logprobs("b", ids[20:26], keep=3, plan=HandoffPlan(0, Recent(1.0)))
    own = b(input_ids=torch.tensor([ids[:26]])).logits[0, -3:].float().log_softmax(-1)
    torch.testing.assert_close(again, own, atol=1e-4, rtol=0)  # all recomputed: b's own prefill
    # a model coming back: only what it missed was mapped, and only that is taken back
    session.read("a", ids[26:32])
    assert (session.cached_length("a"), session.own_length("a")) == (32, 20)
    kept = session.cache("a").layers[0].keys[:, :, :26].clone()
    session.undo_handover()
    assert (len(session.tokens), session.owner, session.cached_length("a"), session.own_length("a")) \
        == (26, "b", 20, 20)
    assert torch.equal(session.cache("a").layers[0].keys, kept[:, :, :20])
    plain = SwitchingSession({"a": a, "b": b}, mappers, plan=HandoffPlan(0))
    plain.read("a", ids[:20])
    plain.read_logprobs("b", ids[20:26], plan=HandoffPlan(0, Recent(1.0)))
    torch.testing.assert_close(session.read("a", ids[26:32]), plain.read("a", ids[26:32]), atol=1e-5, rtol=0)


def test_the_owners_preview_of_a_turn_leaves_its_cache_and_serves_the_handover(trio, monkeypatch):
    """preview_turn: the owner's log-probs of the turn's last positions (those it would read), its cache as it was;
    with attention (by default when the handover's policy ranks by it), the attention a turn_attention handover
    ranks by, which read_logprobs takes instead of reading the turn again (the same answer); nothing to preview is
    refused."""
    from kvhandoff.runtime.seam import TransformersCache

    a, b, _, mapper = trio
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    plan = HandoffPlan.of(recompute="turn_attention:20%")
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=plan)
    with pytest.raises(ConfigError, match="owner"):
        session.preview_turn("b", ids[:4])
    session.read("a", ids[:24])
    before = session.cache("a").layers[0].keys.clone()
    logprobs, attention = session.preview_turn("b", ids[24:], keep=2, attention=False)
    assert attention is None and session.cache("a").get_seq_length() == 24
    assert torch.equal(session.cache("a").layers[0].keys, before)
    shared, attention = session.preview_turn("b", ids[24:], keep=2)  # the plan ranks by the source's read
    torch.testing.assert_close(shared, logprobs, atol=1e-5, rtol=0)
    assert attention.shape == (1, 24) and session.cache("a").get_seq_length() == 24
    plain = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=HandoffPlan.of(recompute="recent:20%"))
    plain.read("a", ids[:24])
    recent, none = plain.preview_turn("b", ids[24:], keep=2)  # a plan that does not rank by it: no attention
    assert none is None
    torch.testing.assert_close(recent, logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs, plain.read_logprobs("a", ids[24:], keep=2), atol=1e-5, rtol=0)
    reads = []
    real = TransformersCache.read_turn
    monkeypatch.setattr(TransformersCache, "read_turn", lambda *args: reads.append(1) or real(*args))
    served = session.read_logprobs("b", ids[24:], keep=2, source_turn_read=attention)
    assert reads == []  # ranked by the preview's attention: the turn was not read again
    fresh = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=plan)
    fresh.read("a", ids[:24])
    torch.testing.assert_close(served, fresh.read_logprobs("b", ids[24:], keep=2), atol=1e-5, rtol=0)
    assert reads == [1]


def test_only_the_last_handover_can_be_taken_back_while_it_stands(trio):
    a, b, _, mapper = trio
    ids = torch.randint(0, 128, (30,)).tolist()
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, plan=HandoffPlan(0))
    session.read("a", ids[:10])
    with pytest.raises(ConfigError, match="no handover to take back"):
        session.undo_handover()
    session.read("b", ids[10:15])
    session.truncate(8)  # cut back past the switch
    with pytest.raises(ConfigError, match="cut back past the switch"):
        session.undo_handover()
    session.read("b", ids[8:15])
    session.reprefill("b")  # the handover's result was replaced by b's own prefill
    with pytest.raises(ConfigError, match="no handover to take back"):
        session.undo_handover()
    whole = SwitchingSession({"a": a, "b": b}, {("a", "b"): mapper}, handover="all", plan=HandoffPlan(0))
    whole.read("a", ids[:10])
    whole.read("b", ids[10:15])
    with pytest.raises(ConfigError, match="handover 'incremental'"):
        whole.undo_handover()


@pytest.mark.real_models
def test_real_pair_handover_taken_back_and_made_again_recomputing_all():
    """The default pair: the 1.5B handed the 0.5B's story under the recorded policy, the handover taken back and
    made again recomputing every mapped position — the 1.5B's next-token distribution is its own prefill's."""
    from kvhandoff.demo import demo_script
    from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
    from kvhandoff.workflow import load_named_pair, obtain_mapper

    pair = load_named_pair(DEFAULT_SOURCE, DEFAULT_TARGET, progress=False)
    small, large, tokenizer = pair.source, pair.target, pair.models.tokenizer
    up = obtain_mapper(pair, progress=False)[0]
    story = tokenizer(demo_script().story + "\n\n")["input_ids"]
    question = tokenizer("Q: What was the man's name?\n\nA:")["input_ids"]
    session = SwitchingSession({"small": small, "large": large}, {("small", "large"): up})
    session.read("small", story)
    mapped = session.read_logprobs("large", question, keep=1, plan=HandoffPlan.of(recompute="turn_attention:5%"))
    session.undo_handover()
    assert (session.tokens, session.owner, session.cache("large")) == (story, "small", None)
    again = session.read_logprobs("large", question, keep=1, plan=HandoffPlan(0, Recent(1.0)))
    with torch.no_grad():
        own = large(input_ids=torch.tensor([story + question])).logits[0, -1:].float().log_softmax(-1)
    torch.testing.assert_close(again, own, atol=2e-3, rtol=0)
    assert not torch.allclose(mapped, own, atol=2e-3)  # the first handover served an approximation


def test_healing_reads_the_approximate_rows_again_in_chunks_until_the_cache_is_a_prefill(trio):
    """heal: the positions past a model's own length are read again on its own rows, ``limit`` at a time, in order;
    the rows after a chunk stay as they were until their turn, and the healed cache is what a prefill holds."""
    a, b, _, forward = trio
    back = fit_mapper(b, a, random_batches(2, tokens=32), FitConfig(), progress=False)
    session = SwitchingSession({"a": a, "b": b}, {("a", "b"): forward, ("b", "a"): back},
                               plan=HandoffPlan(2, Recent(0.25)))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    session.read("a", ids[:16])
    session.read("b", ids[16:24])
    session.read("a", ids[24:30])  # a: 16 own, 8 mapped, 6 read on top of them
    assert (session.own_length("a"), session.cached_length("a")) == (16, 30)
    tail = [layer.keys[:, :, 20:].clone() for layer in session.cache("a").layers]
    assert session.heal("a", limit=4) == 4
    assert (session.own_length("a"), session.cached_length("a")) == (20, 30)
    for layer, kept in zip(session.cache("a").layers, tail, strict=True):
        assert torch.equal(layer.keys[:, :, 20:], kept)  # not healed yet: as it was
    with pytest.raises(ConfigError, match="no handover to take back"):
        session.undo_handover()  # a healed handover is final
    assert session.heal() == 10 and session.heal() == 0  # the owner, a, heals the rest; then nothing is left
    full = a(input_ids=torch.tensor([ids[:30]]), use_cache=True)
    for layer, prefilled in zip(session.cache("a").layers, full.past_key_values.layers, strict=True):
        torch.testing.assert_close(layer.keys, prefilled.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(layer.values, prefilled.values, atol=1e-4, rtol=0)
    got = session.read("a", ids[30:32])
    whole = a(input_ids=torch.tensor([ids[:32]])).logits[0, -1].float().log_softmax(-1)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=0)
    assert session.heal("b") == session.cached_length("b") == 24  # b held no position of its own
    assert session.own_length("b") == 24
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="heal limit"):
            session.heal("a", limit=bad)
    with pytest.raises(ConfigError, match="unknown model"):
        session.heal("z")
    assert SwitchingSession({"a": a}, {}).heal() == 0  # no conversation yet
