"""A session's per-model cache bookkeeping (`SessionCaches`) and its handover record (`Handover`), on stand-in
caches: what each model computed itself follows its forwards, and a handover is taken back only while it can be."""

import pytest
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.session_caches import SessionCaches
from kvhandoff.runtime.session_handover import Handover


class StandIn:
    """Enough of a `KVCache` for the bookkeeping: a length that reads grow and truncation cuts."""

    def __init__(self, length: int = 0) -> None:
        self.length = length

    def read(self, model, new_ids, logits_to_keep=1, pending=None):
        self.length += new_ids.shape[1]
        return torch.zeros(1, logits_to_keep, 3)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def copy(self):
        return StandIn(self.length)

    def storages(self):
        return {(id(self),): 10 * self.length}


def _known(name):
    if name not in ("a", "b"):
        raise ConfigError(f"unknown model {name!r}")


def test_own_positions_follow_the_models_own_forwards():
    caches = SessionCaches()
    caches.ensure("a", lambda model: StandIn(), None)
    caches.read("a", None, torch.zeros(1, 4, dtype=torch.long))
    assert caches.length("a") == caches.own_length("a") == 4
    caches.start("b", StandIn(4))  # mapped for it: none of it its own, nor what it reads on top
    caches.read("b", None, torch.zeros(1, 2, dtype=torch.long))
    assert (caches.length("b"), caches.own_length("b")) == (6, 0)
    caches.cut_all(3)
    assert [caches.own_length(name) for name in ("a", "b")] == [3, 0]
    caches.restart("b", 0, lambda model: StandIn(), None)  # a re-prefill from scratch is all its own
    caches.read("b", None, torch.zeros(1, 3, dtype=torch.long))
    assert caches.own_length("b") == 3 and caches.nbytes() == 60
    caches.cut_all(0)
    assert not caches and caches.own_length("a") == 0


def test_restored_caches_must_fit_the_conversation_and_copies_are_independent():
    with pytest.raises(ConfigError, match="must hold all 5"):
        SessionCaches.restored({"a": (StandIn(4), 4)}, 5, "a", _known)
    with pytest.raises(ConfigError, match="does not fit"):
        SessionCaches.restored({"a": (StandIn(5), 5), "b": (StandIn(3), 4)}, 5, "a", _known)
    with pytest.raises(ConfigError, match="unknown model 'c'"):
        SessionCaches.restored({"a": (StandIn(5), 5), "c": (StandIn(3), 0)}, 5, "a", _known)
    caches = SessionCaches.restored({"a": (StandIn(5), 5), "b": (StandIn(3), 2)}, 5, "a", _known)
    twin = caches.copy()
    twin.cut("b", 1)
    assert (caches.length("b"), caches.own_length("b")) == (3, 2)
    assert (twin.length("b"), twin.own_length("b")) == (1, 1)
    with pytest.raises(ConfigError, match="holds no cache"):
        caches.export("c")


def test_a_handover_is_taken_back_only_while_it_can_be():
    caches = SessionCaches({"a": (StandIn(8), 8), "b": (StandIn(6), 4)})
    record = Handover("a", "b", at=6, held=3, own=4)
    with pytest.raises(ConfigError, match="only be taken back under handover 'incremental'"):
        Handover.undoable(record, "all", "b", caches)
    for last, owner in ((None, "b"), (record, "a")):
        with pytest.raises(ConfigError, match="no handover to take back"):
            Handover.undoable(last, "incremental", owner, caches)
    assert Handover.undoable(record, "incremental", "b", caches) is record
    record.undo(caches)  # back to the 3 positions it held, 3 of them its own
    assert (caches.length("b"), caches.own_length("b")) == (3, 3)
    Handover("a", "b", at=6, held=None, own=0).undo(caches)  # it had none: it has none again
    assert "b" not in caches and "a" in caches
