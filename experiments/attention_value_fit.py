"""Fit the value maps to what attention reads: the target's attention outputs instead of its values.

For a target layer and KV head, the query heads h of its group read o_i = Σ_j A_hij v_j. With the exact prefix
(the first P positions recomputed by the target) the mapped values enter as Σ_{j≥P} A_hij (W x_j + b) =
(A'x)_i W + m_i b, with A' the attention over the mapped positions and m_i its mass. So the map that minimises
the attention-output error (for the target's own attention) is a ridge regression of A'y on [A'x, m]: closed
form, one Gram per (target layer, KV head). The keys keep the default ridge maps. Uniform A' (each query attends
only to itself) gives back the plain ridge objective. Features are centred by the calibration means first, so
the penalty shrinks towards the mean map as the default's does.

The start is the ridge mapper calibrated on 80 windows of prose + exams (`--mix prose,exams --sequences 80`), and
the pooled rows come from its windows, half prose and half exams. 0.5B → 1.5B only: the reverse direction's
7,168-wide Grams do not fit in 24 GiB per head.

Usage: .venv/bin/python experiments/attention_value_fit.py OUT_DIR [WINDOWS] [THREADS]
Writes OUT_DIR/attention_value_fit.json (reported in docs/results/attention_value_fit_forward.json) and caches the
pooled Grams in OUT_DIR/pooled_WINDOWS.pt.
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.fit.corpus import calibration_batches, heldout_documents
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.model.capture import capture_content_kv
from kvhandoff.model.geometry import decoder_layers
from kvhandoff.model.loading import load_model
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.workflow import obtain_mapper, obtain_statistics
from kvhandoff_lab.analyze import causal_attention
from kvhandoff_lab.evaluation.tasks import gsm8k_dev_examples, mmlu_dev_examples
from kvhandoff_lab.tuning import HandoffDivergence

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out_dir", type=Path, help="folder for the JSON result and the pooled Grams")
parser.add_argument("windows", type=int, nargs="?", default=24, help="windows pooled (half prose, half exams)")
parser.add_argument("threads", type=int, nargs="?", default=1, help="torch threads")
args = parser.parse_args()

torch.set_num_threads(args.threads)
SRC, TGT = "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"
outdir = args.out_dir
outdir.mkdir(parents=True, exist_ok=True)
windows = args.windows
PREFIX, STRIDE = 4, 4  # the default exact prefix; query rows kept (as the default's token stride)

s, tok = load_model(SRC)
t, _ = load_model(TGT)
spec = CalibrationSpec(num_sequences=80, mix=("prose", "exams"))  # prose + exams, 80 windows
stats, _ = obtain_statistics(SRC, TGT, s, t, tok, FitConfig(), spec)
default, _, _ = obtain_mapper(SRC, TGT, s, t, tok, calibration=spec)
src_layout, tgt_layout = default.source, default.target
v_in = stats.source.layer_indices(1, range(src_layout.num_layers))  # source V columns of the statistics
mean_x = stats.mean_x(v_in).float()
Lt, Ht, Dt = tgt_layout.num_layers, tgt_layout.num_kv_heads, tgt_layout.head_dim
mean_y = stats.mean_y(stats.target.layer_indices(1, range(Lt))).float().view(Lt, Ht, Dt)
features = v_in.numel()
del stats  # 2.65 GB; only the means are needed from here

stats_path = outdir / f"pooled_{windows}.pt"
if stats_path.exists():
    saved = torch.load(stats_path)
    gram, cross, rows_seen, seconds = saved["gram"], saved["cross"], saved["rows"], saved["seconds"]
else:
    corpus = calibration_batches(tok, spec.num_sequences, spec.seq_len, seed=0, batch_size=1, mix=spec.mix)
    per_group = spec.num_sequences // len(spec.mix)
    chosen = [*range(windows // 2), *range(per_group, per_group + windows - windows // 2)]
    gram = torch.zeros(Lt, Ht, features + 1, features + 1, dtype=torch.float64)
    cross = torch.zeros(Lt, Ht, features + 1, Dt, dtype=torch.float64)
    rows_seen = 0
    t0 = time.time()
    inv_freq, rope_scaling = rope_frequencies(t.config, seq_len=spec.seq_len)
    modules = decoder_layers(t)
    for n, w in enumerate(chosen):
        ids = corpus.input_ids[w : w + 1]
        source = capture_content_kv(s, ids)
        target = capture_content_kv(t, ids, with_queries=True)
        tokens = ids.shape[1]
        x = source.values[:, 0].permute(2, 0, 1, 3).reshape(tokens, -1).float() - mean_x  # [T, Ls·Hs·Ds]
        positions = torch.arange(tokens)
        query_rows = torch.arange(PREFIX, tokens, STRIDE)
        for layer in range(Lt):
            scaling = float(getattr(modules[layer].self_attn, "scaling", Dt**-0.5))
            q = apply_rope(target.queries[layer].float(), positions, inv_freq, rope_scaling)
            k = apply_rope(target.keys[layer].float(), positions, inv_freq, rope_scaling)
            _, probs = causal_attention(q, k, target.values[layer].float(), scaling)  # [1, Hq, T, T]
            group = probs.shape[1] // Ht
            for head in range(Ht):
                a = probs[0, head * group : (head + 1) * group][:, query_rows, PREFIX:].reshape(-1, tokens - PREFIX)
                y = target.values[layer, 0, head, PREFIX:].float() - mean_y[layer, head]
                z = torch.cat([a @ x[PREFIX:], a.sum(-1, keepdim=True)], dim=1)  # [rows, F + 1]
                gram[layer, head] += (z.T @ z).double()
                cross[layer, head] += (z.T @ (a @ y)).double()
        rows_seen += group * query_rows.numel()
        print(f"window {n + 1}/{len(chosen)} {time.time() - t0:.0f} s", flush=True)
    seconds = round(time.time() - t0, 1)
    torch.save({"gram": gram, "cross": cross, "rows": rows_seen, "seconds": seconds}, stats_path)


def attention_value_mapper(ridge_lambda: float) -> DenseMapper:
    """The default mapper with every value map replaced by the attention-output fit."""
    weight, bias = default.weight.clone(), default.bias.clone()
    for layer in range(Lt):
        for head in range(Ht):
            g = gram[layer, head] / rows_seen
            shift = ridge_lambda * g.diagonal()[:features].mean()
            penalty = torch.full((features + 1,), float(shift), dtype=torch.float64)
            penalty[-1] = 0  # the bias is not shrunk
            solution = torch.linalg.solve(g + torch.diag(penalty), cross[layer, head] / rows_seen)
            w, b = solution[:features].float(), solution[features].float()
            cols = slice(head * Dt, (head + 1) * Dt)
            weight[1, layer, :, cols] = w
            bias[1, layer, cols] = b + mean_y[layer, head] - mean_x @ w
    manifest = copy.deepcopy(default.manifest)
    manifest["config"]["value_objective"] = {"kind": "attention-output", "lambda": ridge_lambda,
                                             "windows": windows}
    return DenseMapper(weight, bias, default.selected, manifest)


prose = HandoffDivergence(s, t, heldout_documents(tok, 4, min_tokens=640, source="lambada-heldout"), 512, 128)
mmlu = HandoffDivergence.from_examples(s, t, mmlu_dev_examples(tok, 40))
gsm8k = HandoffDivergence.from_examples(s, t, gsm8k_dev_examples(tok, 8))
results = {"windows": windows, "pooled_rows": rows_seen, "collect_seconds": seconds, "rows": []}
candidates = {"default (ridge on values)": default}
for lam in (0.01, 0.1):
    candidates[f"attention-output values, λ {lam}"] = attention_value_mapper(lam)
for name, mapper in candidates.items():
    row = {"mapper": name, **{dev: div.score(mapper, PREFIX) for dev, div in
                              (("prose", prose), ("mmlu", mmlu), ("gsm8k", gsm8k))}}
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    (outdir / "attention_value_fit.json").write_text(json.dumps(results, indent=1))
