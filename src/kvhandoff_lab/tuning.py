"""Choosing fit settings on a dev set: how far the target's next-token distributions move after a handoff.

The dev metric is teacher-forced: for held-out prose documents or few-shot dev prompts (never calibration,
never reported evaluation items) the target reads a continuation once from its own prefix cache (the
reference, computed once) and once from the mapped cache of the source's prefix. Reported per candidate
mapper: mean KL(own ‖ handoff), top-1 agreement and the perplexity ratio handoff ÷ own. Candidates come from
one set of statistics, so a sweep over k and λ costs solves and target forwards over the continuations, never
another calibration pass.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvhandoff.config import FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.model.cache import feed, kl_divergence, prefill, rollback
from kvhandoff.progress import Progress, as_progress
from kvhandoff.runtime.handoff import handoff_cache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import NoRecompute


@dataclass
class _DevDocument:
    prefix: list[int]
    continuation: list[int]
    source_cache: object
    own_logprobs: torch.Tensor  # [continuation, vocab]
    source_logprobs: torch.Tensor  # the source model's own predictions (the "no handoff benefit" reference)


class HandoffDivergence:
    """Reference distributions for a dev set; `score(mapper)` measures a candidate against them."""

    def __init__(self, source, target, documents: Iterable, prefix_len: int = 512, continuation_len: int = 128):
        """Dev documents cut into a `prefix_len` prefix and the `continuation_len` tokens after it (documents
        shorter than both together are skipped)."""
        if prefix_len < 2 or continuation_len < 1:
            raise ConfigError("prefix_len must be ≥ 2 and continuation_len ≥ 1")
        cut = [[int(t) for t in doc][: prefix_len + continuation_len] for doc in documents]
        examples = [(ids[:prefix_len], ids[prefix_len:]) for ids in cut if len(ids) == prefix_len + continuation_len]
        if not examples:
            raise ConfigError(f"no dev document has the {prefix_len + continuation_len} tokens needed")
        self._prepare(source, target, examples)

    @classmethod
    def from_examples(cls, source, target, examples: Iterable[tuple[Sequence[int], Sequence[int]]]):
        """A dev set of (prefix, continuation) token-id pairs of any lengths — e.g. few-shot prompts and the
        answer after them (`kvhandoff_lab.evaluation.tasks.mmlu_dev_examples`)."""
        examples = [([int(t) for t in prefix], [int(t) for t in continuation]) for prefix, continuation in examples]
        if not examples or any(len(prefix) < 2 or not continuation for prefix, continuation in examples):
            raise ConfigError("dev examples need a prefix of ≥ 2 tokens and a continuation of ≥ 1 token each")
        divergence = cls.__new__(cls)
        divergence._prepare(source, target, examples)
        return divergence

    def _prepare(self, source, target, examples: list[tuple[list[int], list[int]]]) -> None:
        self.source, self.target = source, target
        self.documents: list[_DevDocument] = []
        with torch.inference_mode():
            for prefix, continuation in examples:
                own_cache, _ = prefill(target, torch.tensor([prefix[:-1]]))
                own = feed(target, own_cache, [prefix[-1], *continuation[:-1]])
                source_cache, _ = prefill(source, torch.tensor([prefix[:-1]]))
                source_own = feed(source, copy.deepcopy(source_cache), [prefix[-1], *continuation[:-1]])
                self.documents.append(_DevDocument(prefix, continuation, source_cache, own, source_own))

    @torch.inference_mode()
    def score(self, mapper, exact_prefix: int = 0, target_tail: int = 0) -> dict:
        """Divergence of the target reading the mapped cache from the target reading its own: the map's quality,
        so no selective recompute (the handoffs' default policy) blurs it.
        target_tail: the last that many prefix tokens are prefilled by the target (see `handoff_cache`)."""
        shortest = min(len(doc.prefix) for doc in self.documents)
        if not 0 <= target_tail < shortest - 1:
            raise ConfigError(f"target_tail must be in 0..{shortest - 2} (the shortest dev prefix), got {target_tail}")
        plan = HandoffPlan(exact_prefix, NoRecompute())

        def mapped(doc):
            source_cache = doc.source_cache  # of prefix[:-1]; the tail is left to the target
            if target_tail:
                source_cache = copy.deepcopy(source_cache)
                rollback(source_cache, len(doc.prefix) - 1 - target_tail)
            cache = handoff_cache(self.source, self.target, mapper, torch.tensor([doc.prefix[:-1]]), plan,
                                  source_cache=source_cache, target_tail=target_tail)
            return feed(self.target, cache, [doc.prefix[-1], *doc.continuation[:-1]])

        return self._divergence(mapped)

    def source_reference(self) -> dict:
        """The same measures for the source model's own predictions: a handoff that scores no better than
        this has bought nothing over staying on the source (for small → large)."""
        return self._divergence(lambda doc: doc.source_logprobs)

    def _divergence(self, predictions) -> dict:
        kls, agree, own_nll, handoff_nll, tokens = [], [], 0.0, 0.0, 0
        for doc in self.documents:
            mapped = predictions(doc)
            own = doc.own_logprobs
            kls.append(kl_divergence(own, mapped))
            agree.append((own.argmax(-1) == mapped.argmax(-1)).float())
            index = torch.tensor(doc.continuation)[:, None]
            own_nll += float(-own.gather(1, index).double().sum())
            handoff_nll += float(-mapped.gather(1, index).double().sum())
            tokens += len(doc.continuation)
        return {
            "mean_kl": float(torch.cat(kls).mean()),
            "top1_agreement": float(torch.cat(agree).mean()),
            "ppl_own": float(torch.exp(torch.tensor(own_nll / tokens))),
            "ppl_handoff": float(torch.exp(torch.tensor(handoff_nll / tokens))),
            "ppl_ratio": float(torch.exp(torch.tensor((handoff_nll - own_nll) / tokens))),
            "documents": len(self.documents),
            "tokens": tokens,
        }


def sweep(
    stats,
    configs: Sequence[FitConfig],
    divergence: HandoffDivergence,
    source_fingerprint: dict,
    target_fingerprint: dict,
    max_position_embeddings: tuple[int, int],
    exact_prefixes: Sequence[int] = (0,),
    progress: Progress | bool = False,
    target_tails: Sequence[int] = (0,),
) -> list[dict]:
    """Score each candidate config (solved from `stats`), with each exact-prefix length, on the dev set;
    best (lowest KL) first. progress: a bar over the candidates (`kvhandoff.progress`)."""
    r2_by_lambda: dict[float, torch.Tensor] = {}
    rows = []
    for config in as_progress(progress)(configs, desc="candidates"):
        started = time.perf_counter()
        if config.ridge_lambda not in r2_by_lambda:
            r2_by_lambda[config.ridge_lambda] = layer_r2_matrix(stats, config.probe_lambda)
        mapper = mapper_from_statistics(
            stats, config, source_fingerprint, target_fingerprint,
            max_position_embeddings=max_position_embeddings, r2_matrix=r2_by_lambda[config.ridge_lambda],
        )
        solve_seconds = time.perf_counter() - started
        for exact_prefix, tail in ((p, t) for p in exact_prefixes for t in target_tails):
            metrics = divergence.score(mapper, exact_prefix, tail)
            rows.append({
                "top_k": config.top_k, "ridge_lambda": config.ridge_lambda, "source_inputs": config.source_inputs,
                "exact_prefix": exact_prefix,
                "target_tail": tail,
                "r2_k": mapper.manifest["fit_metrics"]["r2_k_mean"],
                "r2_v": mapper.manifest["fit_metrics"]["r2_v_mean"],
                "solve_seconds": round(solve_seconds, 2), "parameters": mapper.num_parameters(), **metrics,
            })
    return sorted(rows, key=lambda row: row["mean_kl"])


def score_saved_mapper(mapper, divergence: HandoffDivergence, exact_prefixes: Sequence[int], name: str,
                       target_tails: Sequence[int] = (0,)) -> list[dict]:
    """Rows like `sweep`'s for an already fitted mapper (e.g. an MLP mapper), labelled `name`."""
    metrics = mapper.manifest.get("fit_metrics", {})
    config = mapper.manifest.get("config", {})
    return [{"mapper": name, "method": mapper.manifest.get("method", "ridge"), "top_k": config.get("top_k"),
             "ridge_lambda": config.get("ridge_lambda"), "source_inputs": config.get("source_inputs", "own"),
             "exact_prefix": exact_prefix, "target_tail": tail,
             "r2_k": metrics.get("r2_k_mean", float("nan")), "r2_v": metrics.get("r2_v_mean", float("nan")),
             "parameters": mapper.num_parameters(), **divergence.score(mapper, exact_prefix, tail)}
            for exact_prefix in exact_prefixes for tail in target_tails]


def config_grid(ks: Sequence[int | str], lambdas: Sequence[float | str], inputs: Sequence[str] = ("own",),
                token_stride: int = FitConfig().token_stride) -> list[FitConfig]:
    """The candidate configs of a sweep: every (inputs, λ, k), k varying fastest."""
    return [FitConfig(top_k=k, ridge_lambda=lam, token_stride=token_stride, source_inputs=inp)
            for inp in inputs for lam in lambdas for k in ks]

