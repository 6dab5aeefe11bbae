"""Why a mapper works or fails: where the layers' K/V are linearly predictable, what the map costs the
target's attention, and whether its errors land where attention reads.

Everything is measured on held-out token windows (never calibration data), one pass over them for all
mappers at once: both models are captured once per window (`capture_content_kv`; the target with its
queries), every mapper maps the source capture, and the metrics below are accumulated.

R² maps (source layer × target layer), single-layer ridge probes (`kvhandoff.fit.selection.layer_r2_matrix`):
- content space (keys before RoPE, values), from the calibration statistics when given: these drove
  the layer selection;
- held-out keys, content space and raw post-RoPE: the held-out windows are accumulated into a second,
  small `CalibrationStats` whose K slot holds *post-RoPE* keys (each model's content keys rotated by its own
  RoPE, `kvhandoff.model.rope.apply_rope`, at positions 0..T−1 of the window) and whose V slot holds the content
  keys of the same tokens, so both maps come from one accumulation with the same tokens and budget
  (every `rope_token_stride`-th position; the probes are fitted and scored on these same tokens).
  A linear probe on post-RoPE keys has to learn a position-dependent rotation at the other model's
  frequencies, which no fixed linear map can; that is why kvhandoff maps in content space.

Per mapper (held-out):
- R²_K, R²_V: 1 − Σ(mapped − true)² / Σ(true − mean)² per target KV head (content space, all positions of
  the windows, head dims summed), averaged over heads and layers; `fit_r2_*` are the in-sample values from
  the mapper's manifest.
- attention-output cosine: per target layer and query head, the causal softmax attention output
  softmax(q_rot·k_rotᵀ·scaling + causal mask)·v with the target's own post-RoPE queries (q_norm included),
  once with the target's true K/V and once with the mapped K/V (RoPE applied to the mapped content keys);
  GQA: query head h reads KV head h // (heads / kv_heads). Cosine of the two output vectors per token,
  averaged over tokens → per (layer, head); per layer = mean over heads; `attention_cosine` = mean.
- error concentration, per (layer, KV head g) — > 1: the error lands where attention reads, 1: isotropic:
  K: e = mapped − true content key of a token. M_g = [W_h for query heads h reading g] ∈ R^{D × group·hidden},
     the stacked per-head [head_dim, hidden] blocks of `q_proj.weight` (rows scaled by the q_norm gain where
     the model has one). M_g = U S Vᵀ (U: D×D, head-dim space), w_i = s_i² / mean(s²).
     C_K = Σ_tokens Σ_i w_i (u_iᵀ e)²  /  Σ_tokens ‖e‖².
     (A score error is qᵀ·R·e; with isotropic hidden states E[qqᵀ] ∝ M_g M_gᵀ = U S² Uᵀ, so C_K is the
     error's energy in the directions queries read, relative to isotropic error; RoPE's rotation mixes
     each frequency pair and is ignored here.)
  V: e_j = mapped − true value at position j; a_j = Σ_{h in group} Σ_i P_h[i, j]² the squared true attention
     weight position j receives (P: the target's own attention probabilities, query i ≥ j).
     Per window: C_V = Σ_windows Σ_j (a_j / mean_j a) ‖e_j‖²  /  Σ_windows Σ_j ‖e_j‖².
     (The output error Δo_i = Σ_j P[i, j] e_j has, for independent errors, E‖Δo_i‖² = Σ_j P[i, j]² ‖e_j‖².)
  Per layer = mean over KV heads; `concentration_k`/`_v` = mean over layers.

Summary: one row per (pair, mapper) with R²_K, R²_V, attention cosine and the concentrations, and — when
evaluation results exist for the same mappers — retention and the Pearson correlation of each metric with it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.fit.pipeline import feature_layout, mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.capture import ContentKV, capture_content_kv
from kvhandoff.model.geometry import decoder_layers, model_fingerprint, read_geometry
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.progress import Progress, as_progress
from kvhandoff.workflow import NamedPair, load_pair_mapper, obtain_statistics
from kvhandoff_lab.evaluation.runner import mapper_identity
from kvhandoff_lab.figures import save_figure

ANALYSIS_FORMAT = "kvhandoff-analysis/1"
METRICS = ("r2_k", "r2_v", "attention_cosine", "concentration_k", "concentration_v")


# -- RoPE and attention ---------------------------------------------------------------------------------------
def post_rope_keys(model, keys: torch.Tensor) -> torch.Tensor:
    """Content keys [..., T, D] rotated by `model`'s RoPE to positions 0..T−1 (what its cache holds)."""
    tokens = keys.shape[-2]
    inv_freq, scaling = rope_frequencies(model.config, seq_len=tokens)
    return apply_rope(keys.float(), torch.arange(tokens), inv_freq, scaling)


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """Causal softmax attention of post-RoPE queries [B, Hq, T, D] over keys/values [B, Hkv, T, D] (GQA:
    query head h reads KV head h // (Hq / Hkv)). Returns (outputs [B, Hq, T, D], probabilities [B, Hq, T, T])."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = queries @ keys.transpose(-1, -2) * scaling
    tokens = scores.shape[-1]
    mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return probs @ values, probs


def query_spectrum(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, KV head): left singular vectors U [L, Hkv, D, D] of the stacked query-projection blocks
    M_g [D, group·hidden] and the weights s² / mean(s²) [L, Hkv, D] (see the module docstring)."""
    geometry = read_geometry(model)
    heads, kv_heads, head_dim = geometry.num_attention_heads, geometry.num_kv_heads, geometry.head_dim
    group = heads // kv_heads
    bases, weights = [], []
    for layer in decoder_layers(model):
        attn = layer.self_attn
        w = attn.q_proj.weight.detach().double().view(heads, head_dim, -1)
        norm = getattr(attn, "q_norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            w = w * norm.weight.detach().double()[None, :, None]
        layer_bases, layer_weights = [], []
        for g in range(kv_heads):
            stacked = w[g * group : (g + 1) * group].permute(1, 0, 2).reshape(head_dim, -1)  # [D, group·hidden]
            u, s, _ = torch.linalg.svd(stacked, full_matrices=False)
            layer_bases.append(u)
            layer_weights.append(s**2 / (s**2).mean())
        bases.append(torch.stack(layer_bases))
        weights.append(torch.stack(layer_weights))
    return torch.stack(bases).float(), torch.stack(weights).float()


# -- accumulators ---------------------------------------------------------------------------------------------
class MapperDiagnostics:
    """Held-out metrics of one mapper, accumulated window by window (float64 sums)."""

    def __init__(self, layers: int, heads: int, kv_heads: int, head_dim: int):
        f64 = torch.float64
        self.sse = torch.zeros(2, layers, kv_heads, dtype=f64)
        self.sum_y = torch.zeros(2, layers, kv_heads, head_dim, dtype=f64)
        self.sum_y2 = torch.zeros(2, layers, kv_heads, dtype=f64)
        self.tokens = 0
        self.cos_sum = torch.zeros(layers, heads, dtype=f64)
        self.cos_count = 0
        self.conc = torch.zeros(2, 2, layers, kv_heads, dtype=f64)  # [K/V, numerator/denominator, L, Hkv]

    def update_r2(self, true: ContentKV, mapped: ContentKV) -> None:
        """R² sums over all tokens of a window; K/V [L, B, H, T, D]."""
        for modality, (y, y_hat) in enumerate(((true.keys, mapped.keys), (true.values, mapped.values))):
            y, y_hat = y.double(), y_hat.double()
            self.sse[modality] += ((y_hat - y) ** 2).sum(dim=(1, 3, 4))
            self.sum_y[modality] += y.sum(dim=(1, 3))
            self.sum_y2[modality] += (y**2).sum(dim=(1, 3, 4))
        self.tokens += true.keys.shape[1] * true.keys.shape[3]

    def result(self) -> dict:
        n = max(self.tokens, 1)
        sst = self.sum_y2 - (self.sum_y**2).sum(-1) / n
        r2 = 1 - self.sse / sst.clamp_min(1e-30)  # [2, L, Hkv]
        cosine = self.cos_sum / max(self.cos_count, 1)
        concentration = self.conc[:, 0] / self.conc[:, 1].clamp_min(1e-30)  # [2, L, Hkv]
        return {
            "r2_k": float(r2[0].mean()),
            "r2_v": float(r2[1].mean()),
            "r2_k_per_layer": r2[0].mean(-1).tolist(),
            "r2_v_per_layer": r2[1].mean(-1).tolist(),
            "attention_cosine": float(cosine.mean()),
            "attention_cosine_min_head": float(cosine.min()),
            "attention_cosine_per_layer": cosine.mean(-1).tolist(),
            "attention_cosine_per_head": cosine.tolist(),
            "concentration_k": float(concentration[0].mean()),
            "concentration_v": float(concentration[1].mean()),
            "concentration_k_per_layer": concentration[0].mean(-1).tolist(),
            "concentration_v_per_layer": concentration[1].mean(-1).tolist(),
            "concentration_per_head": {"K": concentration[0].tolist(), "V": concentration[1].tolist()},
            "heldout_tokens": self.tokens,
        }


def _attention_layer(diag: MapperDiagnostics, layer: int, q_rot, true_out, true_probs, true: ContentKV,
                     mapped_k_rot, mapped: ContentKV, scaling: float, bases, weights) -> None:
    """Accumulate attention cosine and error concentration of one layer of one window."""
    out, _ = causal_attention(q_rot, mapped_k_rot, mapped.values[layer].float(), scaling)
    cosine = torch.nn.functional.cosine_similarity(out, true_out, dim=-1, eps=1e-12)  # [B, Hq, T]
    diag.cos_sum[layer] += cosine.double().sum(dim=(0, 2))
    # K: error energy in the query-weighted directions
    error = (mapped.keys[layer] - true.keys[layer]).float()  # [B, Hkv, T, D]
    projected = torch.einsum("bhtd,hde->bhte", error, bases[layer]) ** 2
    diag.conc[0, 0, layer] += (projected * weights[layer][None, :, None, :]).double().sum(dim=(0, 2, 3))
    diag.conc[0, 1, layer] += (error.double() ** 2).sum(dim=(0, 2, 3))
    # V: error energy weighted by the squared attention each position receives
    kv_heads = error.shape[1]
    received = (true_probs**2).sum(-2)  # [B, Hq, T_key]
    received = received.view(received.shape[0], kv_heads, -1, received.shape[-1]).sum(2)  # [B, Hkv, T]
    received = received / received.mean(-1, keepdim=True).clamp_min(1e-30)
    value_error = ((mapped.values[layer] - true.values[layer]).double() ** 2).sum(-1)  # [B, Hkv, T]
    diag.conc[1, 0, layer] += (received.double() * value_error).sum(dim=(0, 2))
    diag.conc[1, 1, layer] += value_error.sum(dim=(0, 2))


@torch.inference_mode()
def attention_diagnostics(target_model, true: ContentKV, mapped: dict[str, ContentKV],
                          diagnostics: dict[str, MapperDiagnostics] | None = None,
                          spectrum: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, MapperDiagnostics]:
    """Accumulate R², attention cosine and error concentration of each mapped capture against the target's
    own capture `true` (with queries) of one window; returns the (updated) accumulators by name."""
    if true.queries is None:
        raise ConfigError("the target capture needs its queries: capture_content_kv(model, ids, with_queries=True)")
    layers, _, heads, tokens, head_dim = true.queries.shape
    kv_heads = true.keys.shape[2]
    if diagnostics is None:
        diagnostics = {}
    for name in mapped:
        diagnostics.setdefault(name, MapperDiagnostics(layers, heads, kv_heads, head_dim))
    bases, weights = spectrum if spectrum is not None else query_spectrum(target_model)
    for name, content in mapped.items():
        diagnostics[name].update_r2(true, content)
    inv_freq, rope_scaling = rope_frequencies(target_model.config, seq_len=tokens)
    positions = torch.arange(tokens)
    modules = decoder_layers(target_model)
    for layer in range(layers):
        scaling = float(getattr(modules[layer].self_attn, "scaling", head_dim**-0.5))
        q_rot = apply_rope(true.queries[layer].float(), positions, inv_freq, rope_scaling)
        true_k_rot = apply_rope(true.keys[layer].float(), positions, inv_freq, rope_scaling)
        true_out, true_probs = causal_attention(q_rot, true_k_rot, true.values[layer].float(), scaling)
        for name, content in mapped.items():
            mapped_k_rot = apply_rope(content.keys[layer].float(), positions, inv_freq, rope_scaling)
            _attention_layer(diagnostics[name], layer, q_rot, true_out, true_probs, true, mapped_k_rot, content,
                             scaling, bases, weights)
    for name in mapped:
        diagnostics[name].cos_count += true.queries.shape[1] * tokens
    return diagnostics


def add_key_statistics(stats: CalibrationStats, source_model, target_model, source: ContentKV, target: ContentKV,
                       token_stride: int = 2) -> None:
    """Add one window to the held-out key statistics: K slot = post-RoPE keys, V slot = content keys."""
    stats.update(
        ContentKV(keys=post_rope_keys(source_model, source.keys), values=source.keys.float()),
        ContentKV(keys=post_rope_keys(target_model, target.keys), values=target.keys.float()),
        token_stride=token_stride,
    )


# -- the analysis ---------------------------------------------------------------------------------------------
def fit_for_ks(stats: CalibrationStats, ks: Sequence[int | str], ridge_lambda: float, source_fingerprint: dict,
               target_fingerprint: dict, max_position_embeddings: tuple[int, int] = (32768, 32768),
               r2_matrix: torch.Tensor | None = None) -> dict[str, Mapper]:
    """Mappers named "k=<k>" solved from one set of statistics (`kvhandoff.fit.pipeline.mapper_from_statistics`)."""
    if r2_matrix is None:
        r2_matrix = layer_r2_matrix(stats, ridge_lambda)
    return {
        f"k={k}": mapper_from_statistics(stats, FitConfig(top_k=k, ridge_lambda=ridge_lambda), source_fingerprint,
                                         target_fingerprint, max_position_embeddings=max_position_embeddings,
                                         r2_matrix=r2_matrix)
        for k in ks
    }


def heldout_batches(tokenizer, num_windows: int, seq_len: int) -> list[torch.Tensor]:
    """`num_windows` held-out windows [1, seq_len] (the first seq_len tokens of held-out documents)."""
    documents = heldout_documents(tokenizer, num_windows, min_tokens=seq_len)
    return [doc[:seq_len][None] for doc in documents]


def run_analysis(
    source_model,
    target_model,
    batches: Sequence[torch.Tensor],
    mappers: Mapping[str, Mapper] | None = None,
    stats: CalibrationStats | None = None,
    ks: Sequence[int | str] = (),
    ridge_lambda: float = 0.01,
    calibration_r2: torch.Tensor | None = None,
    rope_token_stride: int = 2,
    out_dir: str | Path | None = None,
    retention=None,
    source_name: str | None = None,
    target_name: str | None = None,
    progress: Progress | bool = False,
) -> dict:
    """Analyse `mappers` (and mappers fitted from `stats` for each k in `ks`) on held-out `batches`
    ([batch, tokens] token ids). Returns the result dict; with `out_dir`, writes analysis.json and the figures.
    `calibration_r2` ([K/V, target, source], from `layer_r2_matrix` of the calibration statistics) may be
    given instead of `stats` when the mappers are already fitted (the statistics can then be freed first).
    progress: a bar over the held-out windows (`kvhandoff.progress`); `summary_table` shows the summary.

    Result: format, source, target, calibration_r2 ([K/V][target][source], when stats are given),
    heldout_key_r2 {"post_rope", "content"} ([target][source]), mappers {name: {top_k, selected_layers,
    fit_r2_k, fit_r2_v, held-out metrics (see MapperDiagnostics.result)}}, summary (rows), correlations.
    """
    mappers = dict(mappers or {})
    if stats is not None:
        if calibration_r2 is None:
            calibration_r2 = layer_r2_matrix(stats, ridge_lambda)
        if ks:
            mappers.update(fit_for_ks(
                stats, ks, ridge_lambda, model_fingerprint(source_model), model_fingerprint(target_model),
                (source_model.config.max_position_embeddings, target_model.config.max_position_embeddings),
                calibration_r2,
            ))
    elif ks:
        raise ConfigError("fitting mappers for a list of k needs calibration statistics (stats=...)")
    if not batches:
        raise ConfigError("the analysis needs at least one held-out batch")
    key_r2, diagnostics = heldout_pass(source_model, target_model, batches, mappers, ridge_lambda,
                                       rope_token_stride, progress)
    result = _analysis_header(source_model, target_model, source_name, target_name, ridge_lambda, batches,
                              rope_token_stride, calibration_r2, key_r2)
    for name, mapper in mappers.items():
        result["mappers"][name] = _mapper_entry(mapper, diagnostics[name])
    rows = summary_rows([result], retention)
    result["summary"] = rows
    result["correlations"] = correlations(rows)
    if out_dir is not None:
        render_analysis(result, out_dir)
    return result


def heldout_pass(source_model, target_model, batches: Sequence[torch.Tensor], mappers: Mapping[str, Mapper],
                 ridge_lambda: float, rope_token_stride: int = 2, progress: Progress | bool = False):
    """One pass over the held-out windows: (the held-out key R² maps [post-RoPE / content, target, source],
    each mapper's accumulated `MapperDiagnostics`)."""
    key_stats = CalibrationStats(feature_layout(source_model), feature_layout(target_model))
    spectrum = query_spectrum(target_model)
    diagnostics: dict[str, MapperDiagnostics] = {}
    for ids in as_progress(progress)(batches, desc="held-out windows", unit="window"):
        source = capture_content_kv(source_model, ids)
        target = capture_content_kv(target_model, ids, with_queries=True)
        add_key_statistics(key_stats, source_model, target_model, source, target, rope_token_stride)
        mapped = {name: mapper.map_content(source) for name, mapper in mappers.items()}
        attention_diagnostics(target_model, target, mapped, diagnostics, spectrum)
    return layer_r2_matrix(key_stats, ridge_lambda), diagnostics


def _analysis_header(source_model, target_model, source_name, target_name, ridge_lambda, batches,
                     rope_token_stride, calibration_r2, key_r2) -> dict:
    source_geometry, target_geometry = read_geometry(source_model), read_geometry(target_model)
    return {
        "format": ANALYSIS_FORMAT,
        "source": {"name": source_name or _model_name(source_model), "layers": source_geometry.num_layers},
        "target": {"name": target_name or _model_name(target_model), "layers": target_geometry.num_layers},
        "ridge_lambda": ridge_lambda,
        "heldout": {"windows": len(batches), "tokens": int(sum(b.numel() for b in batches)),
                    "rope_token_stride": rope_token_stride},
        "calibration_r2": None if calibration_r2 is None else calibration_r2.tolist(),
        "heldout_key_r2": {"post_rope": key_r2[0].tolist(), "content": key_r2[1].tolist()},
        "mappers": {},
    }


def _mapper_entry(mapper: Mapper, diagnostics: MapperDiagnostics) -> dict:
    fit_metrics = mapper.manifest.get("fit_metrics", {})
    return {
        "top_k": mapper.top_k,
        "selected_layers": mapper.selected.tolist(),
        "fit_r2_k": fit_metrics.get("r2_k_mean"),
        "fit_r2_v": fit_metrics.get("r2_v_mean"),
        "manifest_sha": mapper_identity(mapper).get("manifest_sha"),  # the evaluation's id, to join its results
        **diagnostics.result(),
    }


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", None) or type(model).__name__


def analyze_pair(
    pair: NamedPair,
    out: Path,
    mapper_path: Path | None = None,
    ks: Sequence[int | str] = (),
    stats_path: Path | None = None,
    ridge_lambda: float = 0.01,
    windows: int = 4,
    seq_len: int = 512,
    retention=None,
    progress: Progress | bool = False,
) -> dict:
    """`run_analysis` of a saved mapper and/or mappers solved for each k in `ks` from the pair's calibration
    statistics (`stats_path`, or the pair's cached default statistics, collected if absent), on `windows`
    held-out windows of `seq_len` tokens; writes analysis.json and the figures into `out`. progress: bars over a
    calibration pass and the held-out windows."""
    mappers = {} if mapper_path is None else {mapper_path.name: load_pair_mapper(mapper_path, pair)}
    if stats_path is not None:
        calibration = CalibrationStats.load(stats_path)
    else:
        calibration, _ = obtain_statistics(pair, FitConfig(ridge_lambda=ridge_lambda), CalibrationSpec(), progress)
    calibration_r2 = layer_r2_matrix(calibration, ridge_lambda)
    if ks:
        mappers.update(fit_for_ks(calibration, ks, ridge_lambda, *pair.fingerprints(), pair.max_positions(),
                                  calibration_r2))
    del calibration  # GBs of float64 sums: free them before the held-out pass
    batches = heldout_batches(pair.tokenizer, windows, seq_len)
    return run_analysis(pair.source, pair.target, batches, mappers=mappers, calibration_r2=calibration_r2,
                        ridge_lambda=ridge_lambda, out_dir=out, retention=retention, source_name=pair.source_spec,
                        target_name=pair.target_spec, progress=progress)


# -- retention and the summary --------------------------------------------------------------------------------
def load_retention(spec) -> dict[str, float]:
    """Retention by mapper key from: a mapping / list of (mapper name, retention) pairs, or a path — a JSON
    {name: retention} file, an evaluation result JSON, or a folder of them. Evaluation results are keyed by
    their mapper's manifest hash and by "k=<top_k>" (summary.all.mean_retention)."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return {str(k): float(v) for k, v in spec.items()}
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"no retention JSON found at {path}")
        found: dict[str, float] = {}
        for file in files:
            try:
                data = json.loads(file.read_text())
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and "summary" in data and "mapper" in data:
                value = ((data.get("summary") or {}).get("all") or {}).get("mean_retention")
                if value is None:
                    continue
                mapper = data["mapper"] or {}
                if mapper.get("manifest_sha"):
                    found[mapper["manifest_sha"]] = float(value)
                if mapper.get("top_k") is not None:
                    found.setdefault(f"k={mapper['top_k']}", float(value))
            elif isinstance(data, dict) and all(isinstance(v, (int, float)) for v in data.values()):
                found.update({str(k): float(v) for k, v in data.items()})
        return found
    return {str(name): float(value) for name, value in spec}


def summary_rows(results: Sequence[dict], retention=None) -> list[dict]:
    """One row per (pair, mapper) over one or more analysis results, with retention where known."""
    known = load_retention(retention)
    rows = []
    for result in results:
        pair = f"{result['source']['name']} → {result['target']['name']}"
        for name, metrics in result["mappers"].items():
            value = None
            for key in (f"{pair}|{name}", name, metrics.get("manifest_sha"), f"k={metrics['top_k']}"):
                if key is not None and key in known:
                    value = known[key]
                    break
            rows.append({"pair": pair, "mapper": name, "top_k": metrics["top_k"],
                         **{m: metrics[m] for m in METRICS}, "retention": value})
    return rows


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation; None for fewer than 3 points or a constant series."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def correlations(rows: Sequence[dict]) -> dict:
    """Pearson r of each metric with retention over the rows that have one."""
    scored = [r for r in rows if r.get("retention") is not None]
    return {
        "rows": len(scored),
        **{m: pearson([r[m] for r in scored], [r["retention"] for r in scored]) for m in METRICS},
    }


def summary_table(rows: Sequence[dict], corr: dict | None = None):
    """Rich table of summary rows (the pair goes into the title when there is only one)."""
    from rich.table import Table  # rich is only needed to print, not to compute

    pairs = sorted({row["pair"] for row in rows})
    single = len(pairs) == 1
    table = Table(title=f"mapper analysis, held-out: {pairs[0]}" if single else "mapper analysis, held-out",
                  caption="conc: error concentration (1 = isotropic, > 1 = where attention reads)")
    columns = ([] if single else ["pair"]) + ["mapper", "k", "R² K", "R² V", "attn cos", "conc K", "conc V",
                                             "retention"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("pair", "mapper") else "right")
    for row in rows:
        cells = [] if single else [row["pair"]]
        table.add_row(*cells, row["mapper"], str(row["top_k"]), f"{row['r2_k']:.4f}", f"{row['r2_v']:.4f}",
                      f"{row['attention_cosine']:.4f}", f"{row['concentration_k']:.2f}",
                      f"{row['concentration_v']:.2f}", "-" if row["retention"] is None else f"{row['retention']:.3f}")
    if corr and corr.get("rows"):
        def fmt(value):
            return "-" if value is None else f"{value:+.2f}"

        cells = [] if single else [""]
        table.add_row(*cells, f"Pearson r vs retention (n={corr['rows']})", "", fmt(corr["r2_k"]), fmt(corr["r2_v"]),
                      fmt(corr["attention_cosine"]), fmt(corr["concentration_k"]), fmt(corr["concentration_v"]), "",
                      style="bold")
    return table


# -- figures --------------------------------------------------------------------------------------------------
def render_analysis(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write analysis.json, heatmaps.png, r2_vs_k.png, selection.png and attention.png into out_dir."""
    import matplotlib  # heavy, and only needed for the figures

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "analysis.json"}
    atomic_write_json(paths["json"], result)
    paths["heatmaps"] = _plot_heatmaps(result, out / "heatmaps.png")
    if result["mappers"]:
        paths["r2_vs_k"] = _plot_r2_vs_k(result, out / "r2_vs_k.png")
        paths["selection"] = _plot_selection(result, out / "selection.png")
        paths["attention"] = _plot_attention(result, out / "attention.png")
    return paths


