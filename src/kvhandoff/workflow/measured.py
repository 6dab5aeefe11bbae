"""What was measured for the embedded pair's default mappers (`measured_records`: their quality guards and recompute
policies, with where the numbers come from), read from the records file shipped with kvhandoff
(`MEASURED_RECORDS_FILE`) and written into a default mapper's manifest when it is fitted (`pair_mappers`).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from kvhandoff.config import PROSE_ONLY_MIX, CalibrationSpec, FitConfig
from kvhandoff.errors import ConfigError, MapperFormatError
from kvhandoff.mapper.manifest import GuardCalibration, RecomputeChoice

if TYPE_CHECKING:
    from kvhandoff.workflow.named_pair import NamedPair


#: the records measured for the embedded pair's default mappers, shipped with kvhandoff (`measured_records`)
MEASURED_RECORDS_FILE = Path(__file__).parents[1] / "data" / "measured_records.json"
#: what a record of the file holds: the pair, the fit it applies to, what was measured, where the numbers come from
_RECORD_FIELDS = ("source_model", "target_model", "config", "calibration", "guard", "recompute", "source")
#: the measurements a record may hold, each the manifest record of that name
_MEASUREMENTS = ("guard", "recompute")
#: what a record's "source" names for each of its measurements (required, then optional)
_SOURCE_FIELDS = ("docs", "command")
_SOURCE_OPTIONAL = ("how",)


@dataclass(frozen=True)
class MeasuredRecord:
    """What was measured for one direction's ridge mapper of `config` over `calibration`'s windows: its quality
    guard and the selective-recompute policy chosen for it (None: not measured). measured_by: for each of them,
    where its numbers come from ({"guard" | "recompute": {"docs", "command", "how"}}; not part of the record's
    identity)."""

    source: str
    target: str
    config: FitConfig
    calibration: CalibrationSpec
    guard: GuardCalibration | None = None
    recompute: RecomputeChoice | None = None
    measured_by: dict = field(default_factory=dict, compare=False)


def measured_records(path: Path | str | None = None) -> tuple[MeasuredRecord, ...]:
    """The records measured for the embedded pair's default mappers (`MEASURED_RECORDS_FILE`, or the records file
    at ``path``), written into their manifests when they are fitted, so that a fresh machine serves the default pair
    with them. Each file is read and checked once, when first asked for; ConfigError (naming the file, the record
    and the fix) when it is not a valid records file.

    The file: {"description": ..., "records": [...]}; a record: its pair ("source_model", "target_model"), the fit
    it applies to ("config": `FitConfig.to_dict`, "calibration": `CalibrationSpec.to_dict`), what was measured
    ("guard", "recompute": each in the form the mapper manifest writes it, checked by the manifest's own classes)
    and where the numbers come from ("source": for each measurement, the docs section and the experiment command,
    optionally how the record was chosen)."""
    return _read_measured_records(Path(MEASURED_RECORDS_FILE if path is None else path))


def measured_record(pair: NamedPair, config: FitConfig, calibration: CalibrationSpec) -> MeasuredRecord | None:
    """What was measured for `pair`'s ridge mapper of `config` over `calibration` (`measured_records`), or None."""
    return next((m for m in measured_records() if (m.source, m.target, m.config, m.calibration)
                 == (pair.source_spec, pair.target_spec, config, calibration)), None)


class _RecordsProblem(ConfigError):
    """A problem with one record of a records file (the file is named where it is caught)."""


@functools.cache
def _read_measured_records(path: Path) -> tuple[MeasuredRecord, ...]:
    def bad(problem: str) -> ConfigError:
        return ConfigError(f"the measured records file {path} {problem}: {_RECORDS_FIX}")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise bad(f"cannot be read ({exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise bad('must be a JSON object with a list of "records"')
    unknown = sorted(set(data) - {"description", "records"})
    if unknown:
        raise bad(f"has fields kvhandoff does not know ({', '.join(unknown)}; a records file holds "
                  '"description" and "records")')
    records: dict[tuple, MeasuredRecord] = {}
    for index, entry in enumerate(data["records"]):
        name = _record_name(index, entry)
        try:
            record = _measured_record(entry)
        except _RecordsProblem as exc:
            raise bad(f"has an invalid {name}: {exc}") from exc
        key = (record.source, record.target, record.config, record.calibration)
        if key in records:
            raise bad(f"has {name} for a pair, fit config and calibration an earlier record names too (one record "
                      "each)")
        records[key] = record
    return tuple(records.values())


#: what an invalid records file's message says to do
_RECORDS_FIX = ("correct the record (each measurement in the form a mapper manifest writes it, `measured_records`), "
                "or restore kvhandoff's own copy of the file (reinstall kvhandoff)")


def _record_name(index: int, entry) -> str:
    """"record N", with its pair where the record names one."""
    if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("source_model", "target_model")):
        return f"record {index} ({entry['source_model']} → {entry['target_model']})"
    return f"record {index}"


def _measured_record(entry) -> MeasuredRecord:
    """One record of a records file, checked (`_RecordsProblem` names what is wrong)."""
    if not isinstance(entry, dict):
        raise _RecordsProblem(f"a record must be a JSON object, got {entry!r}")
    unknown = sorted(set(entry) - set(_RECORD_FIELDS))
    if unknown:
        raise _RecordsProblem(f"fields kvhandoff does not know ({', '.join(unknown)}; a record holds "
                              f"{', '.join(_RECORD_FIELDS)})")
    missing = [name for name in _RECORD_FIELDS if name not in entry and name not in _MEASUREMENTS]
    if missing:
        raise _RecordsProblem(f"field {missing[0]!r} is missing")
    for name in ("source_model", "target_model"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise _RecordsProblem(f"field {name!r} must name a model, got {entry[name]!r}")
    measured = tuple(name for name in _MEASUREMENTS if name in entry)
    if not measured:
        raise _RecordsProblem(f"it records no measurement ({' or '.join(_MEASUREMENTS)})")
    calibration = entry["calibration"]
    if isinstance(calibration, dict):  # `CalibrationSpec.to_dict`: the mix as a list, left out when prose-only
        mix = calibration.get("mix", PROSE_ONLY_MIX)
        calibration = {**calibration, "mix": tuple(mix) if isinstance(mix, list) else mix}
    return MeasuredRecord(
        entry["source_model"], entry["target_model"], _checked("config", FitConfig, entry["config"]),
        _checked("calibration", CalibrationSpec, calibration),
        guard=_checked("guard", GuardCalibration, entry["guard"]) if "guard" in entry else None,
        recompute=_checked("recompute", RecomputeChoice, entry["recompute"]) if "recompute" in entry else None,
        measured_by=_measured_by(entry["source"], measured))


def _checked(name: str, kind: type, value):
    """``value`` (a record's field ``name``, the JSON form of ``kind``) built, and so checked, by ``kind`` itself."""
    if not isinstance(value, dict):
        raise _RecordsProblem(f"field {name!r} must be a JSON object (a {kind.__name__}), got {value!r}")
    unknown = sorted(set(value) - {spec.name for spec in fields(kind)})
    if unknown:
        raise _RecordsProblem(f"field {name!r} has fields a {kind.__name__} does not know ({', '.join(unknown)})")
    try:
        return kind(**value)
    except (TypeError, ConfigError, MapperFormatError) as exc:
        raise _RecordsProblem(f"field {name!r} fails the {kind.__name__} check ({exc})") from exc


def _measured_by(value, measured: tuple[str, ...]) -> dict:
    """A record's "source": for each of its ``measured`` records, where its numbers come from."""
    if not isinstance(value, dict) or set(value) != set(measured):
        raise _RecordsProblem(f"field 'source' must name where each measurement comes from: an object with an entry "
                              f"for each of {', '.join(measured)}, got {value!r}")
    for name, origin in value.items():
        text = isinstance(origin, dict) and all(isinstance(v, str) and v.strip() for v in origin.values())
        if not text or set(_SOURCE_FIELDS) - set(origin) or set(origin) - {*_SOURCE_FIELDS, *_SOURCE_OPTIONAL}:
            raise _RecordsProblem(
                f"field 'source.{name}' must be an object of non-empty strings naming the docs section and the "
                f"experiment command the numbers come from ({', '.join(_SOURCE_FIELDS)}; optionally "
                f"{', '.join(_SOURCE_OPTIONAL)}), got {origin!r}")
    return copy.deepcopy(value)


