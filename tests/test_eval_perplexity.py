"""Conditional perplexity with tiny prefix/continuation lengths."""

from __future__ import annotations

import math

import pytest
import torch

from _eval_support import IdentityMapper, NoisyMapper, full_sequence_logprob
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import NoRecompute
from kvhandoff_lab.evaluation import perplexity as P
from kvhandoff_lab.evaluation.scoring import Standalone

from conftest import BYTE_MODEL, tiny_model


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in (40, 20, 64)]  # the 20-token one is too short
    return tiny_model("qwen2", seed=0, **BYTE_MODEL), tiny_model("qwen2", seed=1, **BYTE_MODEL), docs


def test_identity_transfer_gives_ratio_one(setup):
    target, _, docs = setup
    out = P.conditional_perplexity(target, target, IdentityMapper(), docs, prefix_len=16, continuation_len=12,
                                   recompute=NoRecompute())  # nothing recomputed: the identity map is exact
    assert out["ratio"] == 1.0
    assert out["conditions"]["target"]["documents"] == 2  # the short document is skipped
    assert out["conditions"]["target"]["tokens"] == 24
    assert out["prefix_len"] == 16 and out["continuation_len"] == 12


def test_perplexity_equals_a_from_scratch_computation(setup):
    target, _, docs = setup
    ids = docs[0].tolist()
    record = P.perplexity_record(Standalone("target", target), ids, 16, 12)
    reference = -full_sequence_logprob(target, ids[:16], ids[16:28])
    assert record["nll"] == pytest.approx(reference, abs=1e-4)
    assert record["tokens"] == 12 and record["id"] == P.document_id(docs[0]) == P.document_id(ids)


def test_mapped_prefix_changes_the_perplexity(setup):
    target, source, docs = setup
    out = P.conditional_perplexity(source, target, NoisyMapper(scale=2.0), docs, prefix_len=16,
                                   continuation_len=12, conditions=("target", "source", "transfer"))
    conds = out["conditions"]
    assert conds["transfer"]["perplexity"] != conds["target"]["perplexity"]
    assert out["ratio"] == pytest.approx(conds["transfer"]["perplexity"] / conds["target"]["perplexity"])
    nll = sum(r["nll"] for r in out["per_document"]["target"])
    assert conds["target"]["perplexity"] == pytest.approx(math.exp(nll / 24))


def test_bad_lengths_and_no_usable_documents(setup):
    target, _, docs = setup
    with pytest.raises(ConfigError):
        P.conditional_perplexity(target, target, IdentityMapper(), docs, prefix_len=1, continuation_len=4)
    with pytest.raises(ConfigError, match="no document"):
        P.conditional_perplexity(target, target, IdentityMapper(), docs, prefix_len=60, continuation_len=60)
    with pytest.raises(ConfigError, match="unknown conditions"):
        P.conditional_perplexity(target, target, IdentityMapper(), docs, 8, 8, conditions=("oracle",))
