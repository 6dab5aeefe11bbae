"""Conditional perplexity: how well the target predicts a document's continuation from a prefix in its cache.

For each held-out document the first ``prefix_len`` tokens are the prefix and the next ``continuation_len``
tokens are scored by the target. Following the transfer convention of every other task, the condition
prefills ``prefix[:-1]`` (the target itself, or the source followed by the mapper) and the target consumes the
last prefix token and the continuation; so in the transfer condition ``prefix_len − 1`` positions of the cache
are mapped ones. Perplexities are token-weighted over all documents: exp(Σ NLL ÷ Σ tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.files import sha256_bytes
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff_lab.evaluation.scoring import Condition, continuation_logprobs, standard_conditions


def document_id(ids: Sequence[int] | torch.Tensor) -> str:
    """A stable id for a token sequence (content hash)."""
    values = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return "doc-" + sha256_bytes(",".join(map(str, values)).encode(), 16)


def _as_list(doc: Sequence[int] | torch.Tensor) -> list[int]:
    return doc.flatten().tolist() if isinstance(doc, torch.Tensor) else list(doc)


def usable_documents(
    documents: Sequence[Sequence[int] | torch.Tensor], prefix_len: int, continuation_len: int
) -> list[list[int]]:
    """Documents long enough, each cut to exactly prefix_len + continuation_len tokens."""
    if prefix_len < 2 or continuation_len < 1:
        raise ConfigError(f"need prefix_len >= 2 and continuation_len >= 1, got {prefix_len}, {continuation_len}")
    need = prefix_len + continuation_len
    return [ids[:need] for ids in map(_as_list, documents) if len(ids) >= need]


def perplexity_record(condition: Condition, ids: Sequence[int], prefix_len: int, continuation_len: int) -> dict:
    """Summed NLL of ``ids[prefix_len : prefix_len + continuation_len]`` given ``ids[:prefix_len]`` in cache."""
    ids = list(ids)
    if len(ids) < prefix_len + continuation_len:
        raise ConfigError(f"document has {len(ids)} tokens, {prefix_len + continuation_len} needed")
    cont = ids[prefix_len : prefix_len + continuation_len]
    (logprobs,) = continuation_logprobs(condition, ids[:prefix_len], [cont])
    return {"id": document_id(ids), "nll": float(-logprobs.double().sum()), "tokens": len(cont)}


def summarise_perplexity(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict:
    """Token-weighted perplexity per condition, and transfer ÷ target when both are present."""
    out: dict[str, Any] = {"conditions": {}}
    for name, recs in records.items():
        tokens = sum(r["tokens"] for r in recs)
        nll = sum(r["nll"] for r in recs)
        out["conditions"][name] = {
            "perplexity": math.exp(nll / tokens) if tokens else float("nan"),
            "documents": len(recs),
            "tokens": tokens,
        }
    conds = out["conditions"]
    if "target" in conds and "transfer" in conds:
        out["ratio"] = conds["transfer"]["perplexity"] / conds["target"]["perplexity"]
    return out


def conditional_perplexity(
    source_model,
    target_model,
    mapper,
    documents: Sequence[Sequence[int] | torch.Tensor],
    prefix_len: int = 1024,
    continuation_len: int = 1024,
    conditions: Sequence[str] = ("target", "transfer"),
    exact_prefix: int | None = None,
    recompute: RecomputePolicy | None = None,
) -> dict:
    """Target perplexity of each document's continuation with its own prefix cache vs. a mapped one (exact_prefix,
    recompute: the transfer's, as in `standard_conditions`).

    documents: token-id sequences (e.g. from ``kvhandoff.fit.corpus.heldout_documents``); shorter ones are skipped.
    Returns ``{"conditions": {name: {"perplexity", "documents", "tokens"}}, "ratio": transfer ÷ target,
    "prefix_len", "continuation_len", "per_document": {name: [records]}}``.
    """
    docs = usable_documents(documents, prefix_len, continuation_len)
    if not docs:
        raise ConfigError(f"no document has the {prefix_len + continuation_len} tokens needed")
    available = standard_conditions(source_model, target_model, mapper, exact_prefix, recompute=recompute)
    unknown = set(conditions) - set(available)
    if unknown:
        raise ConfigError(f"unknown conditions {sorted(unknown)}; choose from {sorted(available)}")
    records = {
        name: [perplexity_record(available[name], d, prefix_len, continuation_len) for d in docs]
        for name in conditions
    }
    return {
        **summarise_perplexity(records),
        "prefix_len": prefix_len,
        "continuation_len": continuation_len,
        "per_document": records,
    }
