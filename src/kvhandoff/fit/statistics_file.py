"""The file of calibration statistics (`CalibrationStats.save` / `.load`): the sums as float64 safetensors, with the
layouts and the token count, and the caller's description (`info`), in its metadata.

A file holding the whole matrices (written before the sums were kept per modality pair) loads into any form the
per-pair sums take: the blocks asked for, read alone, and the variances from the Gram's diagonal.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvhandoff.errors import StatisticsError
from kvhandoff.files import atomic_path
from kvhandoff.fit.sums import ROW_CHUNK, SumsContent, as_count, missing_moment, moment_name, sum_shapes
from kvhandoff.model.capture import MODALITIES, FeatureLayout

#: the tensors of a file holding the whole matrices (every cross block and the Gram) instead of per-modality sums
_WHOLE = {"xx": "sum_xx", "xy": "sum_xy", "yy": "sum_yy"}
_WHOLE_FILE = ("sum_x", "sum_y", "sum_xx", "sum_xy", "sum_yy")
#: metadata key of the caller's description saved with the sums (`save(info=...)`, `read_info`)
_INFO_KEY = "kvhandoff_info"


def write_sums(path: str | Path, source: FeatureLayout, target: FeatureLayout, count: int | float,
               tensors: dict[str, torch.Tensor], info: dict | None = None) -> None:
    """Write the sums ``tensors`` of statistics of these layouts over ``count`` tokens atomically; `info` (JSON) is
    stored in the same file, so it always describes these sums (`read_info`)."""
    layouts = {"source": source.__dict__, "target": target.__dict__, "count": count}
    metadata = {"kvhandoff_stats": json.dumps(layouts)}
    if info is not None:
        metadata[_INFO_KEY] = json.dumps(info)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def read_info(path: str | Path) -> dict | None:
    """The `info` saved with the statistics at `path` (None when none was), without reading the tensors."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            text = (handle.metadata() or {}).get(_INFO_KEY)
        return None if text is None else json.loads(text)
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise StatisticsError(f"cannot read statistics file {path}: {exc}; re-run the calibration") from exc


def saved_content(path: str | Path) -> SumsContent:
    """What the statistics file at `path` holds of the optional moments, from its header (a file of whole
    matrices holds all)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return held_content(set(handle.keys()))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise StatisticsError(f"cannot read statistics file {path}: {exc}; re-run the calibration") from exc


def read_sums(path: str | Path, target_gram: bool = False,
              kv_cross: bool = False) -> tuple[FeatureLayout, FeatureLayout, int | float, dict[str, torch.Tensor]]:
    """The source and target layouts, the token count and the sums (named as `sum_shapes` names them) of the file
    `write_sums` wrote at ``path``, holding the optional moments asked for (StatisticsError naming what is missing
    when the file does not hold them); every tensor is checked against the layouts in the metadata. Of a file that
    holds more, only the blocks asked for are read (module docstring)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = json.loads(handle.metadata()["kvhandoff_stats"])
            source, target = FeatureLayout(**meta["source"]), FeatureLayout(**meta["target"])
            whole = check_saved_sums(path, handle, source, target)
            held = held_content(set(handle.keys()))
            if not held.covers(SumsContent(target_gram, kv_cross)):
                kind, a = ("yy", 0) if target_gram and not held.target_gram else ("xy", 1)
                raise StatisticsError(f"statistics file {path}: {missing_moment(kind, 0, a, True)}")
            tensors = {name: read_sum(handle, name, source, target, whole)
                       for name in sum_shapes(source, target, True, target_gram, kv_cross)}
        return source, target, as_count(meta["count"]), tensors
    except StatisticsError:
        raise
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise StatisticsError(
            f"cannot read statistics file {path}: {exc}; re-run the calibration"
        ) from exc


def held_content(names: set[str]) -> SumsContent:
    """What a statistics file with tensors `names` holds of the optional moments (whole-matrix files: all)."""
    if _WHOLE["xx"] in names:
        return SumsContent(True, True)
    return SumsContent(moment_name("yy", 0, 0) in names, moment_name("xy", 0, 1) in names)


def check_saved_sums(path, handle, source: FeatureLayout, target: FeatureLayout) -> bool:
    """Check that an open statistics file holds a set of sums `save` writes (or the whole matrices: returns True
    then), each with its layouts' shape, float64."""
    names = sorted(handle.keys())
    forms = {(gram, cross): sum_shapes(source, target, True, gram, cross)
             for gram in (False, True) for cross in (False, True)}
    ws, wt = source.width, target.width
    whole = {"sum_x": (ws,), "sum_y": (wt,), "sum_xx": (ws, ws), "sum_xy": (ws, wt), "sum_yy": (wt, wt)}
    expected = next((shapes for shapes in [*forms.values(), whole] if sorted(shapes) == names), None)
    if expected is None:
        raise StatisticsError(
            f"statistics file {path} holds tensors {names}, expected {sorted(forms[False, False])} (with the K–V "
            f"cross moments and the target Gram where collected), or {sorted(whole)}; re-run the calibration"
        )
    for name in names:
        part = handle.get_slice(name)
        shape, dtype = tuple(part.get_shape()), part.get_dtype()
        if shape != expected[name] or dtype != "F64":
            raise StatisticsError(
                f"statistics tensor {name} in {path} is {shape} {dtype}, but its layouts need {expected[name]} F64; "
                "the file is damaged: re-run the calibration"
            )
    return expected is whole


def read_sum(handle, name: str, source: FeatureLayout, target: FeatureLayout, whole: bool) -> torch.Tensor:
    """Sum `name` (as `sum_shapes` names it) from an open statistics file; of a whole-matrix file, the block it
    is of the whole matrix (reading that block alone), and the variances from its Gram's diagonal."""
    if not whole or name in ("sum_x", "sum_y"):
        return handle.get_tensor(name)
    if name == "sum_y_squared":
        return gram_diagonal(handle.get_slice(_WHOLE["yy"]), target.width)
    kind, a, b = name[4:6], MODALITIES.index(name[7]), MODALITIES.index(name[8])
    rows = (target if kind == "yy" else source).modality_width
    columns = (source if kind == "xx" else target).modality_width
    return handle.get_slice(_WHOLE[kind])[a * rows : (a + 1) * rows, b * columns : (b + 1) * columns]


def gram_diagonal(part, width: int) -> torch.Tensor:
    """The diagonal of a saved [width, width] matrix (a safetensors slice), reading only its diagonal blocks."""
    starts = range(0, width, ROW_CHUNK)
    return torch.cat([part[start : start + ROW_CHUNK, start : start + ROW_CHUNK].diagonal() for start in starts]
                     or [torch.zeros(0, dtype=torch.float64)])
