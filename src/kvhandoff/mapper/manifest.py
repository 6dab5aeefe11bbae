"""The mapper manifest: what a mapper says about itself (geometry, identities, settings, metrics), typed and
validated, written beside its tensors as `manifest.json`.

One format version (`config.MAPPER_FORMAT_VERSION`) for every method; the `method` field names the mapper class
that reads the tensors (`mapper.register_method`). A manifest is checked when it is built, in memory or from a
file, and every problem names its field. On disk it carries a checksum over its own canonical content, which
includes the tensor file's sha256 (`tensor_sha256`), so an edit to either file is refused on load.

A `MapperManifest` is immutable: change one with `dataclasses.replace` (or `with_metrics`, `with_guard`,
`with_recompute`). It also reads as a mapping of its JSON form (``manifest["fit_metrics"]``,
``manifest.get("method")``) for code that reports it. The optional `guard` record (`GuardCalibration`, written by
`kvhandoff guard-calibrate`) is the quality guard measured for this mapper's pair, the optional `recompute` record
(`RecomputeChoice`) the selective-recompute policy chosen for it; a manifest without them reads (and checksums) as
before.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvhandoff.config import MAPPER_FORMAT_VERSION, FitConfig, MLPConfig, require_positive
from kvhandoff.errors import ConfigError, MapperFormatError
from kvhandoff.files import sha256_json
from kvhandoff.model.capture import FeatureLayout

#: key of the manifest's own checksum in `manifest.json`
CHECKSUM_KEY = "checksum"
SIDES = ("source", "target")
#: what a fingerprint's geometry must hold for the mapper to rebuild that side's RoPE
_ROPE_GEOMETRY_KEYS = ("head_dim", "hidden_size", "num_attention_heads")


def _bad(name: str, problem: str) -> MapperFormatError:
    return MapperFormatError(f"mapper manifest field {name!r} {problem}; re-fit the mapper")


def _int_rows(name: str, value) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple) or not value or not all(
        isinstance(row, list | tuple) and row and all(isinstance(i, int) and not isinstance(i, bool) for i in row)
        for row in value
    ):
        raise _bad(name, f"must be a non-empty list of non-empty lists of layer indices, got {value!r}")
    return tuple(tuple(row) for row in value)


#: how a recorded guard threshold was chosen: "max_catch_minus_false_fallback", the one maximising catch rate −
#: false-fallback rate on the dev switches (under a bound on the false-fallback rate when
#: `GuardCalibration.target_rate` is set); "best_retention_at_min_speedup", the one whose guarded switches (those it
#: flags served by its action) keep the highest mean retention over the switch benchmark's dev tasks while the mean
#: speed-up over re-prefill stays at a minimum
GUARD_RULES = ("max_catch_minus_false_fallback", "best_retention_at_min_speedup")
#: what a recorded guard does at a switch it flags: "fallback" (re-prefill), or "escalate:RULE:BUDGET" (hand over
#: again under that recompute policy; the server parses the spec)
GUARD_FALLBACK = "fallback"
GUARD_ESCALATE = "escalate:"


def _bad_guard(name: str, problem: str) -> MapperFormatError:
    return MapperFormatError(f"mapper manifest field 'guard.{name}' {problem}; record the guard again (`kvhandoff "
                             "guard-calibrate`)")


def _rate(value) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0)


@dataclass(frozen=True)
class GuardCalibration:
    """The quality guard measured for a mapper's pair on the pair's own dev conversations (`kvhandoff
    guard-calibrate`): the server falls back to a re-prefill when the guard's ``signal`` scores a mapped cache above
    ``threshold``.

    auroc: how well the signal ranked the bad switches on dev (None: dev had one class only); label: what counted
    as a bad switch (e.g. "answer_changed"); rule: how the threshold was chosen (`GUARD_RULES`), under
    ``target_rate`` (the bound on the dev false-fallback rate; None: none); dev_switches / bad_switches: the dev
    switches scored and the bad ones among them; catch_rate / false_fallback_rate: the threshold's rates on them
    (None for a class without switches); dev_conversations: the conversations they came from; recompute: the
    recompute policy spec the switches were handed over under; window: the new turn's last positions scored;
    action: what the server does at a switch the guard flags, `GUARD_FALLBACK` or `GUARD_ESCALATE` + a recompute
    spec (a record without one falls back).
    """

    signal: str
    threshold: float
    auroc: float | None
    label: str
    rule: str
    target_rate: float | None
    dev_switches: int
    bad_switches: int
    catch_rate: float | None
    false_fallback_rate: float | None
    dev_conversations: int
    recompute: str
    window: int
    action: str = GUARD_FALLBACK

    def __post_init__(self) -> None:
        if not isinstance(self.action, str) or not (
                self.action == GUARD_FALLBACK
                or (self.action.startswith(GUARD_ESCALATE) and len(self.action) > len(GUARD_ESCALATE))):
            raise _bad_guard("action", f"must be {GUARD_FALLBACK!r} or '{GUARD_ESCALATE}RULE:BUDGET', got "
                                       f"{self.action!r}")
        for name in ("signal", "label", "recompute"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _bad_guard(name, f"must be a non-empty string, got {getattr(self, name)!r}")
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
            raise _bad_guard("threshold", f"must be a finite number, got {threshold!r}")
        if self.rule not in GUARD_RULES:
            raise _bad_guard("rule", f"must be one of {', '.join(GUARD_RULES)}, got {self.rule!r}")
        for name in ("auroc", "target_rate", "catch_rate", "false_fallback_rate"):
            if not _rate(getattr(self, name)):
                raise _bad_guard(name, f"must be a number in 0..1 or null, got {getattr(self, name)!r}")
        for name in ("dev_switches", "dev_conversations", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad_guard(name, f"must be a positive integer, got {value!r}")
        bad = self.bad_switches
        if isinstance(bad, bool) or not isinstance(bad, int) or not 0 <= bad <= self.dev_switches:
            raise _bad_guard("bad_switches", f"must be an integer in 0..dev_switches, got {bad!r}")
        object.__setattr__(self, "threshold", float(threshold))

    def to_dict(self) -> dict:
        """The record's fields; ``action`` only when it is not the fallback (a record written before guards had
        actions keeps its checksum)."""
        data = dataclasses.asdict(self)
        if self.action == GUARD_FALLBACK:
            del data["action"]
        return data


#: how a recorded recompute policy was chosen (`choose_point`): among the measured points at least
#: `RecomputeChoice.min_speedup` times faster than re-prefill at `RecomputeChoice.history_tokens`, the fastest whose
#: mean retention over the tasks is at least `RecomputeChoice.min_retention`, else the most retentive; when no point
#: is that fast, the fastest
TRADEOFF_RULES = ("fastest_at_min_retention",)


#: the command that measures a pair's trade-off and records its policy with its mapper
RECORD_HINT = "`kvhandoff-lab eval-switch --sweep-recompute RULES --record-recompute`"


def _bad_recompute(name: str, problem: str) -> MapperFormatError:
    return MapperFormatError(f"mapper manifest field 'recompute.{name}' {problem}; record the policy again "
                             f"({RECORD_HINT})")


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _nonnegative(name: str, value) -> float:
    if not _finite(value) or value < 0:
        raise _bad_recompute(name, f"must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TradeoffPoint:
    """One measured point of a pair's recompute trade-off: a policy ``spec``, its mean retention over the
    record's tasks and its speed-up over the target's re-prefill at the record's history length."""

    spec: str
    mean_retention: float
    speedup: float

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or not self.spec:
            raise _bad_recompute("tradeoff.spec", f"must be a non-empty string, got {self.spec!r}")
        for name in ("mean_retention", "speedup"):
            object.__setattr__(self, name, _nonnegative(f"tradeoff.{name}", getattr(self, name)))


