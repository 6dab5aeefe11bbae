"""Compact mappers against the full ridge map, all solved from the pair's cached calibration statistics: size,
FLOPs per token, transfer time at 1,024 tokens and quality on held-out text.

Every variant is a `FitConfig` (written `key=value;key=value`, "default" for `FitConfig()`), solved from the
statistics of the default calibration (`workflow.obtain_statistics`: collected only if missing), saved once to
read its size on disk. Then, side by side in one process: `Mapper.transfer` of a 1,024-token source cache, each
variant in turn per round (median over rounds); and quality on `--docs` held-out LAMBADA documents (never
calibration): dev R² of the mapped K and V against the target's own on every prefix token after the exact
prefix, and the teacher-forced dev KL / top-1 agreement / perplexity ratio of `tuning.HandoffDivergence` (512-token
prefix in cache, 128 scored tokens, exact prefix 4).

Usage: .venv/bin/python experiments/compact_mappers.py OUT.json VARIANT [VARIANT ...]
       [--source qwen2.5-coder:0.5b --target qwen2.5-coder:1.5b --docs 8 --rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.fit.pipeline import feature_layout, mapper_from_statistics
from kvhandoff.fit.selection import layer_r2_matrix
from kvhandoff.model.cache import prefill
from kvhandoff.model.capture import capture_content_kv
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET
from kvhandoff.workflow import load_named_pair, obtain_statistics
from kvhandoff_lab.tuning import HandoffDivergence

EXACT_PREFIX = 4


def parse_variant(text: str) -> FitConfig:
    """"default" or "rank=128;storage_dtype=float16" → FitConfig (values typed by the field's default)."""
    if text == "default":
        return FitConfig()
    values = {}
    for item in text.split(";"):
        name, _, value = item.partition("=")
        default = getattr(FitConfig(), name)
        values[name] = value if isinstance(default, str) and not value.isdigit() else type(default)(value)
        if name == "top_k" and value != "all":
            values[name] = int(value)
    return FitConfig(**values)


def dev_rows(pair, documents, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Content-space rows (calibration layout) of both models on every dev prefix, positions ≥ EXACT_PREFIX."""
    xs, ys = [], []
    stats_layout = feature_layout(pair.source), feature_layout(pair.target)
    with torch.inference_mode():
        for doc in documents:
            ids = torch.as_tensor(doc[:prefix_len])[None]
            positions = torch.arange(EXACT_PREFIX, ids.shape[1])
            xs.append(stats_layout[0].flatten(capture_content_kv(pair.source, ids), positions).float())
            ys.append(stats_layout[1].flatten(capture_content_kv(pair.target, ids), positions).float())
    return torch.cat(xs), torch.cat(ys)


def dev_r2(mapper, x: torch.Tensor, y: torch.Tensor) -> dict:
    """R² of the mapped K and V on held-out rows (1 − SSE / SS about the held-out mean, over all columns)."""
    predicted = torch.cat([mapper.map_feature_rows(x[i : i + 1024]) for i in range(0, x.shape[0], 1024)])
    half = y.shape[1] // 2
    result = {}
    for name, columns in (("K", slice(0, half)), ("V", slice(half, None))):
        target = y[:, columns].double()
        sse = (predicted[:, columns].double() - target).pow(2).sum()
        result[f"dev_r2_{name.lower()}"] = float(1 - sse / (target - target.mean(0)).pow(2).sum())
    return result


def time_transfers(mappers: dict, cache, rounds: int) -> dict[str, float]:
    """Median seconds of `transfer` per variant, the variants interleaved within each round (shared noise)."""
    times: dict[str, list[float]] = {name: [] for name in mappers}
    for mapper in mappers.values():
        mapper.transfer(cache)  # warm-up: RoPE tables, allocator
    for _ in range(rounds):
        for name, mapper in mappers.items():
            started = time.perf_counter()
            mapper.transfer(cache)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--source", default=DEFAULT_SOURCE)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transfer-tokens", type=int, default=1024)
    args = parser.parse_args()
    configs = {name: parse_variant(name) for name in args.variants}  # bad variants fail before any model loads
    torch.set_num_threads(2)
    started = time.perf_counter()
    pair = load_named_pair(args.source, args.target, progress=False)
    stats, _ = obtain_statistics(pair, FitConfig(), CalibrationSpec(), progress=True)
    r2_matrix = layer_r2_matrix(stats, FitConfig().probe_lambda)
    mappers, rows = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, config in configs.items():
            solve_started = time.perf_counter()
            mapper = mapper_from_statistics(stats, config, *pair.fingerprints(),
                                            max_position_embeddings=pair.max_positions(), r2_matrix=r2_matrix)
            solve_seconds = time.perf_counter() - solve_started
            mapper.save(Path(folder) / str(len(mappers)))
            metrics = mapper.manifest["fit_metrics"]
            rows[name] = {"variant": name, "method": mapper.manifest.method, "config": config.to_dict(),
                          **mapper.manifest.storage, "memory_bytes": mapper.nbytes(),
                          "flops_per_token": mapper.flops_per_token(), "solve_seconds": round(solve_seconds, 1),
                          "r2_k": metrics["r2_k_mean"], "r2_v": metrics["r2_v_mean"],
                          **({"compact": {k: v for k, v in metrics["compact"].items() if k != "r2_by_k"}}
                             if "compact" in metrics else {})}
            mappers[name] = mapper
            print(f"solved {name}: {rows[name]['parameters']:,} parameters in {solve_seconds:.0f} s", flush=True)
    del stats
    write(args, {"rows": list(rows.values()), "partial": "solved"}, started)
    documents = heldout_documents(pair.tokenizer, args.docs, min_tokens=640, source="lambada-heldout")
    text = torch.cat([torch.as_tensor(doc) for doc in documents])[: args.transfer_tokens]
    source_cache, _ = prefill(pair.source, text[None])
    for name, seconds in time_transfers(mappers, source_cache, args.rounds).items():
        rows[name]["transfer_seconds"] = round(seconds, 4)
    write(args, {"rows": list(rows.values()), "partial": "timed"}, started)
    x, y = dev_rows(pair, documents, 512)
    divergence = HandoffDivergence(pair.source, pair.target, documents, 512, 128)
    for name, mapper in mappers.items():
        rows[name].update(dev_r2(mapper, x, y))
        rows[name].update(divergence.score(mapper, EXACT_PREFIX))
        print(json.dumps({k: rows[name][k] for k in ("variant", "parameters", "dev_r2_k", "dev_r2_v", "mean_kl",
                                                      "top1_agreement")}), flush=True)
        write(args, {"rows": list(rows.values()), "partial": f"scored up to {name}"}, started)
    result = {"source": args.source, "target": args.target, "calibration": dataclasses.asdict(CalibrationSpec()),
              "dev": {"kind": "lambada-heldout", "documents": args.docs, "prefix_len": 512, "continuation_len": 128,
                      "exact_prefix": EXACT_PREFIX, "dev_r2_rows": int(x.shape[0])},
              "transfer_tokens": args.transfer_tokens, "timing_rounds": args.rounds, "torch_threads": 2,
              "source_reference": divergence.source_reference(), "rows": list(rows.values())}
    write(args, result, started)


def write(args, result: dict, started: float) -> None:
    """The JSON so far (rewritten after each phase, so an interrupted run leaves what it measured)."""
    result = {**result, "wall_seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
