"""The fit's settings (FitConfig, CalibrationSpec, MLPConfig, RefineConfig), the one positive-value check, and
where kvhandoff keeps its files. The runtime's, the server's and the models' placement settings live with them
(`runtime.policy`, `serving.settings`, `model.placement`)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvhandoff.errors import ConfigError

#: relative ridge λ candidates for ridge_lambda="gcv" (chosen per target layer and K|V by generalised
#: cross-validation, computed from the statistics alone).
GCV_LAMBDAS: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
#: λ of the single-source probes that rank layers when ridge_lambda="gcv".
PROBE_LAMBDA = 0.01

#: candidates for top_k="heldout" / ridge_lambda="heldout": each target layer gets the k (and each of its K and
#: V maps the λ) with the lowest error on held-out calibration windows (needs the calibration rows on disk).
HELDOUT_KS: tuple[int | str, ...] = (1, 2, 4, 8, 16, "all")
HELDOUT_LAMBDAS: tuple[float, ...] = (0.01, 0.1, 1.0)
HELDOUT_FRACTION = 0.1

#: calibration text groups (`CalibrationSpec.mix`) and the corpus sources each packs (see `fit/text_sources.py`):
#: "prose" — BoolQ train passages and LAMBADA novels; "exams" — multiple-choice questions with their answers
#: in the few-shot exam layout (CommonsenseQA, SciQ, MedMCQA; none of them an evaluation task); "math" — worked
#: MATH solutions in the chain-of-thought layout of few-shot GSM8K prompts (MATH is not an evaluation task);
#: "tasks" — *train-split* items of the zero-shot core tasks (ARC-Challenge, HellaSwag, WinoGrande) in the
#: evaluation's prompt layout with their gold answers (validation items, the reported ones, are excluded).
CALIBRATION_GROUPS: dict[str, tuple[str, ...]] = {
    "prose": ("boolq-train", "lambada"),
    "exams": ("mc-exams",),
    "math": ("math-solutions",),
    "tasks": ("task-train",),
    "reading": ("boolq-reading",),
}
#: the default mix: prose, and the few-shot and chain-of-thought layouts a handoff meets (docs/RESULTS.md compares
#: the mixes)
DEFAULT_CALIBRATION_MIX: tuple[str, ...] = ("prose", "exams", "math")
#: the prose-only mix: a spec with it keys its statistics as a spec that names no mix (`CalibrationSpec.to_dict`)
PROSE_ONLY_MIX: tuple[str, ...] = ("prose",)

#: k values the layer-selection sweep considers ("all" = every source layer).
TOP_K_CHOICES: tuple[int | str, ...] = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, "all")


#: `FitConfig.heads`, `FitConfig.projection` and `FitConfig.storage_dtype` choices (see FitConfig)
HEAD_CHOICES: tuple[str, ...] = ("all", "aligned")
PROJECTIONS: tuple[str, ...] = ("rrr", "pca")
STORAGE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: `FitConfig.row_weights` choices: every calibration row counts alike, or by the target's attention to it
ROW_WEIGHTS: tuple[str, ...] = ("uniform", "attention")
#: settings of the statistics pass left out of cache keys and manifests at their defaults
_PASS_DEFAULTS = {"row_weights": "uniform"}
#: the k each target layer may take with `FitConfig.k_tolerance` (up to top_k; "all" always a candidate)
LAYER_KS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
#: compact-mapper settings at their defaults (the full ridge map): left out of manifests and cache keys
_COMPACT_DEFAULTS = {"heads": "all", "k_tolerance": 0.0, "rank": 0, "projection": "rrr", "storage_dtype": "float32"}

#: the one mapper format this kvhandoff reads and writes (every method: the manifest's `method` says which
#: mapper class reads the tensors; see `manifest.py`). Mappers written in an earlier format are refused: re-fit.
MAPPER_FORMAT_VERSION = 4


def require_positive(name: str, value, kind: type = int, minimum: int | float | None = None):
    """The one check of positive settings: ``value`` must be a ``kind`` (int: an integer, bools refused; float:
    any finite real number) and > 0 — or >= ``minimum`` when given (e.g. 0 for a count that may be zero).
    Returns ``value``; ConfigError naming ``name`` otherwise."""
    if kind is int:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
        what = "a positive integer" if minimum is None else f"an integer >= {minimum}"
    elif kind is float:
        ok_type = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        what = "a number > 0" if minimum is None else f"a number >= {minimum}"
    else:
        raise TypeError(f"require_positive checks int or float settings, not {kind!r}")
    if not ok_type or (value <= 0 if minimum is None else value < minimum):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return value


def kvhandoff_home() -> Path:
    """Cache folder for converted models, mappers and results ($KVHANDOFF_HOME, default ~/.cache/kvhandoff)."""
    return Path(os.environ.get("KVHANDOFF_HOME", Path.home() / ".cache" / "kvhandoff")).expanduser()


@dataclass(frozen=True)
class FitConfig:
    """How a mapper is fitted.

    top_k: source layers feeding each target layer (an int, or "all"; "heldout": chosen per target layer
        from HELDOUT_KS on held-out calibration windows, which needs the calibration rows — `heldout.py`).
    ridge_lambda: ridge strength *relative to the mean input-feature variance*: the solve uses
        (C_xx + ridge_lambda * mean(diag C_xx) * I) where C_xx is the centred input covariance
        (Gram / token count). This keeps λ independent of the number of calibration tokens and of
        the activations' scale; λ = 0.01 is the paper's default. "gcv" picks λ from GCV_LAMBDAS for each
        (target layer, K|V) by generalised cross-validation; "heldout" from HELDOUT_LAMBDAS on held-out
        calibration windows (only together with top_k="heldout").
    token_stride: keep every n-th token position of each calibration sequence (paper: 4).
    skip_first_tokens: positions dropped at the start of every sequence (attention-sink tokens carry
        outlier K/V that would dominate the statistics).
    exact_prefix: leading context tokens the target recomputes itself at handoff instead of reading mapped
        K/V (they are attention sinks: errors there reach every later token). Costs a prefill of that many
        tokens, independent of context length. Recorded in the manifest; handoffs use it by default.
    source_inputs: what each map reads from the selected source layers: "own" (the paper: K maps read source
        K, V maps source V) or "kv" (both maps read source K and V: twice the inputs, weights and transfer GEMM).
    Compact mappers (`kvhandoff.fit.compact`; solved from the same statistics, recorded in the manifest; each left out
    of manifests and cache keys while at its default, the full ridge map):
    heads: "all" (every target KV head reads every KV head of the selected source layers) or "aligned" (target KV
        head h reads only its group of source KV heads: head h when the counts are equal; h·Hs/Ht … when the
        source has a multiple of the target's heads; h·Hs // Ht when the target has a multiple of the source's).
    k_tolerance: 0 (off) or, each target layer reads the fewest source layers (from LAYER_KS up to top_k) whose
        in-sample R² (mean of K and V) is within this much of top_k's.
    rank: 0 (off) or r > 0: every target layer's K (V) map reads one shared rank-r projection of all source
        layers' K (V) (needs top_k="all", heads="all", source_inputs="own", k_tolerance 0).
    projection: the rank-r basis: "rrr" (reduced-rank ridge: the r directions of the full ridge fit that explain
        the most target variance, each target layer weighted equally) or "pca" (the top r eigenvectors of the
        source Gram, then ridge on them).
    storage_dtype: dtype of the saved weight tensors ("float32", "float16", "bfloat16"); biases stay float32 and
        the map computes in float32 (the fitted mapper's weights are rounded to it, so it equals the saved one).
    row_weights: "uniform" (every kept calibration row counts alike, the paper) or "attention" (each row weighted by
        the attention the target pays it, `kvhandoff.fit.weighting`: the maps are fitted hardest where the target
        reads). Weighted by one direction's target, such statistics serve that direction only.
    """

    top_k: int | str = "all"
    ridge_lambda: float | str = 0.01
    token_stride: int = 4
    skip_first_tokens: int = 0
    exact_prefix: int = 4
    source_inputs: str = "own"
    heads: str = "all"
    k_tolerance: float = 0.0
    rank: int = 0
    projection: str = "rrr"
    storage_dtype: str = "float32"
    row_weights: str = "uniform"

    def __post_init__(self) -> None:
        if isinstance(self.top_k, str):
            if self.top_k not in ("all", "heldout"):
                raise ConfigError(f"top_k must be a positive integer, 'all' or 'heldout', got {self.top_k!r}")
        else:
            require_positive("top_k", self.top_k)
        if self.ridge_lambda not in ("gcv", "heldout"):
            if isinstance(self.ridge_lambda, str):
                raise ConfigError(f"ridge_lambda must be a number > 0 (0.01 is the paper's value), 'gcv' or "
                                  f"'heldout', got {self.ridge_lambda!r}")
            require_positive("ridge_lambda", self.ridge_lambda, float)
        if (self.top_k == "heldout") != (self.ridge_lambda == "heldout"):
            raise ConfigError(
                "top_k='heldout' and ridge_lambda='heldout' go together (both are chosen per target layer on "
                f"held-out calibration windows); got top_k={self.top_k!r}, ridge_lambda={self.ridge_lambda!r}"
            )
        require_positive("token_stride", self.token_stride)
        require_positive("skip_first_tokens", self.skip_first_tokens, minimum=0)
        require_positive("exact_prefix", self.exact_prefix, minimum=0)
        if self.source_inputs not in ("own", "kv"):
            raise ConfigError(f"source_inputs must be 'own' or 'kv', got {self.source_inputs!r}")
        if self.source_inputs == "kv" and self.top_k == "heldout":
            raise ConfigError("source_inputs='kv' is not combined with top_k='heldout'; choose a fixed k or 'all'")
        if self.row_weights not in ROW_WEIGHTS:
            raise ConfigError(f"row_weights must be one of {', '.join(ROW_WEIGHTS)}, got {self.row_weights!r}")
        if self.weighted and self.top_k == "heldout":
            raise ConfigError("top_k='heldout' scores held-out calibration rows unweighted: use it with "
                              "row_weights='uniform', or choose a fixed k with row_weights='attention'")
        self._check_compact()

    def _check_compact(self) -> None:
        if self.heads not in HEAD_CHOICES:
            raise ConfigError(f"heads must be one of {', '.join(HEAD_CHOICES)}, got {self.heads!r}")
        require_positive("k_tolerance", self.k_tolerance, float, minimum=0)
        if self.k_tolerance >= 1:
            raise ConfigError(f"k_tolerance is an R² margin in [0, 1), got {self.k_tolerance!r}")
        if self.k_tolerance and self.top_k == "heldout":
            raise ConfigError("k_tolerance chooses k per target layer from the statistics; top_k='heldout' chooses "
                              "it on held-out windows: use one of them")
        require_positive("rank", self.rank, minimum=0)
        if self.projection not in PROJECTIONS:
            raise ConfigError(f"projection must be one of {', '.join(PROJECTIONS)}, got {self.projection!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        if self.compact and isinstance(self.ridge_lambda, str):
            raise ConfigError(f"compact mappers (heads, k_tolerance, rank) take one fixed ridge λ, got "
                              f"ridge_lambda={self.ridge_lambda!r}")
        shared = self.top_k == "all" and self.heads == "all" and not self.k_tolerance and self.source_inputs == "own"
        if self.rank and not shared:
            raise ConfigError(
                "rank > 0 shares one projection of all source layers between the target layers: it needs "
                f"top_k='all', heads='all', k_tolerance=0 and source_inputs='own' (got top_k={self.top_k!r}, "
                f"heads={self.heads!r}, k_tolerance={self.k_tolerance!r}, source_inputs={self.source_inputs!r})"
            )

    @property
    def weighted(self) -> bool:
        """Whether the statistics weight their rows (`row_weights` other than "uniform")."""
        return self.row_weights != "uniform"

    def pass_key(self) -> tuple:
        """The settings of the statistics pass as its cache key sees them (the row weighting only when weighted)."""
        return (self.token_stride, self.skip_first_tokens, *((self.row_weights,) if self.weighted else ()))

    @property
    def compact(self) -> bool:
        """Whether the map has a compact structure (head-aligned, k per layer or low-rank), not the full ridge."""
        return self.heads != "all" or bool(self.k_tolerance) or bool(self.rank)

    def key_dict(self) -> dict:
        """The config as cache keys see it: every field, less the compact-mapper settings and the row weighting at
        their defaults (the key of a full ridge map from uniform rows names none of them)."""
        return _without_defaults(asdict(self))

    def input_modalities(self, modality: int) -> tuple[int, ...]:
        """Source modalities (0 = K, 1 = V) the map of target `modality` reads, in the order of its input columns."""
        return (0, 1) if self.joint_inputs else (modality,)

    @property
    def joint_inputs(self) -> bool:
        """Whether each map reads the selected source layers' K and V together (source_inputs="kv"): its
        statistics must hold the K–V cross moments (`CalibrationStats(kv_cross=True)`)."""
        return self.source_inputs == "kv"

    @property
    def probe_lambda(self) -> float:
        """λ of the layer-ranking probes."""
        return PROBE_LAMBDA if self.ridge_lambda in ("gcv", "heldout") else float(self.ridge_lambda)

    def to_dict(self) -> dict:
        """The config as manifests see it: the settings that differ from the full ridge map's defaults (source_inputs,
        the compact settings) only."""
        data = asdict(self)
        if self.source_inputs == "own":
            del data["source_inputs"]
        return _without_defaults(data)


def _without_defaults(data: dict) -> dict:
    """A FitConfig's fields less the compact-mapper and pass settings at their defaults."""
    for name, default in {**_COMPACT_DEFAULTS, **_PASS_DEFAULTS}.items():
        if data[name] == default:
            del data[name]
    return data


