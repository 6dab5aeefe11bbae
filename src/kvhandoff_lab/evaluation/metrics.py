"""Summary statistics: accuracy, retention, floor-normalised retention, paired bootstrap intervals, token F1 and
exact match.

- retention = transfer ÷ target (1.0 = the mapped cache is as good as the target's own prefill).
- floor-normalised retention = (transfer − chance) ÷ (target − chance): the share of the target's
  above-chance accuracy that survives the transfer.
- Paired bootstrap: items are resampled with replacement, the *same* resample for every condition, so the
  interval reflects the per-item pairing of transfer and target. Percentile intervals; seedable.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvhandoff.errors import ConfigError

Statistic = Callable[[Mapping[str, np.ndarray]], float]


def mean(values: Sequence[float] | np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()) if values.size else float("nan")


def retention(transfer: float, target: float) -> float:
    """transfer ÷ target (nan when the target scores 0)."""
    return float(transfer / target) if target != 0 else float("nan")


def floor_normalised_retention(transfer: float, target: float, chance: float) -> float:
    """(transfer − chance) ÷ (target − chance) (nan when the target is at chance)."""
    return float((transfer - chance) / (target - chance)) if target != chance else float("nan")


def _retention_stat(s: Mapping[str, np.ndarray]) -> float:
    return retention(float(s["transfer"].mean()), float(s["target"].mean()))


def _floor_stat(s: Mapping[str, np.ndarray]) -> float:
    return floor_normalised_retention(float(s["transfer"].mean()), float(s["target"].mean()),
                                      float(s["chance"].mean()))


def paired_bootstrap(
    scores: Mapping[str, Sequence[float] | np.ndarray],
    statistic: Statistic,
    n_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over item resamples shared by every entry of ``scores``.

    scores: per-item arrays of equal length (e.g. {"target": ..., "transfer": ..., "chance": ...}).
    Resamples where the statistic is undefined (nan) are ignored; (nan, nan) if all are.
    """
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ConfigError(f"n_resamples must be >= 1, got {n_resamples}")
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in scores.items()}
    lengths = {a.shape[0] for a in arrays.values()}
    if len(lengths) != 1:
        raise ConfigError(f"paired bootstrap needs equally many items per condition, got {sorted(lengths)}")
    n = lengths.pop()
    if n == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, n, size=(n_resamples, n))
    values = np.array([statistic({k: a[idx] for k, a in arrays.items()}) for idx in indices])
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def summarise_conditions(
    per_item: Mapping[str, Sequence[float]],
    chance: Sequence[float],
    n_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """Accuracy per condition with intervals, retention and floor-normalised retention with paired intervals.

    per_item: condition name → per-item scores (0/1 or fractional), items aligned across conditions; needs
    "target" and "transfer" for the retention figures. chance: per-item chance score.
    """
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in per_item.items()}
    chance_arr = np.asarray(chance, dtype=np.float64)
    out: dict = {"n": int(chance_arr.size), "chance": mean(chance_arr), "accuracy": {}}
    for i, (name, arr) in enumerate(arrays.items()):
        ci = paired_bootstrap({"x": arr}, lambda s: float(s["x"].mean()), n_resamples, seed + i, confidence)
        out["accuracy"][name] = {"value": mean(arr), "ci": list(ci)}
    if "target" in arrays and "transfer" in arrays:
        paired = {"target": arrays["target"], "transfer": arrays["transfer"], "chance": chance_arr}
        tgt, tr, ch = mean(arrays["target"]), mean(arrays["transfer"]), mean(chance_arr)
        out["retention"] = {
            "value": retention(tr, tgt),
            "ci": list(paired_bootstrap(paired, _retention_stat, n_resamples, seed, confidence)),
        }
        out["floor_normalised_retention"] = {
            "value": floor_normalised_retention(tr, tgt, ch),
            "ci": list(paired_bootstrap(paired, _floor_stat, n_resamples, seed, confidence)),
        }
    return out


# -- SQuAD-style token F1 -------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalise_text(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token-overlap F1 after normalisation (1.0 when both are empty, 0.0 when only one is)."""
    pred, ref = normalise_text(prediction).split(), normalise_text(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def max_f1(prediction: str, references: Sequence[str]) -> float:
    """Best F1 over several references (SQuAD/CoQA convention); 0.0 with no references."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the prediction equals any reference after `normalise_text`, else 0.0 (0.0 with no references)."""
    answer = normalise_text(prediction)
    return float(any(answer == normalise_text(r) for r in references))
