"""`guard-calibrate`: measure a hosted family's quality guard on its own dev conversations and record it with each
direction's mapper, where `kvhandoff serve` reads it."""

from __future__ import annotations

from typing import Annotated

import typer

from kvhandoff.cli.options import DEFAULT_DTYPE, DeviceMap, Dtype, RecomputeOption, one_of, positive_float, positive_int
from kvhandoff.cli.serve import Mappers, Models, family_specs
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.switch.guard import DEFAULT_GUARD_SIGNAL
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.calibrate import GUARD_LABELS, SIGNAL_CHOICES, calibrate_guard, record_guards
from kvhandoff.serving.family import load_family
from kvhandoff.serving.settings import ServeConfig


def _rate(value) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"give a rate in 0..1, got {value!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise typer.BadParameter(f"give a rate in 0..1, got {value!r}")
    return rate


def _cell(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def guard_calibrate(
    models: Models = "",
    mapper: Mappers = None,
    conversations: Annotated[int, typer.Option(parser=positive_int, help=(
        "dev conversations (CoQA stories with their questions, apart from those reports are made on)"))] = 20,
    turns: Annotated[int, typer.Option(parser=positive_int, help=(
        "turns per conversation; the model switches every turn"))] = 4,
    signal: Annotated[str, typer.Option(parser=one_of(SIGNAL_CHOICES), help=(
        "the guard's score; 'best': every signal measured, each direction takes the one with the highest AUROC"))]
    = DEFAULT_GUARD_SIGNAL,
    label: Annotated[str, typer.Option(parser=one_of(tuple(GUARD_LABELS)), help=(
        "what a bad switch is: the answer changed, or its first token's distribution moved by > 0.5 nats"))]
    = "answer_changed",
    target_rate: Annotated[float | None, typer.Option(parser=_rate, metavar="RATE", help=(
        "the most switches with an unchanged answer the guard may re-prefill (dev false-fallback rate, 0..1); "
        "default: no bound, the threshold that best separates bad switches from good ones"))] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", parser=positive_float, help=(
        "seconds; no conversation starts after it"))] = 1800.0,
    recompute: RecomputeOption = None,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
) -> None:
    """Measure the quality guard of each direction of a model family on its own dev conversations and record it
    with that direction's mapper, where `kvhandoff serve` reads it."""
    if turns < 2:
        raise typer.BadParameter("give at least 2 (a switch needs a turn before it)", param_hint="--turns")
    config = ServeConfig(switch=SwitchSettings(recompute=recompute))
    hosted, mappers = load_family(*family_specs(models, mapper), dtype=dtype, progress=True, device_map=device_map)
    guards = calibrate_guard(hosted, mappers, conversations=conversations, turns=turns, signal=signal, label=label,
                             target_rate=target_rate, time_limit_s=time_limit, config=config, progress=True)
    written = record_guards(mappers, guards)
    for (source, target), guard in guards.items():
        pair = f"{source} → {target}"
        if guard is None:
            typer.echo(f"{pair}: no switch measured in time; nothing recorded (raise --time-limit)")
            continue
        typer.echo(f"{pair}: re-prefill when {guard.signal} > {guard.threshold:.4g} (AUROC {_cell(guard.auroc)} "
                   f"for {guard.label} on {guard.dev_switches} dev switches, {guard.bad_switches} bad; catch "
                   f"{_cell(guard.catch_rate)}, false fallback {_cell(guard.false_fallback_rate)}; recompute "
                   f"{guard.recompute}) — recorded in {written[source, target]}")
    missing = [pair for pair, guard in guards.items() if guard is None]
    if missing:
        raise ConfigError(f"{len(missing)} of {len(guards)} directions got no guard recorded")