@dataclass(frozen=True)
class CalibrationSpec:
    """How much real text the default fit reads: `num_sequences` windows of `seq_len` tokens.

    The default reads 120 windows of 512 tokens, a third each prose, exam questions and worked math solutions,
    through both models; the cost is linear in num_sequences × seq_len.
    mix: the text groups of `CALIBRATION_GROUPS`; the windows are shared out equally between them (the first
    groups take the remainder), each group packed on its own, so a mix's windows of one group are exactly
    those a calibration of that group alone would read first.
    """

    num_sequences: int = 120
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 1
    mix: tuple[str, ...] = DEFAULT_CALIBRATION_MIX

    def __post_init__(self) -> None:
        for name in ("num_sequences", "seq_len", "batch_size"):
            require_positive(name, getattr(self, name))
        if self.seq_len < 8:
            raise ConfigError(f"seq_len must be at least 8 tokens, got {self.seq_len}")
        if isinstance(self.mix, str) or not self.mix or any(group not in CALIBRATION_GROUPS for group in self.mix):
            raise ConfigError(
                f"mix must be a non-empty tuple of calibration groups among {tuple(CALIBRATION_GROUPS)}, "
                f"got {self.mix!r}"
            )
        if len(set(self.mix)) != len(self.mix):
            raise ConfigError(f"mix names a calibration group twice: {self.mix!r}")
        if self.num_sequences < len(self.mix):
            raise ConfigError(f"num_sequences ({self.num_sequences}) must give every group of mix {self.mix} a window")

    def windows_per_group(self) -> dict[str, int]:
        """How many of the windows each group of `mix` gets."""
        share, extra = divmod(self.num_sequences, len(self.mix))
        return {group: share + (i < extra) for i, group in enumerate(self.mix)}

    def to_dict(self) -> dict:
        """The spec as cache keys see it; the prose-only mix is left out (`PROSE_ONLY_MIX`)."""
        data = asdict(self)
        if self.mix == PROSE_ONLY_MIX:
            del data["mix"]
        else:
            data["mix"] = list(self.mix)
        return data


