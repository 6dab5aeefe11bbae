"""`demo`: a short real conversation that switches models and back, each switch beside a re-prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

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
    RecomputeOption,
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
    recompute: RecomputeOption = None,
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
    re-prefill's. Each turn and each switch is a heading line and a few labelled lines below it, so that the text wraps
    at word boundaries in a narrow terminal (80 columns) instead of folding words inside table cells."""
    console = console or Console()
    names = short_names(result.source, result.target)
    console.print(Text.assemble(("kvhandoff demo", "bold"), f": {names[result.source]} ({result.source}) ⇄ "
                                f"{names[result.target]} ({result.target}) on {result.story}, "
                                f"{result.story_tokens:,} tokens"))
    for use in result.mappers:
        console.print(Text(f"mapper {names[use.source]} → {names[use.target]}: "
                           f"{'reused' if use.reused else 'fitted now'}, {use.fit}"))
        console.print(_details([("folder", use.folder)]))

    console.print()
    console.print(Text("The conversation (the story comes with turn 1)", style="bold"))
    for turn in result.turns:
        console.print(Text(f"turn {turn.turn}, {names[turn.model]}: {turn.question.text}"))
        console.print(_details([("answer", turn.answer.text), ("story says", turn.question.reference)]))

    console.print()
    console.print(Text("Each switch: the handoff beside the receiving model re-prefilling the whole conversation",
                       style="bold"))
    for switch in result.switches:
        heading, rows = _switch_lines(switch, names)
        console.print(Text(heading))
        console.print(_details(rows))
    console.print()
    console.print(Text("handoff: the history is mapped and the receiving model reads the new turn itself (a switch "
                       f"at a turn boundary); {QUESTION_MAPPED}: the paper's condition, the source had read the new "
                       "question as well."))


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


def _details(rows: list[tuple[str, str]]) -> Padding:
    """Labelled lines, indented under a heading: the labels in a column of their own, each value wrapping at word
    boundaries in the rest of the width (a single word longer than that is folded). Values are plain text, never
    console markup."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, Text(value))
    return Padding(grid, (0, 0, 0, 2))


def _switch_lines(switch: Switch, names: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """A switch's heading line (which turn, which way, what was handed over) and its labelled lines: both times to the
    first token with the speed-up, and both answers."""
    heading = f"turn {switch.turn}, {names[switch.source]} → {names[switch.target]}"
    if switch.condition == QUESTION_MAPPED:
        heading += f", {QUESTION_MAPPED} (the paper's condition)"
    heading += f": {switch.mapped_tokens:,} mapped ({switch.recompute}), {switch.read_tokens} read"
    same = "the same answer" if switch.same_answer else "another answer"
    return heading, [
        ("first token", f"handoff {switch.handoff.ttft_seconds:.2f} s, "
                        f"re-prefill {switch.reprefill.ttft_seconds:.2f} s: {switch.speedup:.1f}× sooner"),
        ("handoff", switch.handoff.text),
        ("re-prefill", f"{switch.reprefill.text} ({same})")]
