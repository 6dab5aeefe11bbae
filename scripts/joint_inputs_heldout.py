"""Held-out check of one issue-#6 lever without building a mapper: should each K (V) map read the source's
K *and* V? Ridge maps are solved on the calibration statistics minus the held-out windows and scored on the
held-out rows (error relative to each output block's held-out variance, averaged over target layers).

Needs a pass collected with rows, e.g. `kvhandoff tune --sequences 80 --stride 1 --features`.
Usage: .venv/bin/python scripts/joint_inputs_heldout.py [--sequences 80] [--stride 1]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvhandoff.assets import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.heldout import split_heldout
from kvhandoff.solve import ridge_from_covariance
from kvhandoff.statistics import CalibrationStats
from kvhandoff.workflow import features_dir, statistics_path


def heldout_loss(train: CalibrationStats, x: torch.Tensor, y: torch.Tensor, joint: bool, ridge_lambda: float):
    src, tgt = train.source, train.target
    losses = []
    for modality in range(2):
        idx_y = torch.arange(modality * tgt.modality_width, (modality + 1) * tgt.modality_width)
        idx_x = (torch.arange(src.width) if joint
                 else torch.arange(modality * src.modality_width, (modality + 1) * src.modality_width))
        weight = ridge_from_covariance(train.cov_xx(idx_x), train.cov_xy(idx_x, idx_y), ridge_lambda)
        bias = train.mean_y(idx_y) - weight.T @ train.mean_x(idx_x)
        error = (x[:, idx_x].double() @ weight + bias - y[:, idx_y].double()).pow(2).mean(0)
        variance = y[:, idx_y].double().var(0)
        losses.append(float((error.view(tgt.num_layers, -1).sum(-1) / variance.view(tgt.num_layers, -1).sum(-1))
                            .mean()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=80)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--lambdas", default="0.01,0.1")
    args = parser.parse_args()
    config = FitConfig(token_stride=args.stride)
    calibration = CalibrationSpec(num_sequences=args.sequences, mix=("prose",))  # the documented prose-only pass
    stats = CalibrationStats.load(statistics_path(DEFAULT_SOURCE, DEFAULT_TARGET, config, calibration))
    train, x, y, windows = split_heldout(stats, features_dir(DEFAULT_SOURCE, DEFAULT_TARGET, config, calibration))
    rows = []
    for direction, (part, inputs, outputs) in {"0.5B → 1.5B": (train, x, y),
                                               "1.5B → 0.5B": (train.reversed(), y, x)}.items():
        for ridge_lambda in (float(v) for v in args.lambdas.split(",")):
            for joint in (False, True):
                k_loss, v_loss = heldout_loss(part, inputs, outputs, joint, ridge_lambda)
                rows.append({"direction": direction, "lambda": ridge_lambda, "inputs": "K+V" if joint else "same",
                             "heldout_loss_K": round(k_loss, 4), "heldout_loss_V": round(v_loss, 4)})
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"heldout_windows": windows, "heldout_rows": int(x.shape[0]), "rows": rows}))


if __name__ == "__main__":
    main()