def _title(result: dict) -> str:
    return f"{result['source']['name']} → {result['target']['name']}"


def _plot_heatmaps(result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    panels = []
    if result.get("calibration_r2") is not None:
        panels += [("content K (calibration)", result["calibration_r2"][0]),
                   ("content V (calibration)", result["calibration_r2"][1])]
    panels += [("content K (held-out)", result["heldout_key_r2"]["content"]),
               ("post-RoPE K (held-out)", result["heldout_key_r2"]["post_rope"])]
    low = min(0.0, min(min(min(row) for row in matrix) for _, matrix in panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    image = None
    for axis, (label, matrix) in zip(axes[0], panels, strict=True):
        image = axis.imshow(matrix, origin="lower", aspect="auto", vmin=low, vmax=1.0, cmap="viridis")
        axis.set_title(f"R² {label}", fontsize=9)
        axis.set_xlabel("source layer")
    axes[0][0].set_ylabel("target layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.85, label="R² of a single-source-layer ridge probe")
    fig.suptitle(f"{_title(result)}: which source layer predicts which target layer", fontsize=10)
    return save_figure(fig, path, dpi=110, bbox_inches="tight")


def _ordered_mappers(result: dict) -> list[tuple[str, dict]]:
    return sorted(result["mappers"].items(), key=lambda item: (item[1]["top_k"], item[0]))


def _plot_r2_vs_k(result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    items = _ordered_mappers(result)
    ks = [m["top_k"] for _, m in items]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    left.plot(ks, [m["r2_k"] for _, m in items], "o-", label="K held-out")
    left.plot(ks, [m["r2_v"] for _, m in items], "s-", label="V held-out")
    if all(m["fit_r2_k"] is not None for _, m in items):
        left.plot(ks, [m["fit_r2_k"] for _, m in items], "o:", color="C0", alpha=0.6, label="K calibration (fit)")
        left.plot(ks, [m["fit_r2_v"] for _, m in items], "s:", color="C1", alpha=0.6, label="V calibration (fit)")
    left.set_ylabel("R² (mean over target layers and heads)")
    middle.plot(ks, [m["attention_cosine"] for _, m in items], "o-", label="mean over layers and heads")
    middle.plot(ks, [m["attention_cosine_min_head"] for _, m in items], "v--", label="worst head")
    middle.set_ylabel("attention-output cosine (mapped vs own K/V)")
    right.plot(ks, [m["concentration_k"] for _, m in items], "o-", label="K (query-weighted)")
    right.plot(ks, [m["concentration_v"] for _, m in items], "s-", label="V (attention²-weighted)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_ylabel("error concentration (1 = isotropic)")
    for axis in (left, middle, right):
        axis.set_xlabel("k (source layers per target layer)")
        axis.set_xscale("log", base=2)
        axis.set_xticks(ks, [str(k) for k in ks])
        axis.minorticks_off()
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"{_title(result)}: held-out quality vs k", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _plot_selection(result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    items = _ordered_mappers(result)[:8]
    background = result.get("calibration_r2")
    if background is not None:
        background = torch.tensor(background).mean(0)
        label = "mean R² (K, V), calibration"
    else:
        background = torch.tensor(result["heldout_key_r2"]["content"])
        label = "R² content K, held-out"
    fig, axes = plt.subplots(1, len(items), figsize=(3.6 * len(items), 3.8), squeeze=False)
    for axis, (name, metrics) in zip(axes[0], items, strict=True):
        axis.imshow(background.numpy(), origin="lower", aspect="auto", cmap="Greys",
                    vmin=min(0.0, float(background.min())), vmax=1.0)
        rows, cols = [], []
        for target_layer, chosen in enumerate(metrics["selected_layers"]):
            rows += [target_layer] * len(chosen)
            cols += chosen
        axis.scatter(cols, rows, s=10, c="crimson", marker="s")
        axis.set_title(f"{name}: selected source layers", fontsize=9)
        axis.set_xlabel("source layer")
    axes[0][0].set_ylabel("target layer")
    fig.suptitle(f"{_title(result)}: layer selection (background: {label})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _plot_attention(result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    items = _ordered_mappers(result)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    for name, metrics in items:
        layers = range(len(metrics["attention_cosine_per_layer"]))
        left.plot(layers, metrics["attention_cosine_per_layer"], ".-", label=name)
        middle.plot(layers, metrics["concentration_k_per_layer"], ".-", label=name)
        right.plot(layers, metrics["concentration_v_per_layer"], ".-", label=name)
    left.set_ylabel("attention-output cosine")
    middle.set_ylabel("K error concentration")
    right.set_ylabel("V error concentration")
    for axis in (middle, right):
        axis.axhline(1.0, color="grey", linewidth=0.8)
    for axis in (left, middle, right):
        axis.set_xlabel("target layer")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    fig.suptitle(f"{_title(result)}: per-layer attention fidelity and error concentration (held-out)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
