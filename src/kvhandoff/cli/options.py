"""The options several commands share and the parsers of command-line values, each declared once.

Options whose parsed value is not one type (an integer or 'all') are annotated `object` for typer, which
cannot declare unions; the parser defines what the command receives. Every parser turns a bad value into
`typer.BadParameter`, which the command group reports as one line naming
the option (``error: Invalid value for '--top-k': …``) with exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.config import CALIBRATION_GROUPS, DEFAULT_CALIBRATION_MIX, CalibrationSpec, FitConfig, require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.fit.selection import parse_ks
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.model.placement import MODEL_DTYPES, PLANNED_DEVICE_MAPS, ModelPlacement
from kvhandoff.runtime import policy
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RULES, RecomputePolicy
from kvhandoff.runtime.switch.guard import GuardAction, parse_guard_action

__all__ = ["DEFAULT_MIX", "DEFAULT_SOURCE", "DEFAULT_TARGET"]

DEFAULT_MIX = ",".join(DEFAULT_CALIBRATION_MIX)


# -- parsers ---------------------------------------------------------------------------------------------------
def positive_int(value) -> int:
    """A positive integer (`config.require_positive`)."""
    try:
        return require_positive("the value", int(value) if isinstance(value, str) else value)
    except (ValueError, ConfigError):
        raise typer.BadParameter(f"give a positive integer, got {value!r}") from None


def recompute_policy(value) -> RecomputePolicy:
    """A selective-recompute policy from its spec "RULE:BUDGET" (`kvhandoff.runtime.policy.parse`): the option is
    parsed here, once; the commands below hold the policy object."""
    try:
        return policy.parse(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def guard_action(value) -> GuardAction:
    """The serving guard's action at a switch it flags, from "fallback" or "escalate:RULE:BUDGET"
    (`kvhandoff.serving.settings.parse_guard_action`): parsed here, once."""
    try:
        return parse_guard_action(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def model_dtype(value) -> str:
    """A model dtype (`config.MODEL_DTYPES`: fp32, bf16, fp16 or their torch names), as its torch name."""
    try:
        return ModelPlacement(dtype=value).dtype
    except ConfigError:
        raise typer.BadParameter(f"give one of {', '.join(MODEL_DTYPES)}, got {value!r}") from None


def device_map(value) -> str:
    """A device map (`config.ModelPlacement`): 'auto' and accelerate's other plans, or one device."""
    try:
        return str(ModelPlacement(device_map=value).device_map)
    except ConfigError:
        raise typer.BadParameter(f"give one of {', '.join(PLANNED_DEVICE_MAPS)} or a device such as 'cpu' or "
                                 f"'cuda:0', got {value!r}") from None


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def byte_size(value) -> int:
    """A number of bytes, with an optional unit: 512GB, 480GiB, 2T, 1e11."""
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    try:
        size = float(number) * _SIZE_UNITS[text[len(number):]]
    except (ValueError, KeyError):
        size = 0.0
    if not size >= 1:
        raise typer.BadParameter(f"give a size in bytes such as 480GiB, 512GB or 2T, got {value!r}")
    return int(size)


def non_negative_int(value) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise typer.BadParameter(f"give an integer >= 0, got {value!r}")
    return number


def positive_float(value) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0:
        raise typer.BadParameter(f"give a number > 0, got {value!r}")
    return number


def non_negative_float(value) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (number >= 0 and math.isfinite(number)):
        raise typer.BadParameter(f"give a number >= 0, got {value!r}")
    return number


def top_k(value) -> int | str:
    """A positive integer, 'all' or 'heldout' (`fit`)."""
    if value in ("all", "heldout"):
        return value
    try:
        return positive_int(value)
    except typer.BadParameter:
        raise typer.BadParameter(f"give a positive integer, 'all' or 'heldout', got {value!r}") from None


def fixed_top_k(value) -> int | str:
    """A positive integer or 'all'."""
    if value == "all":
        return value
    try:
        return positive_int(value)
    except typer.BadParameter:
        raise typer.BadParameter(f"give a positive integer or 'all', got {value!r}") from None


def ridge_lambda(value) -> float | str:
    """A ridge λ > 0 or 'gcv'."""
    if value == "gcv":
        return value
    try:
        return positive_float(value)
    except typer.BadParameter:
        raise typer.BadParameter(f"give a number > 0 (e.g. 0.01) or 'gcv', got {value!r}") from None


def mix(value) -> tuple[str, ...]:
    """Calibration groups, comma-separated."""
    groups = tuple(value) if isinstance(value, tuple) else tuple(g.strip() for g in value.split(",") if g.strip())
    unknown = [g for g in groups if g not in CALIBRATION_GROUPS]
    if unknown or not groups or len(set(groups)) != len(groups):
        raise typer.BadParameter(f"give distinct groups among {', '.join(CALIBRATION_GROUPS)}, got {value!r}")
    return groups


def _items(value) -> list:
    return list(value) if isinstance(value, tuple | list) else [p.strip() for p in str(value).split(",") if p.strip()]


def list_of(parse: Callable, what: str) -> Callable:
    """A parser of comma-separated values, each parsed by `parse`; `what` says what each must be."""

    def parse_list(value) -> tuple:
        items = _items(value)
        if not items:
            raise typer.BadParameter(f"give comma-separated {what}, got {value!r}")
        try:
            return tuple(parse(item) for item in items)
        except typer.BadParameter:
            raise typer.BadParameter(f"give comma-separated {what}, got {value!r}") from None

    return parse_list


