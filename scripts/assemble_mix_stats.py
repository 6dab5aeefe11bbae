"""Store the default 40-window prose pass + the 40-window exam pass of scripts/exam_mix_dev.py as the cached
statistics of CalibrationSpec(num_sequences=80, mix=("prose", "exams")), so `kvhandoff fit --sequences 80 --mix
prose,exams` reuses them instead of running both models over the 80 windows again. The mix packs each group on its
own (first the 40 prose windows of the default pass, then the exam windows), which this checks token for token."""

import json

import torch
from transformers import AutoTokenizer

from kvhandoff.assets import model_dir
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.corpus import calibration_batches
from kvhandoff.statistics import CalibrationStats
from kvhandoff.workflow import statistics_path

EXAM_PASS_SECONDS = 439.5  # the exam pass's collection time, from its log
src, tgt = "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"
tok = AutoTokenizer.from_pretrained(model_dir(src))
spec = CalibrationSpec(num_sequences=80, mix=("prose", "exams"))
corpus = calibration_batches(tok, 80, 512, seed=0, batch_size=1, mix=spec.mix)
prose = calibration_batches(tok, 40, 512, seed=0, batch_size=1)
exam = calibration_batches(tok, 40, 512, seed=0, batch_size=1, sources=("mc-exams",))
assert torch.equal(corpus.input_ids, torch.cat([prose.input_ids, exam.input_ids])), "windows differ"
prose_stats_path = statistics_path(src, tgt, FitConfig(), CalibrationSpec(num_sequences=40, mix=("prose",)))
exam_stats = CalibrationStats.load("runs/exam_fwd/stats_exam40.safetensors")
merged = CalibrationStats.load(prose_stats_path).merge(exam_stats)
prose_info = json.loads(prose_stats_path.with_suffix(".json").read_text())
info = {
    **corpus.describe(),
    "source_model": src,
    "target_model": tgt,
    "collect_seconds": round(prose_info["collect_seconds"] + EXAM_PASS_SECONDS, 1),
    "assembled_from": "the default 40-window prose pass + a 40-window exam pass (scripts/exam_mix_dev.py)",
}
out = statistics_path(src, tgt, FitConfig(), spec)
assert not out.exists(), f"{out} exists already"
merged.save(out)
out.with_suffix(".json").write_text(json.dumps(info, indent=2))
print(out, merged.count, info["collect_seconds"])