@dataclass(frozen=True)
class MLPConfig:
    """The MLP mapper (`--method mlp`): a residual MLP per target layer on top of a ridge mapper.

    Each target layer's MLP reads the content-space K *and* V of its `input_layers` best source layers
    (ranked by the same R² probes as the ridge), standardised, through two ReLU layers of `hidden` units, and
    predicts what the ridge map leaves over (its last layer starts at zero, so training starts from the ridge
    mapper exactly). Loss: squared error per (layer, K|V) relative to that output's total variance, i.e. 1 − R².
    Trained with Adam on calibration feature rows; `validation_fraction` of the calibration windows (whole
    windows) is held out and every target layer keeps the epoch with its lowest held-out loss, epoch 0 (the
    ridge alone) included, so the MLP never makes a layer worse on held-out windows.
    """

    hidden: int = 256
    input_layers: int = 4
    epochs: int = 8
    batch_size: int = 1024
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    validation_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "input_layers", "epochs", "batch_size"):
            require_positive(f"mlp {name}", getattr(self, name))
        require_positive("mlp learning_rate", self.learning_rate, float)
        require_positive("mlp weight_decay", self.weight_decay, float, minimum=0)
        if not 0 < self.validation_fraction < 1:
            raise ConfigError(
                f"mlp validation_fraction must be in (0, 1) (held-out windows choose each layer's epoch), "
                f"got {self.validation_fraction!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RefineConfig:
    """End-to-end refinement of a fitted linear mapper (`kvhandoff refine`): the target's own next-token
    distribution is the objective, not the K/V error.

    Each step averages `batch_size` samples: a training window and a context length m, log-uniform in
    [min_context, max_context] (the benchmarks' contexts are short, conversations long). It maps the window's
    first m tokens, with the first
    `exact_prefix` positions the target's own, lets the target read the next `continuation` tokens on that cache
    and minimises KL(target on its own cache ‖ target on the mapped cache) over them, by Adam on the map's weight
    and bias (the target's weights stay fixed). `validation_windows` windows are held out of the steps; every
    `validate_every` steps their KL is measured and the best step's map is kept, the unrefined map included.
    """

    steps: int = 150
    batch_size: int = 4
    learning_rate: float = 5e-6
    min_context: int = 8
    max_context: int = 448
    continuation: int = 16
    validation_windows: int = 8
    validate_every: int = 15
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "min_context", "max_context", "continuation", "validation_windows",
                     "validate_every"):
            require_positive(f"refine {name}", getattr(self, name))
        if self.min_context < 2 or self.min_context > self.max_context:
            raise ConfigError(
                f"refine contexts must satisfy 2 <= min_context <= max_context, got {self.min_context}.."
                f"{self.max_context}"
            )
        require_positive("refine learning_rate", self.learning_rate, float)

    def window_length(self) -> int:
        """Tokens a training window needs: the longest mapped context plus the scored continuation."""
        return self.max_context + self.continuation

    def to_dict(self) -> dict:
        return asdict(self)

