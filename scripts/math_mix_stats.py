"""Collect the 40 windows of the "math" calibration group (worked MATH solutions in GSM8K's chain-of-thought
layout) for the default pair and store them, merged with the cached default statistics (40 prose + 40 exam
windows), as the cached statistics of CalibrationSpec(num_sequences=120, mix=("prose", "exams", "math")): each
group of a mix is packed on its own, so the 120-window mix is exactly the default's 80 windows then the 40 math
windows (checked token for token). Afterwards `kvhandoff fit/tune --mix prose,exams,math --sequences 120` reuse
them in both directions. Usage: .venv/bin/python scripts/math_mix_stats.py runs/s4
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from kvhandoff.assets import load_model, model_dir
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.corpus import calibration_batches
from kvhandoff.fit import collect_statistics
from kvhandoff.statistics import CalibrationStats
from kvhandoff.workflow import statistics_path

src, tgt = "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"
outdir = Path(sys.argv[1])
outdir.mkdir(parents=True, exist_ok=True)
tok = AutoTokenizer.from_pretrained(model_dir(src))
# the third session's default, which these statistics extend
default = CalibrationSpec(num_sequences=80, mix=("prose", "exams"))
mixed = CalibrationSpec(num_sequences=120, mix=("prose", "exams", "math"))
corpus = calibration_batches(tok, 120, 512, seed=0, batch_size=1, mix=mixed.mix)
base = calibration_batches(tok, default.num_sequences, 512, seed=0, batch_size=1, mix=default.mix)
math = calibration_batches(tok, 40, 512, seed=0, batch_size=1, sources=("math-solutions",))
assert torch.equal(corpus.input_ids, torch.cat([base.input_ids, math.input_ids])), "windows differ"

math_path = outdir / "stats_math40.safetensors"
if math_path.exists():
    math_stats, seconds = CalibrationStats.load(math_path), json.loads(math_path.with_suffix(".json").read_text())
else:
    s, _ = load_model(src)
    t, _ = load_model(tgt)
    t0 = time.time()
    math_stats = collect_statistics(s, t, math, FitConfig())
    seconds = round(time.time() - t0, 1)
    math_stats.save(math_path)
    math_path.with_suffix(".json").write_text(json.dumps(seconds))
    print("math pass", seconds, "s", flush=True)

base_path = statistics_path(src, tgt, FitConfig(), default)
base_info = json.loads(base_path.with_suffix(".json").read_text())
out = statistics_path(src, tgt, FitConfig(), mixed)
assert not out.exists(), f"{out} exists already"
merged = CalibrationStats.load(base_path).merge(math_stats)
merged.save(out)
info = {**corpus.describe(), "source_model": src, "target_model": tgt,
        "collect_seconds": round(base_info["collect_seconds"] + seconds, 1),
        "assembled_from": "the default 80-window pass + a 40-window math pass (scripts/math_mix_stats.py)"}
out.with_suffix(".json").write_text(json.dumps(info, indent=2))
print(out, merged.count, info["collect_seconds"])
