"""`demo`: one long real context handed over, side by side with the target's re-prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_MIX,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DEFAULT_TOP_K,
    DeviceMap,
    Dtype,
    JsonOut,
    Mix,
    Recompute,
    SeqLen,
    Sequences,
    Source,
    Target,
    TopK,
    one_of,
    option_errors,
    positive_int,
)
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.model.placement import ModelPlacement
from kvhandoff.demo import render_demo, run_demo
from kvhandoff.files import atomic_write_json
from kvhandoff_lab.evaluation.scoring import MAPPED_PARTS


def demo(
    reverse: Annotated[bool, typer.Option(help="hand off large → small instead")] = False,
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    k: TopK = DEFAULT_TOP_K,
    sequences: Sequences = DEFAULT_SEQUENCES,
    seq_len: SeqLen = DEFAULT_SEQ_LEN,
    groups: Mix = DEFAULT_MIX,
    max_new_tokens: Annotated[int, typer.Option(parser=positive_int)] = 40,
    repeats: Annotated[int, typer.Option(parser=positive_int, help="timed repeats of each path (median reported)")]
    = 1,
    refit: Annotated[bool, typer.Option(help="fit again even if a cached mapper matches")] = False,
    json_out: JsonOut = None,
    mapped: Annotated[str, typer.Option(parser=one_of(MAPPED_PARTS), help=(
        "'all': the source prefilled the whole context, new question included; 'history': the switch comes "
        "with the new question, which the target prefills itself on top of the mapped conversation"))] = "all",
    mapper: Annotated[Path | None, typer.Option(help="show this saved mapper (fitted for SOURCE → TARGET, e.g. "
                                                     "from `kvhandoff refine`) instead of the pair's default")] = None,
    recompute: Recompute = None,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
) -> None:
    """Fit (or reuse) the pair's mapper, hand a long CoQA context over, compare with the target's re-prefill."""
    if reverse:
        source, target = target, source
    with option_errors("--sequences", "--mix"):
        calibration = CalibrationSpec(num_sequences=sequences, seq_len=seq_len, mix=groups)
    result = run_demo(source, target, FitConfig(top_k=k), calibration, max_new_tokens=max_new_tokens,
                      repeats=repeats, refit=refit, mapped=mapped, mapper_path=mapper, recompute=recompute,
                      placement=ModelPlacement(dtype, device_map))
    render_demo(result)
    if json_out:
        atomic_write_json(json_out, result)
