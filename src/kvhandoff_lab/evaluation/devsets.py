"""`kvhandoff-lab tune`: dev sets for `tuning.HandoffDivergence` and the sweep of fit settings scored on them.

The dev sets are never calibration text and never reported evaluation items: held-out LAMBADA documents
("prose"), 5-shot MMLU validation prompts ("mmlu"), 8-shot GSM8K dev-pool prompts ("gsm8k") or dev-pool items
of the zero-shot core tasks ("zeroshot"). They live here, above `tuning`, which stays free of the evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.config import CalibrationSpec, FitConfig, require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.progress import Progress
from kvhandoff.workflow import NamedPair, load_pair_mapper, obtain_statistics
from kvhandoff_lab.evaluation.tasks import gsm8k_dev_examples, mmlu_dev_examples, zeroshot_dev_examples
from kvhandoff_lab.tuning import HandoffDivergence, score_saved_mapper, sweep

DEV_SETS = ("prose", "mmlu", "gsm8k", "zeroshot")

_EXAMPLES = {"mmlu": mmlu_dev_examples, "gsm8k": gsm8k_dev_examples, "zeroshot": zeroshot_dev_examples}
_DESCRIPTIONS = {
    "mmlu": {"kind": "mmlu-validation", "count": "subjects",
             "description": "first validation item of each of the first subjects, 5-shot, answer letter"},
    "zeroshot": {"kind": "zeroshot-dev-pool", "count": "items_per_task",
                 "description": "first dev-pool validation items of ARC-Challenge, HellaSwag, WinoGrande "
                                "(0-shot); the gold choice's continuation"},
    "gsm8k": {"kind": "gsm8k-dev-pool", "count": "items",
              "description": "first dev-pool test items, 8-shot chain of thought, reference solution"},
}


@dataclass(frozen=True)
class DevSet:
    """A dev set: its kind (`DEV_SETS`), how many documents / subjects / items (per task), and for "prose" the
    prefix and continuation lengths."""

    kind: str = "prose"
    docs: int = 4
    prefix_len: int = 512
    continuation_len: int = 128

    def __post_init__(self) -> None:
        if self.kind not in DEV_SETS:
            raise ConfigError(f"dev set kind must be one of {', '.join(DEV_SETS)}, got {self.kind!r}")
        for name in ("docs", "prefix_len", "continuation_len"):
            require_positive(name, getattr(self, name))


def dev_divergence(pair: NamedPair, dev: DevSet) -> tuple[HandoffDivergence, dict]:
    """The dev set's reference distributions and its description (for the sweep's JSON)."""
    if dev.kind == "prose":
        documents = heldout_documents(pair.tokenizer, dev.docs, min_tokens=dev.prefix_len + dev.continuation_len,
                                      source="lambada-heldout")
        divergence = HandoffDivergence(pair.source, pair.target, documents, dev.prefix_len, dev.continuation_len)
        return divergence, documents.describe()
    examples = _EXAMPLES[dev.kind](pair.tokenizer, dev.docs)
    described = _DESCRIPTIONS[dev.kind]
    info = {"kind": described["kind"], described["count"]: dev.docs, "description": described["description"]}
    return HandoffDivergence.from_examples(pair.source, pair.target, examples), info


def tune_pair(
    pair: NamedPair,
    dev: DevSet,
    configs: Sequence[FitConfig],
    calibration: CalibrationSpec,
    exact_prefixes: Sequence[int] = (0,),
    target_tails: Sequence[int] = (0,),
    mappers: Sequence[Path] = (),
    features: bool = False,
    progress: Progress | bool = False,
) -> dict:
    """Score every candidate config (solved from one set of the pair's statistics, collected or reused with the
    first config's token stride) and every saved mapper on the dev set, with each exact prefix and target tail.
    Returns the sweep's record: pair, dev set, calibration, the source model's own reference, rows (best first).
    progress: bars over a calibration pass and the candidates (`kvhandoff.progress`)."""
    if not configs:
        raise ConfigError("the sweep needs at least one candidate config")
    if len({config.row_weights for config in configs}) > 1:
        raise ConfigError("the candidates are solved from one set of statistics: give them one row weighting")
    pass_config = FitConfig(token_stride=configs[0].token_stride, row_weights=configs[0].row_weights)
    stats, _ = obtain_statistics(pair, pass_config, calibration, progress,
                                 features=features, kv_cross=any(config.joint_inputs for config in configs))
    divergence, dev_info = dev_divergence(pair, dev)
    fingerprints = pair.fingerprints()
    rows = sweep(stats, configs, divergence, *fingerprints, pair.max_positions(), exact_prefixes=exact_prefixes,
                 target_tails=target_tails, progress=progress)
    for folder in mappers:
        rows.extend(score_saved_mapper(load_pair_mapper(folder, pair), divergence, exact_prefixes, str(folder),
                                       target_tails))
    rows.sort(key=lambda row: row["mean_kl"])
    lengths = {"prefix_len": dev.prefix_len, "continuation_len": dev.continuation_len} if dev.kind == "prose" else {}
    return {"source": pair.source_spec, "target": pair.target_spec, "dev": dev_info,
            "calibration_mix": list(calibration.mix), "calibration_windows": calibration.num_sequences, **lengths,
            "source_reference": divergence.source_reference(), "rows": rows}


def tune_table(result: dict):
    """A rich table of a `tune_pair` record."""
    from rich.table import Table  # rich is only needed to print, not to compute

    rows, reference = result["rows"], result["source_reference"]
    table = Table(title=f"dev sweep {result['source']} → {result['target']} ({rows[0]['documents']} docs, "
                        f"{rows[0]['tokens']} tokens); source model alone: KL {reference['mean_kl']:.3f}, "
                        f"top-1 {reference['top1_agreement']:.3f}")
    for column in ("mapper", "k", "λ", "inputs", "exact prefix", "target tail", "R² K", "R² V", "mean KL", "top-1",
                   "ppl ratio"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.get("mapper", "ridge"), str(row["top_k"]), str(row["ridge_lambda"]),
                      str(row.get("source_inputs", "own")), str(row["exact_prefix"]), str(row["target_tail"]),
                      f"{row['r2_k']:.3f}", f"{row['r2_v']:.3f}", f"{row['mean_kl']:.3f}",
                      f"{row['top1_agreement']:.3f}", f"{row['ppl_ratio']:.3f}")
    return table
