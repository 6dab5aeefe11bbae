"""`demo`: a short real conversation that switches models and back, each switch beside a re-prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

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
    PairRecompute,
    SeqLen,
    Sequences,
    Source,
    Target,
    TopK,
    option_errors,
    positive_int,
)
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.demo import QUESTION_MAPPED, DemoResult, Switch, run_demo
from kvhandoff.files import atomic_write_json
from kvhandoff.model.placement import ModelPlacement


def demo(
    reverse: Annotated[bool, typer.Option(help="let TARGET open the conversation and SOURCE take the hard turn")]
    = False,
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    k: TopK = DEFAULT_TOP_K,
    sequences: Sequences = DEFAULT_SEQUENCES,
    seq_len: SeqLen = DEFAULT_SEQ_LEN,
    groups: Mix = DEFAULT_MIX,
    max_new_tokens: Annotated[int, typer.Option(parser=positive_int, help="most tokens of an answer")] = 32,
    refit: Annotated[bool, typer.Option(help="fit again even if a cached mapper matches")] = False,
    json_out: JsonOut = None,
    mapper: Annotated[Path | None, typer.Option(help="a saved mapper of the first switch's direction (SOURCE → "
                                                     "TARGET, e.g. from `kvhandoff refine`) instead of the default")]
    = None,
    reverse_mapper: Annotated[Path | None, typer.Option(help="a saved mapper of the way back (TARGET → SOURCE) "
                                                             "instead of the default")] = None,
    recompute: PairRecompute = None,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
) -> None:
    """A real conversation on the pair: SOURCE answers a routine turn, TARGET a hard one, SOURCE the next; each
    switch's time to first token and answer beside the receiving model re-prefilling the whole conversation."""
    if reverse:
        source, target = target, source
    with option_errors("--sequences", "--mix"):
        calibration = CalibrationSpec(num_sequences=sequences, seq_len=seq_len, mix=groups)
    result = run_demo(source, target, FitConfig(top_k=k), calibration, max_new_tokens=max_new_tokens, refit=refit,
                      mapper_path=mapper, reverse_mapper_path=reverse_mapper, recompute=recompute,
                      placement=ModelPlacement(dtype, device_map))
    render_demo(result)
    if json_out:
        atomic_write_json(json_out, result.to_dict())


def render_demo(result: DemoResult, console: Console | None = None) -> None:
    """The conversation turn by turn, then the switches: the handoff's time to first token and answer beside the
    re-prefill's."""
    console = console or Console()
    names = short_names(result.source, result.target)
    console.print(f"[bold]kvhandoff demo[/bold]: {names[result.source]} ({result.source}) ⇄ {names[result.target]} "
                  f"({result.target}) on {result.story}, {result.story_tokens:,} tokens")
    for use in result.mappers:
        console.print(f"mapper {names[use.source]} → {names[use.target]}: {'reused' if use.reused else 'fitted now'}, "
                      f"{use.fit} ({use.folder})")

    turns = Table(title="The conversation (the story comes with turn 1)")
    for column in ("turn", "model", "question", "answer", "the story says"):
        turns.add_column(column, overflow="fold")
    for turn in result.turns:
        turns.add_row(str(turn.turn), names[turn.model], turn.question.text, turn.answer.text, turn.question.reference)
    console.print(turns)

    switches = Table(title="Each switch: the handoff beside the receiving model re-prefilling the whole conversation")
    for column, justify in (("switch", "left"), ("handed over", "left"), ("first token: handoff", "right"),
                            ("re-prefill", "right"), ("speed-up", "right"), ("answer after handoff", "left"),
                            ("after re-prefill", "left"), ("same", "left")):
        switches.add_column(column, overflow="fold", justify=justify)
    for switch in result.switches:
        switches.add_row(*_switch_cells(switch, names))
    console.print(switches)
    console.print("handoff: the history is mapped and the receiving model reads the new turn itself (a switch at a "
                  f"turn boundary); {QUESTION_MAPPED}: the paper's condition, the source had read the new question "
                  "as well; same: the same answer tokens.")


def short_names(first: str, second: str) -> dict[str, str]:
    """Each model's name less the start both share up to a separator ("qwen2.5-coder:0.5b" → "0.5b")."""
    shared = 0
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            break
        if not a.isalnum() and a != ".":
            shared = index + 1
    short = {name: name[shared:] or name for name in (first, second)}
    return short if len(set(short.values())) == 2 else {first: first, second: second}


def _switch_cells(switch: Switch, names: dict[str, str]) -> tuple[str, ...]:
    label = f"turn {switch.turn}, {names[switch.source]} → {names[switch.target]}"
    if switch.condition == QUESTION_MAPPED:
        label += f", {QUESTION_MAPPED} (the paper's condition)"
    return (label, f"{switch.mapped_tokens:,} mapped ({switch.recompute}), {switch.read_tokens} read",
            f"{switch.handoff.ttft_seconds:.2f} s", f"{switch.reprefill.ttft_seconds:.2f} s", f"{switch.speedup:.1f}×",
            switch.handoff.text, switch.reprefill.text, "yes" if switch.same_answer else "no")