def one_of(choices: Sequence[str], what: str = "value") -> Callable:
    """A parser accepting only `choices`; `what` names the kind of value in the message."""

    def parse_choice(value) -> str:
        if value not in choices:
            raise typer.BadParameter(f"unknown {what} {value!r}; use one of {', '.join(repr(c) for c in choices)}")
        return value

    return parse_choice


def k_list(value) -> tuple[int | str, ...]:
    """Positive integers or 'all' (`selection.parse_ks`)."""
    try:
        return tuple(parse_ks(",".join(str(v) for v in _items(value)), "the list"))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc).replace("the list ", "")) from None


non_negative_ints = list_of(non_negative_int, "integers >= 0")
positive_ints = list_of(positive_int, "positive integers")
lambdas = list_of(ridge_lambda, "numbers > 0 or 'gcv'")
source_inputs = list_of(one_of(("own", "kv")), "of 'own', 'kv'")


@contextmanager
def option_errors(*options: str) -> Iterator[None]:
    """Report a ConfigError raised while building settings from these options as a bad command-line value."""
    try:
        yield
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint=" / ".join(options)) from None


# -- shared options --------------------------------------------------------------------------------------------
Source = Annotated[str, typer.Option("--source", help="source model (prefills): registry name, local model "
                                                      "folder or hub id")]
Target = Annotated[str, typer.Option("--target", help="target model (decodes on): registry name, local model "
                                                      "folder or hub id")]
SavedMapper = Annotated[Path | None, typer.Option("--mapper", help="a saved mapper folder, fitted for SOURCE → "
                                                                   "TARGET (default: the pair's cached mapper)")]
TopK = Annotated[object, typer.Option("--top-k", parser=fixed_top_k, metavar="K",
                                         help="source layers per target layer: a positive integer or 'all'")]
Lambda = Annotated[object, typer.Option("--lambda", parser=ridge_lambda, metavar="λ",
                                             help="ridge λ relative to mean input variance, or 'gcv'")]
Mix = Annotated[object, typer.Option(
    "--mix", parser=mix, metavar="GROUPS",
    help="calibration text groups sharing the windows equally, comma-separated: 'prose' (BoolQ train passages, "
         "LAMBADA), 'exams' (multiple-choice questions with answers, few-shot layout), 'math' (worked solutions, "
         "GSM8K layout), 'tasks' (answered train items of ARC-Challenge, HellaSwag, WinoGrande), 'reading' (BoolQ "
         "train passages each with its question and answer)")]
Sequences = Annotated[int, typer.Option("--sequences", parser=positive_int, help="calibration windows")]
SeqLen = Annotated[int, typer.Option("--seq-len", parser=positive_int, help="tokens per calibration window")]
Stride = Annotated[int, typer.Option("--stride", parser=positive_int, help="keep every n-th calibration token")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="also write the results here")]
_RECOMPUTE_HELP = (
    "selective recompute after the handoff: the target recomputes BUDGET (a fraction or a percentage) of the mapped "
    f"positions itself, chosen by RULE ({', '.join(RULES)}; 'mix(sinks=0.2,...)' for other shares; 'layers': that "
    "fraction of its first layers at every position), e.g. deviation:10%, or none")
Recompute = Annotated[RecomputePolicy | None, typer.Option(
    "--recompute", parser=recompute_policy, metavar="RULE:BUDGET",
    help=f"{_RECOMPUTE_HELP}; default: {DEFAULT_RECOMPUTE.spec}")]
#: the served pairs' policy: one for every pair, or (not given) each pair's own
RecomputeOption = Annotated[RecomputePolicy | None, typer.Option(
    "--recompute", parser=recompute_policy, metavar="RULE:BUDGET",
    help=f"{_RECOMPUTE_HELP}; for every pair (default: each pair's policy recorded with its mapper by `kvhandoff-lab "
         f"eval-switch --sweep-recompute RULES --record-recompute`, else {DEFAULT_RECOMPUTE.spec})")]
#: the models' placement for their forwards (`config.ModelPlacement`), on every command that loads a pair
Dtype = Annotated[str, typer.Option("--dtype", parser=model_dtype, metavar="DTYPE", help=(
    "dtype of the model forwards: fp32, bf16 or fp16 (or float32, bfloat16, float16); calibration statistics are "
    "summed in float64 whatever it is"))]
DeviceMap = Annotated[str | None, typer.Option("--device-map", parser=device_map, metavar="MAP", help=(
    "where the models' layers go: 'auto' (accelerate spreads them over the visible GPUs, then the CPU; under "
    "torchrun over each rank's share of the node's GPUs), 'balanced', 'sequential', or one device ('cuda:0'); "
    "default: the CPU"))]
DEFAULT_DTYPE = ModelPlacement().dtype
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")]

DEFAULT_SEQUENCES = CalibrationSpec().num_sequences
DEFAULT_SEQ_LEN = CalibrationSpec().seq_len
DEFAULT_STRIDE = FitConfig().token_stride
DEFAULT_TOP_K = str(FitConfig().top_k)
