"""Does exam-layout calibration text fix the few-shot failure? Collects 40 windows of multiple-choice exam text
(the "exams" calibration group: CSQA / SciQ / MedMCQA questions with answers, none of them evaluated), merges
them with the default 40 prose windows, and scores the mappers on MMLU *validation* items (5-shot, one per
subject; never reported) and on the prose dev KL. Usage (forward, then reverse reusing the exam statistics):
.venv/bin/python scripts/exam_mix_dev.py qwen2.5-coder:0.5b qwen2.5-coder:1.5b runs/exam_fwd 40
.venv/bin/python scripts/exam_mix_dev.py qwen2.5-coder:1.5b qwen2.5-coder:0.5b runs/exam_rev 40 \
    runs/exam_fwd/stats_exam40.safetensors
"""

import copy
import json
import sys
import time
from pathlib import Path

import torch

from kvhandoff.assets import load_model
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.corpus import calibration_batches, heldout_documents
from kvhandoff.evaluation.scoring import feed
from kvhandoff.evaluation.tasks import MMLU_LETTERS, mmlu_dev_examples
from kvhandoff.fit import collect_statistics, mapper_from_statistics
from kvhandoff.geometry import model_fingerprint
from kvhandoff.handoff import handoff_cache, prefill
from kvhandoff.statistics import CalibrationStats
from kvhandoff.tuning import HandoffDivergence
from kvhandoff.workflow import obtain_mapper, obtain_statistics

torch.set_num_threads(2)
src, tgt, outdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
outdir.mkdir(parents=True, exist_ok=True)
s, tok = load_model(src)
t, _ = load_model(tgt)
fps = (model_fingerprint(s, tok), model_fingerprint(t, tok))
mpe = (s.config.max_position_embeddings, t.config.max_position_embeddings)


previous_default = CalibrationSpec(num_sequences=40, mix=("prose",))  # 40 prose windows
prose, _ = obtain_statistics(src, tgt, s, t, tok, FitConfig(), previous_default)
exam_path = outdir / "stats_exam40.safetensors"
if len(sys.argv) > 5:  # the forward pass's exam statistics, reversed
    exam = CalibrationStats.load(sys.argv[5]).reversed()
elif exam_path.exists():
    exam = CalibrationStats.load(exam_path)
else:
    t0 = time.time()
    corpus = calibration_batches(tok, 40, 512, seed=0, batch_size=1, sources=("mc-exams",))
    exam = collect_statistics(s, t, corpus, FitConfig())
    exam.save(exam_path)
    print("exam stats", time.time() - t0, flush=True)
mappers = {"prose40 (default)": obtain_mapper(src, tgt, s, t, tok, calibration=previous_default)[0]}
for name, st in (("exam40", exam), ("prose40+exam40", prose.merge(exam))):
    mappers[name] = mapper_from_statistics(st, FitConfig(), *fps, max_position_embeddings=mpe)

# MMLU validation items: the first validation item of each subject, 5-shot as in the task (the tune dev set)
letters = [tok.encode(" " + L, add_special_tokens=False)[0] for L in MMLU_LETTERS]
items = [
    (prompt, letters.index(answer[0]))
    for prompt, answer in mmlu_dev_examples(tok, int(sys.argv[4]) if len(sys.argv) > 4 else 40)
]
print("items", len(items), "mean tokens", sum(len(i) for i, _ in items) / len(items), flush=True)

with torch.inference_mode():
    refs = []
    for ids, gold in items:
        own_cache, _ = prefill(t, torch.tensor([ids[:-1]]))
        own = feed(t, own_cache, [ids[-1]])[-1]
        scache, _ = prefill(s, torch.tensor([ids[:-1]]))
        src_own = feed(s, copy.deepcopy(scache), [ids[-1]])[-1]
        refs.append((ids, gold, own, src_own, scache))


def summarize(name, preds):
    acc = sum(int(p[letters].argmax()) == g for p, (_, g, *_r) in zip(preds, refs, strict=False)) / len(refs)
    mass = sum(float(p[letters].exp().sum()) for p in preds) / len(refs)
    kl = sum(float((own.exp() * (own - p)).sum()) for p, (_, _, own, *_r) in zip(preds, refs, strict=False)) / len(refs)
    agree = sum(
        int(p[letters].argmax()) == int(own[letters].argmax()) for p, (_, _, own, *_r) in zip(preds, refs, strict=False)
    ) / len(refs)
    return {
        "name": name,
        "mmlu_val_acc": acc,
        "letter_mass": mass,
        "next_token_kl": kl,
        "letter_agreement_with_target": agree,
    }


rows = [summarize("target alone", [r[2] for r in refs]), summarize("source alone", [r[3] for r in refs])]
print(rows, flush=True)
docs = heldout_documents(tok, 4, min_tokens=640, source="lambada-heldout")
div = HandoffDivergence(s, t, docs, 512, 128)
for name, mapper in mappers.items():
    preds = []
    with torch.inference_mode():
        for ids, _gold, _own, _src_own, scache in refs:
            cache = handoff_cache(s, t, mapper, torch.tensor([ids[:-1]]), 4, source_cache=copy.deepcopy(scache))
            preds.append(feed(t, cache, [ids[-1]])[-1])
    row = summarize(name, preds)
    row["prose_dev"] = div.score(mapper, 4)
    rows.append(row)
    print(row, flush=True)
    (outdir / "exam_exp.json").write_text(json.dumps(rows, indent=1))
