"""Training the MLP mapper (`--method mlp`, `mapper.mlp.MLPMapper`): a ridge mapper plus a small residual MLP per
target layer.

The paper rescues pairs where ridge fails with per-(layer, head, K|V) MLPs of two 1,024-unit hidden layers.
That size does not train on a 2-core CPU, so this is the same idea in a form that does: per target layer one
MLP reads the content-space K *and* V of its `input_layers` best source layers and predicts what the ridge
map leaves over; its output layer starts at zero, so training starts from the ridge mapper exactly and
per-layer early stopping on held-out windows never lets a layer end worse than the ridge on them
(settings: `config.MLPConfig`). Training needs the calibration rows themselves (`features.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvhandoff.config import MLPConfig
from kvhandoff.errors import StatisticsError
from kvhandoff.fit.features import check_layouts, load_features, read_manifest, validation_shards
from kvhandoff.fit.selection import select_layers
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.mlp import MLPMapper, ResidualMLP
from kvhandoff.model.capture import FeatureLayout, nonfinite_layers
from kvhandoff.progress import Progress, as_progress


def input_columns(layout: FeatureLayout, input_layers: torch.Tensor) -> torch.Tensor:
    """[target layers, 2·m·Fs] columns of a source feature row read by each target layer's MLP: K of its m
    source layers, then their V (the order `MLPMapper.map_rows` gathers in)."""
    return torch.stack([torch.cat([layout.layer_indices(0, layers), layout.layer_indices(1, layers)])
                        for layers in input_layers])


def output_columns(layout: FeatureLayout) -> torch.Tensor:
    """[target layers, 2·Ft] columns of a target feature row: each layer's K, then its V."""
    return torch.stack([torch.cat([layout.layer_indices(0, [t]), layout.layer_indices(1, [t])])
                        for t in range(layout.num_layers)])


@dataclass
class _Rows:
    """The calibration rows an MLP trains on: inputs x, residual targets y (what the ridge leaves over), the
    columns each target layer's MLP reads and writes, and the train/held-out split by window."""

    x: torch.Tensor
    y: torch.Tensor
    shard: torch.Tensor
    in_cols: torch.Tensor
    out_cols: torch.Tensor
    train_rows: torch.Tensor
    val_rows: torch.Tensor

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer inputs [Lt, n, in] and targets [Lt, n, out] of ``rows``."""
        return self.x[rows][:, self.in_cols].transpose(0, 1), self.y[rows][:, self.out_cols].transpose(0, 1)


@dataclass
class _Training:
    """Per-layer held-out losses of the ridge alone and of the kept epoch, the kept epoch, the epoch history."""

    ridge_loss: torch.Tensor
    best_loss: torch.Tensor
    best_epoch: torch.Tensor
    history: list[dict]


def fit_mlp_mapper(
    base: DenseMapper,
    features: str | Path,
    r2_matrix: torch.Tensor,
    config: MLPConfig = MLPConfig(),  # noqa: B008 - frozen
    reverse: bool = False,
    progress: Progress | bool = False,
) -> MLPMapper:
    """Train the residual MLPs on the calibration rows in `features` around the ridge mapper `base`.

    r2_matrix: the single-source probe R² [K|V, target layer, source layer] that ranks each target layer's
    MLP inputs (`selection.layer_r2_matrix` of the same statistics). reverse: the rows were written for the
    opposite direction (swap x and y), as reversed statistics are.
    """
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    feature_manifest = read_manifest(features)
    check_layouts(features, feature_manifest, reverse, base.source, base.target)
    input_layers = select_layers(r2_matrix, config.input_layers)  # [Lt, m]
    rows, y_var = _residual_rows(base, features, reverse, input_layers, config)
    model = _initial_mlp(base.target, rows, y_var, config)
    training = _train(model, rows, config, progress)
    record = {
        "heldout_windows": int(torch.unique(rows.shard[rows.val_rows]).numel()),
        "train_rows": int(rows.train_rows.numel()), "heldout_rows": int(rows.val_rows.numel()),
        "heldout_loss_ridge": float(training.ridge_loss.mean()),
        "heldout_loss_mlp": float(training.best_loss.mean()),
        "heldout_loss_ridge_per_layer": training.ridge_loss.tolist(),
        "heldout_loss_mlp_per_layer": training.best_loss.tolist(),
        "epoch_per_layer": training.best_epoch.tolist(), "history": training.history,
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    manifest = dataclasses.replace(
        base.manifest.with_metrics(mlp=record), method="mlp", tensor_sha256=None, mlp_config=config,
        mlp_input_layers=input_layers.tolist(),
        mlp_features={"rows": int(rows.x.shape[0]), "calibration": feature_manifest.get("calibration")},
    )
    require_finite_mlp(model)
    return MLPMapper(base.weight, base.bias, base.selected, manifest, input_layers, model)


def _residual_rows(base: DenseMapper, features, reverse: bool, input_layers: torch.Tensor,
                   config: MLPConfig) -> tuple[_Rows, torch.Tensor]:
    """The rows with y replaced by what `base` leaves over, split by window; and y's variance on the train
    rows (taken before: the loss is relative to each output's variance)."""
    x, y, shard = load_features(features)
    if reverse:
        x, y = y, x
    held_out = torch.isin(shard, validation_shards(int(shard.max()) + 1, config.validation_fraction, config.seed))
    train_rows, val_rows = (~held_out).nonzero().squeeze(1), held_out.nonzero().squeeze(1)
    y_var = y[train_rows].var(0)
    with torch.no_grad():
        for start in range(0, x.shape[0], 4096):
            y[start : start + 4096] -= base.map_feature_rows(x[start : start + 4096])
    rows = _Rows(x, y, shard, input_columns(base.source, input_layers), output_columns(base.target),
                 train_rows, val_rows)
    return rows, y_var


def _initial_mlp(tgt: FeatureLayout, rows: _Rows, y_var: torch.Tensor, config: MLPConfig) -> ResidualMLP:
    """A zero-output MLP per target layer, its inputs standardised on the train rows and its outputs scaled by
    each (layer, K|V) block's standard deviation."""
    x = rows.x[rows.train_rows]
    x_mean, x_std = x.mean(0), x.std(0).clamp_min(1e-6)
    model = ResidualMLP(tgt.num_layers, rows.in_cols.shape[1], config.hidden, rows.out_cols.shape[1],
                        seed=config.seed)
    with torch.no_grad():
        model.in_mean.copy_(x_mean[rows.in_cols].unsqueeze(1))
        model.in_scale.copy_(1 / x_std[rows.in_cols].unsqueeze(1))
        per_modality = y_var[rows.out_cols].view(tgt.num_layers, 2, -1).mean(-1).clamp_min(1e-12).sqrt()
        model.out_scale.copy_(per_modality.repeat_interleave(tgt.layer_width, dim=1).unsqueeze(1))
    return model


def _layer_losses(model: ResidualMLP, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) / model.out_scale).pow(2).mean(dim=(1, 2))  # [Lt]: (1 − R²) units


