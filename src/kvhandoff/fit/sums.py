"""What calibration statistics sum, by name and shape (`sum_shapes`): x, y, Σy² and the second moments xxᵀ, xyᵀ
and yyᵀ, each kept per pair of modalities (K·K, V·V and, with the K–V cross moments, K·V and V·K), and which of the
optional ones a set of sums holds (`SumsContent`). The in-memory statistics (`statistics.CalibrationStats`) and
their file (`statistics_file`) name their tensors by it."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.model.capture import MODALITIES, FeatureLayout

#: the second moments, each summed per pair of modalities (a, b); xxᵀ and yyᵀ are symmetric, so only their
#: (K, V) cross block is held, (V, K) being its transpose
MOMENTS = ("xx", "xy", "yy")
#: rows of a big matrix handled at once where a whole-matrix temporary would double its memory
ROW_CHUNK = 1024


def moment_name(kind: str, a: int, b: int) -> str:
    """The tensor name of moment `kind`'s block of modalities (a, b), e.g. sum_xy_KV."""
    return f"sum_{kind}_{MODALITIES[a]}{MODALITIES[b]}"


def moment_blocks(kind: str, kv_cross: bool) -> list[tuple[int, int]]:
    """The modality pairs held of moment `kind`: K·K and V·V, and with `kv_cross` the cross blocks (K·V alone for
    the symmetric xxᵀ and yyᵀ)."""
    if not kv_cross:
        return [(0, 0), (1, 1)]
    return [(0, 0), (0, 1), (1, 0), (1, 1)] if kind == "xy" else [(0, 0), (0, 1), (1, 1)]


def sum_shapes(source: FeatureLayout, target: FeatureLayout, source_sums: bool = True, target_gram: bool = False,
               kv_cross: bool = False) -> dict[str, tuple[int, ...]]:
    """Name → shape of every sum statistics of these layouts hold, in `CalibrationStats.sums()` order."""
    widths = {"x": source.modality_width, "y": target.modality_width}
    shapes: dict[str, tuple[int, ...]] = {"sum_x": (source.width,)} if source_sums else {}
    shapes.update(sum_y=(target.width,), sum_y_squared=(target.width,))
    for kind in MOMENTS:
        if (kind == "xx" and not source_sums) or (kind == "yy" and not target_gram):
            continue
        for a, b in moment_blocks(kind, kv_cross):
            shapes[moment_name(kind, a, b)] = (widths[kind[0]], widths[kind[1]])
    return shapes


@dataclass(frozen=True)
class SumsContent:
    """What statistics hold beyond the sums every map reads: the target's Gram (`target_gram`) and the K–V cross
    moments (`kv_cross`)."""

    target_gram: bool = False
    kv_cross: bool = False

    def covers(self, needed: SumsContent) -> bool:
        return (self.target_gram or not needed.target_gram) and (self.kv_cross or not needed.kv_cross)


def as_count(count: float) -> int | float:
    """What statistics count their rows with: an int where it is whole (unweighted rows), else the float sum of the
    rows' weights (`CalibrationStats.add_rows`)."""
    return int(count) if float(count).is_integer() else float(count)


def missing_moment(kind: str, a: int, b: int, source_sums: bool) -> str:
    """Why statistics lack moment `kind`'s block (a, b), and how to get statistics that hold it."""
    if kind == "yy":
        return ("these statistics hold no target Gram (a pass for one direction), which the reverse direction "
                "reads as its input covariance: collect them with target_gram=True (`kvhandoff fit "
                "--both-directions`), or run a pass in the other direction")
    if kind == "xx" and not source_sums:
        return "the source sums (x, xxᵀ) of these statistics were not collected"
    return (f"these statistics hold no {MODALITIES[a]}·{MODALITIES[b]} cross moments (a pass for maps that read "
            "their own modality); maps that read source K and V together (source_inputs='kv', `--inputs kv`) need "
            "a pass that sums them (kv_cross=True)")
