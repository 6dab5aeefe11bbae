"""Evaluation of KV-cache transfer: benchmark accuracy under three conditions (target / source / transfer, the
transfer mapping the whole context or, ``mapped="history"``, only the few-shot history),
retention with paired bootstrap intervals, conditional perplexity, multi-turn model switching, the k sweep.

Entry points: :func:`run_eval` (resumable runner), :func:`choose_k`, :func:`conditional_perplexity`,
:func:`multiturn_switching`, :func:`render_results`; the ``kvhandoff-lab eval`` command lives in ``kvhandoff.cli``.
"""

from kvhandoff_lab.evaluation.metrics import (
    floor_normalised_retention,
    paired_bootstrap,
    retention,
    summarise_conditions,
    token_f1,
)
from kvhandoff_lab.evaluation.multiturn import load_coqa_conversations, multiturn_switching
from kvhandoff_lab.evaluation.options import EvalOptions, OutputOptions, ScoringOptions
from kvhandoff_lab.evaluation.perplexity import conditional_perplexity
from kvhandoff_lab.evaluation.report import render_results
from kvhandoff_lab.evaluation.runner import run_eval, select_items
from kvhandoff_lab.evaluation.scoring import (
    Condition,
    Standalone,
    Transfer,
    TransferHistory,
    score_continuations,
    standard_conditions,
)
from kvhandoff_lab.evaluation.sweep import choose_k
from kvhandoff_lab.evaluation.tasks import CORE_TASKS, HELDOUT_TASKS, SWEEP_TASKS, TASKS, load_items

__all__ = [
    "CORE_TASKS",
    "HELDOUT_TASKS",
    "SWEEP_TASKS",
    "TASKS",
    "Condition",
    "EvalOptions",
    "OutputOptions",
    "ScoringOptions",
    "Standalone",
    "Transfer",
    "TransferHistory",
    "choose_k",
    "conditional_perplexity",
    "floor_normalised_retention",
    "load_coqa_conversations",
    "load_items",
    "multiturn_switching",
    "paired_bootstrap",
    "render_results",
    "retention",
    "run_eval",
    "score_continuations",
    "select_items",
    "standard_conditions",
    "summarise_conditions",
    "token_f1",
]