@torch.no_grad()
def _validation_loss(model: ResidualMLP, rows: _Rows) -> torch.Tensor:
    total = torch.zeros(model.w1.shape[0])
    for start in range(0, rows.val_rows.numel(), 4096):
        chunk = rows.val_rows[start : start + 4096]
        inputs, target = rows.batch(chunk)
        total += _layer_losses(model, model(inputs), target) * chunk.numel()
    return total / rows.val_rows.numel()


def _train(model: ResidualMLP, rows: _Rows, config: MLPConfig, progress: Progress | bool) -> _Training:
    """Adam epochs over the train rows; every layer keeps the epoch with its lowest held-out loss (epoch 0, the
    ridge alone, included). ``model`` ends with the kept parameters."""
    layers = model.w1.shape[0]
    ridge_loss = _validation_loss(model, rows)
    best_loss, best_epoch = ridge_loss.clone(), torch.zeros(layers, dtype=torch.long)
    best = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    history = []
    steps = math.ceil(rows.train_rows.numel() / config.batch_size)
    bar = as_progress(progress)(total=config.epochs * steps, desc="mlp", unit="step")
    for epoch in range(1, config.epochs + 1):
        order = rows.train_rows[torch.randperm(rows.train_rows.numel())]
        train_total = 0.0
        for start in range(0, order.numel(), config.batch_size):
            inputs, target = rows.batch(order[start : start + config.batch_size])
            loss = _layer_losses(model, model(inputs), target).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_total += float(loss.detach()) / layers
            bar.update()
        val = _validation_loss(model, rows)
        improved = val < best_loss
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                best[name][improved] = tensor.detach()[improved]
        best_loss, best_epoch = torch.where(improved, val, best_loss), torch.where(improved, epoch, best_epoch)
        history.append({"epoch": epoch, "train_loss": train_total / steps, "val_loss": float(val.mean())})
        bar.set_postfix(val=f"{float(val.mean()):.4f}", ridge=f"{float(ridge_loss.mean()):.4f}")
    bar.close()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.copy_(best[name])
    return _Training(ridge_loss, best_loss, best_epoch, history)


def require_finite_mlp(model: ResidualMLP) -> None:
    """StatisticsError naming the target layer(s) whose trained MLP holds NaN/Inf (never a NaN mapper)."""
    bad = sorted({layer for tensor in model.tensors().values() for layer in nonfinite_layers(tensor, dim=0)})
    if bad:
        raise StatisticsError(f"the trained MLP of target layer(s) {bad} holds NaN/Inf: check the calibration "
                              "rows for NaN/Inf or lower the learning rate")