def choose_point(points: tuple[TradeoffPoint, ...], min_retention: float, min_speedup: float = 0.0
                 ) -> TradeoffPoint | None:
    """The point `TRADEOFF_RULES` takes from ``points``: among those at least ``min_speedup`` times faster than
    re-prefill, the fastest whose mean retention is at least ``min_retention``, else the most retentive (ties: the
    faster; tied on both: the earlier); when no point is that fast, the fastest, whatever its retention. None: no
    point."""
    if not points:
        return None
    fast = [p for p in points if p.speedup >= min_speedup]
    if not fast:
        return max(points, key=lambda p: (p.speedup, p.mean_retention))
    passing = [p for p in fast if p.mean_retention >= min_retention]
    if passing:
        return max(passing, key=lambda p: (p.speedup, p.mean_retention))
    return max(fast, key=lambda p: (p.mean_retention, p.speedup))


@dataclass(frozen=True)
class RecomputeChoice:
    """The selective-recompute policy chosen for a mapper's pair from a measured trade-off of accuracy against the
    time to the first token (the switch benchmark's recompute sweep on dev items): the server hands this pair's
    switches over under ``spec`` (`kvhandoff.runtime.policy.parse` reads it where the server starts) unless it is
    told a policy, or other bounds to choose from ``tradeoff`` by (`rechosen`).

    rule: how the point was chosen (`TRADEOFF_RULES`), at ``min_retention`` and ``min_speedup`` (0: no bound);
    group / tasks / pool / items_per_task: what the retention was measured on; mean_retention: the chosen point's,
    over those tasks; history_tokens / speedup: the history length its time to the first token was measured at,
    and its speed-up over the target's re-prefill there; tradeoff: every point measured so (empty: only the chosen
    one was recorded).
    """

    spec: str
    rule: str
    min_retention: float
    group: str
    tasks: tuple[str, ...]
    pool: str
    items_per_task: int
    mean_retention: float
    history_tokens: int
    speedup: float
    min_speedup: float = 0.0
    tradeoff: tuple[TradeoffPoint, ...] = ()

    def __post_init__(self) -> None:
        for name in ("spec", "group", "pool"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _bad_recompute(name, f"must be a non-empty string, got {getattr(self, name)!r}")
        if self.rule not in TRADEOFF_RULES:
            raise _bad_recompute("rule", f"must be one of {', '.join(TRADEOFF_RULES)}, got {self.rule!r}")
        tasks = self.tasks
        if not isinstance(tasks, list | tuple) or not tasks or not all(isinstance(t, str) and t for t in tasks):
            raise _bad_recompute("tasks", f"must be a non-empty list of task names, got {tasks!r}")
        object.__setattr__(self, "tasks", tuple(tasks))
        for name in ("min_retention", "mean_retention", "speedup", "min_speedup"):
            object.__setattr__(self, name, _nonnegative(name, getattr(self, name)))
        for name in ("items_per_task", "history_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad_recompute(name, f"must be a positive integer, got {value!r}")
        object.__setattr__(self, "tradeoff", self._points(self.tradeoff))
        if self.tradeoff:
            chosen = choose_point(self.tradeoff, self.min_retention, self.min_speedup)
            # a point tied with the rule's on both measures is as much its choice, whatever the list's order
            if not any((p.spec, p.mean_retention, p.speedup) == (self.spec, self.mean_retention, self.speedup)
                       for p in self.tradeoff
                       if (p.mean_retention, p.speedup) == (chosen.mean_retention, chosen.speedup)):
                raise _bad_recompute("spec", f"is {self.spec!r}, but its rule takes {chosen.spec!r} from the "
                                             "recorded trade-off")

    @staticmethod
    def _points(value) -> tuple[TradeoffPoint, ...]:
        if not isinstance(value, list | tuple):
            raise _bad_recompute("tradeoff", f"must be a list of measured points, got {value!r}")
        points = tuple(p if isinstance(p, TradeoffPoint) else _point(p) for p in value)
        specs = [p.spec for p in points]
        if len(set(specs)) != len(specs):
            raise _bad_recompute("tradeoff", f"names a policy twice: {specs}")
        return points

    def rechosen(self, min_retention: float | None = None, min_speedup: float | None = None) -> RecomputeChoice:
        """This record with the point its rule takes from the recorded trade-off under other bounds (None: the
        record's own); ConfigError when no trade-off was recorded."""
        if not self.tradeoff:
            raise ConfigError(f"the recorded recompute {self.spec!r} was recorded without the trade-off it was "
                              f"chosen from, so no other point can be chosen: record it again ({RECORD_HINT}) "
                              "or name a policy (--recompute)")
        min_retention = self.min_retention if min_retention is None else min_retention
        min_speedup = self.min_speedup if min_speedup is None else min_speedup
        chosen = choose_point(self.tradeoff, min_retention, min_speedup)
        return dataclasses.replace(self, spec=chosen.spec, mean_retention=chosen.mean_retention,
                                   speedup=chosen.speedup, min_retention=min_retention, min_speedup=min_speedup)

    def to_dict(self) -> dict:
        """The record's fields; ``min_speedup`` and ``tradeoff`` only when set (a record written without them keeps
        its checksum)."""
        data = {**dataclasses.asdict(self), "tasks": list(self.tasks)}
        data["tradeoff"] = [dataclasses.asdict(p) for p in self.tradeoff]
        for name in ("min_speedup", "tradeoff"):
            if not data[name]:
                del data[name]
        return data

    def describe(self) -> str:
        """One line on where the choice comes from."""
        floor = f" at {self.min_speedup:g}x or faster" if self.min_speedup else ""
        points = f" of {len(self.tradeoff)} measured" if self.tradeoff else ""
        how = (f"chosen as the fastest{points}{floor} with mean retention >= {self.min_retention:g}"
               if self.mean_retention >= self.min_retention and self.speedup >= self.min_speedup
               else f"chosen as the most retentive{points}{floor} (no policy kept a mean retention of "
                    f"{self.min_retention:g})"
               if self.speedup >= self.min_speedup
               else f"chosen as the fastest{points} (no policy was {self.min_speedup:g}x faster)")
        return (f"{how} over {self.group} tasks "
                f"{', '.join(self.tasks)} ({self.items_per_task} {self.pool} items each: retention "
                f"{self.mean_retention:.3f}, {self.speedup:.1f}x faster than re-prefill at {self.history_tokens} "
                "tokens)")


def _point(value) -> TradeoffPoint:
    if not isinstance(value, Mapping):
        raise _bad_recompute("tradeoff", f"holds {value!r}, not a point (spec, mean_retention, speedup)")
    _refuse_unknown_fields("recompute.tradeoff", TradeoffPoint, value)
    try:
        return TradeoffPoint(**value)
    except TypeError as exc:
        raise _bad_recompute("tradeoff", f"holds an invalid point {dict(value)!r} ({exc})") from exc


@dataclass(frozen=True)
class MapperManifest(Mapping):
    """Everything a mapper records besides its tensors.

    method: the mapper class (ridge | mlp | synthetic | any registered method).
    config: the fit settings (exact_prefix and source_inputs among them).
    source_layout / target_layout: the K/V feature layouts the map reads and writes.
    selected_layers: [target layers][k] source layers feeding each target layer (the tensors' layout).
    source_fingerprint / target_fingerprint: `geometry.model_fingerprint` of each model (may be empty for a
        mapper solved from statistics alone; RoPE needs the fingerprint's geometry).
    source_max_position_embeddings / target_max_position_embeddings: each model's context window.
    calibration, fit_metrics: descriptions of the data and the fit. source_layers_per_target_layer: only
    when target layers read different numbers of source layers. refinement: `refine.refine_mapper`'s record.
    mlp_config, mlp_input_layers, mlp_features: the MLP mapper's settings, inputs and rows.
    tensor_sha256: the tensor file's hash (set on save).
    storage: what the saved tensors take (set on save): {"parameters", "tensor_bytes", "file_bytes",
        "weight_dtype"} — read without loading the tensors (`Mapper.load(lazy=True)`).
    guard: the quality guard measured for this pair (`GuardCalibration`; None: never measured).
    recompute: the selective-recompute policy chosen for this pair (`RecomputeChoice`; None: never chosen).
    """

    method: str
    config: FitConfig
    source_layout: FeatureLayout
    target_layout: FeatureLayout
    selected_layers: tuple[tuple[int, ...], ...]
    source_fingerprint: dict
    target_fingerprint: dict
    source_max_position_embeddings: int
    target_max_position_embeddings: int
    calibration: dict = field(default_factory=dict)
    fit_metrics: dict = field(default_factory=dict)
    source_layers_per_target_layer: tuple[tuple[int, ...], ...] | None = None
    refinement: dict | None = None
    mlp_config: MLPConfig | None = None
    mlp_input_layers: tuple[tuple[int, ...], ...] | None = None
    mlp_features: dict | None = None
    tensor_sha256: str | None = None
    storage: dict | None = None
    guard: GuardCalibration | None = None
    recompute: RecomputeChoice | None = None
    format_version: int = MAPPER_FORMAT_VERSION

    def __post_init__(self) -> None:
        check_format_version(self.format_version)
        if not isinstance(self.method, str) or not self.method:
            raise _bad("method", f"must name a mapper method, got {self.method!r}")
        self._check_types()
        for side in SIDES:
            self._check_side(side)
        rows = self.selected_layers
        if len(rows) != self.target_layout.num_layers or len({len(row) for row in rows}) != 1:
            raise _bad("selected_layers", f"must hold one row of k source layers per target layer "
                                          f"({self.target_layout.num_layers}), got {[len(r) for r in rows]}")
        if any(not 0 <= i < self.source_layout.num_layers for row in rows for i in row):
            raise _bad("selected_layers", f"names source layers outside 0..{self.source_layout.num_layers - 1}")

    def _check_types(self) -> None:
        expected: dict[str, type | tuple[type, ...]] = {
            "config": FitConfig, "source_layout": FeatureLayout, "target_layout": FeatureLayout,
            "source_fingerprint": dict, "target_fingerprint": dict, "calibration": dict, "fit_metrics": dict,
            "refinement": (dict, type(None)), "mlp_config": (MLPConfig, type(None)),
            "mlp_features": (dict, type(None)), "tensor_sha256": (str, type(None)),
            "storage": (dict, type(None)), "guard": (GuardCalibration, type(None)),
            "recompute": (RecomputeChoice, type(None)),
        }
        for name, kind in expected.items():
            if not isinstance(getattr(self, name), kind):
                raise _bad(name, f"has the wrong type ({type(getattr(self, name)).__name__})")
        for name in ("selected_layers", "source_layers_per_target_layer", "mlp_input_layers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int_rows(name, value))
        for name in ("source_max_position_embeddings", "target_max_position_embeddings"):
            try:
                require_positive(name, getattr(self, name))
            except ConfigError as exc:
                raise _bad(name, f"is invalid ({exc})") from exc

    def _check_side(self, side: str) -> None:
        layout: FeatureLayout = getattr(self, f"{side}_layout")
        for key, value in dataclasses.asdict(layout).items():
            try:
                require_positive(key, value)
            except ConfigError as exc:
                raise _bad(f"{side}_layout", f"is invalid ({exc})") from exc
        geometry = getattr(self, f"{side}_fingerprint").get("geometry")
        if geometry is None:  # a mapper solved from statistics alone (no models): no RoPE, no pairing check
            return
        name = f"{side}_fingerprint.geometry"
        if not isinstance(geometry, dict):
            raise _bad(name, "must be a dict")
        found = tuple(geometry.get(k) for k in ("num_layers", "num_kv_heads", "head_dim"))
        if found != (layout.num_layers, layout.num_kv_heads, layout.head_dim):
            raise _bad(name, f"says layers × KV heads × head dim {found}, the {side} layout {layout}")
        rope = geometry.get("rope")
        missing = [k for k in _ROPE_GEOMETRY_KEYS if not isinstance(geometry.get(k), int)]
        if missing or not isinstance(rope, dict) or not isinstance(rope.get("parameters"), str):
            raise _bad(name, f"lacks the RoPE description (rope.parameters, {', '.join(_ROPE_GEOMETRY_KEYS)})")
        try:
            parameters = json.loads(rope["parameters"])
        except json.JSONDecodeError as exc:
            raise _bad(f"{name}.rope.parameters", f"is not JSON ({exc})") from exc
        if not isinstance(parameters, dict) or "rope_type" not in parameters:
            raise _bad(f"{name}.rope.parameters", "must be a dict with a rope_type")

    # -- derived settings -------------------------------------------------------------------------
    @property
    def exact_prefix(self) -> int:
        """Leading tokens the target recomputes at handoff (the fit setting)."""
        return self.config.exact_prefix

    @property
    def joint_inputs(self) -> bool:
        """Whether each map reads the selected source layers' K and V (source_inputs="kv")."""
        return self.config.source_inputs == "kv"

    def max_position_embeddings(self, side: str) -> int:
        return self.source_max_position_embeddings if side == "source" else self.target_max_position_embeddings

    def rope_config(self, side: str):
        """A minimal transformers config carrying ``side``'s RoPE parameters, for its rope initialisers."""
        from transformers import PretrainedConfig

        geometry = getattr(self, f"{side}_fingerprint").get("geometry")
        if geometry is None:
            raise MapperFormatError(
                f"this mapper's manifest has no {side} fingerprint (it was solved from statistics alone), so it "
                "cannot apply RoPE: fit it with the models (`fit_mapper`) to transfer caches"
            )
        config = PretrainedConfig()
        config.rope_parameters = json.loads(geometry["rope"]["parameters"])
        for key in _ROPE_GEOMETRY_KEYS:
            setattr(config, key, geometry[key])
        config.max_position_embeddings = self.max_position_embeddings(side)
        return config

    def with_metrics(self, **entries) -> MapperManifest:
        """This manifest with ``entries`` added to `fit_metrics`."""
        return dataclasses.replace(self, fit_metrics={**copy.deepcopy(self.fit_metrics), **entries})

    def with_guard(self, guard: GuardCalibration | None) -> MapperManifest:
        """This manifest with ``guard`` as its guard record (None: without one)."""
        return dataclasses.replace(self, guard=guard)

    def with_recompute(self, recompute: RecomputeChoice | None) -> MapperManifest:
        """This manifest with ``recompute`` as its recompute record (None: without one)."""
        return dataclasses.replace(self, recompute=recompute)

    # -- JSON form --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON form (what `manifest.json` holds, less the checksum); optional fields that are unset are left
        out. A fresh copy."""
        data: dict[str, Any] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is None:
                continue
            if isinstance(value, FitConfig | MLPConfig | GuardCalibration | RecomputeChoice):
                value = value.to_dict()
            elif isinstance(value, FeatureLayout):
                value = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                value = [list(row) for row in value]
            data[spec.name] = copy.deepcopy(value)
        return json.loads(json.dumps(data))  # canonical: what reading the file back gives

    def checksum(self) -> str:
        """Hash of the canonical JSON form (the tensor file's hash included once `tensor_sha256` is set)."""
        return sha256_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping) -> MapperManifest:
        """Build and validate a manifest from its JSON form (a `checksum` entry, if any, is not checked here:
        `read` does that)."""
        if not isinstance(data, Mapping):
            raise MapperFormatError(f"a mapper manifest must be a JSON object, got {type(data).__name__}; re-fit")
        check_format_version(data.get("format_version"))
        data = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
        names = {spec.name for spec in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise _bad(unknown[0], "is not a manifest field")
        required = [spec.name for spec in dataclasses.fields(cls)
                    if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise _bad(missing[0], "is missing")
        values = dict(copy.deepcopy(data))
        values["config"] = _build("config", FitConfig, _fit_settings(values["config"]))
        if values.get("mlp_config") is not None:
            values["mlp_config"] = _build("mlp_config", MLPConfig, values["mlp_config"])
        if values.get("guard") is not None:
            values["guard"] = _build("guard", GuardCalibration, values["guard"])
        if values.get("recompute") is not None:
            values["recompute"] = _build("recompute", RecomputeChoice, values["recompute"])
        for side in SIDES:
            values[f"{side}_layout"] = _build(f"{side}_layout", FeatureLayout, values[f"{side}_layout"])
        return cls(**values)

    # -- mapping view (read-only) -----------------------------------------------------------------
    @cached_property
    def _view(self) -> dict:
        return self.to_dict()

    def __getitem__(self, key: str):
        return self._view[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)


def check_format_version(version) -> None:
    """MapperFormatError unless ``version`` is the one format this kvhandoff reads and writes."""
    if isinstance(version, int) and not isinstance(version, bool) and version > MAPPER_FORMAT_VERSION:
        raise MapperFormatError(
            f"mapper format version {version!r} is newer than this kvhandoff's ({MAPPER_FORMAT_VERSION}): upgrade "
            "kvhandoff (`pip install -U kvhandoff`)"
        )
    if version != MAPPER_FORMAT_VERSION:
        raise MapperFormatError(
            f"mapper format version {version!r} was written by an older kvhandoff; this one reads version "
            f"{MAPPER_FORMAT_VERSION} only: re-fit the mapper (`kvhandoff fit`)"
        )


#: settings a manifest's config may name that belong to the runtime, not to the map: read past, never applied
RUNTIME_SETTINGS = ("recompute",)


def _fit_settings(config):
    if not isinstance(config, Mapping):
        return config
    return {key: value for key, value in config.items() if key not in RUNTIME_SETTINGS}


def _refuse_unknown_fields(name: str, kind: type, value: Mapping) -> None:
    """A record written by a kvhandoff that records more than this one knows: say so, and the fix."""
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(kind)}) if dataclasses.is_dataclass(kind) else []
    if unknown:
        raise MapperFormatError(f"mapper manifest field {name!r} has fields this kvhandoff does not know "
                                f"({', '.join(unknown)}); upgrade kvhandoff, or re-fit the mapper")


def _build(name: str, kind: type, value):
    if not isinstance(value, Mapping):
        raise _bad(name, f"must be a JSON object, got {value!r}")
    _refuse_unknown_fields(name, kind, value)
    try:
        return kind(**value)
    except (TypeError, ConfigError) as exc:
        raise _bad(name, f"is invalid ({exc})") from exc


def dumps(manifest: MapperManifest) -> str:
    """The text of `manifest.json`: the canonical JSON form plus its checksum."""
    return json.dumps({**manifest.to_dict(), CHECKSUM_KEY: manifest.checksum()}, indent=2, sort_keys=True)


def loads(text: str, where: str) -> MapperManifest:
    """Parse and check `manifest.json` text (``where``: the file, for messages): JSON, format version, checksum,
    then every field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MapperFormatError(f"{where} is not valid JSON ({exc}); re-fit or restore the mapper") from exc
    if not isinstance(data, dict):
        raise MapperFormatError(f"{where} is not a JSON object; re-fit or restore the mapper")
    check_format_version(data.get("format_version"))
    body = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    if data.get(CHECKSUM_KEY) != sha256_json(body):
        raise MapperFormatError(
            f"{where} does not match its checksum: the manifest was edited or is damaged; re-fit the mapper or "
            "restore it from a backup"
        )
    return MapperManifest.from_dict(body)
