"""Where does the handoff loss come from? Dev KL (512-token LAMBADA held-out prefixes, 4 documents, exact prefix 4)
with parts of the mapped cache replaced by the target's own K/V (all K, all V, first/last/middle layers). The
mapper is the 40-window prose-only one (`--mix prose --sequences 40`), on which the documented numbers were measured.

Usage: .venv/bin/python experiments/oracle_attribution.py qwen2.5-coder:0.5b qwen2.5-coder:1.5b runs/oracle_fwd.json
"""

import argparse
import copy
import json
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.model.cache import prefill
from kvhandoff.model.loading import load_model
from kvhandoff.runtime.handoff import handoff_cache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.workflow import obtain_mapper
from kvhandoff_lab.evaluation.scoring import feed
from kvhandoff_lab.tuning import HandoffDivergence

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("source", help="source model, e.g. qwen2.5-coder:0.5b")
parser.add_argument("target", help="target model, e.g. qwen2.5-coder:1.5b")
parser.add_argument("out", help="JSON file written after every variant")
args = parser.parse_args()
src, tgt, out = args.source, args.target, args.out
torch.set_num_threads(2)
s, tok = load_model(src)
t, _ = load_model(tgt)
# the 40-window prose-only mapper, on which the documented numbers were measured
mapper, _, _ = obtain_mapper(src, tgt, s, t, tok, calibration=CalibrationSpec(num_sequences=40, mix=("prose",)))
docs = heldout_documents(tok, 4, min_tokens=640, source="lambada-heldout")
div = HandoffDivergence(s, t, docs, 512, 128)
L = len(t.model.layers)
variants = {"mapped": ([], ""), "exact K": (range(L), "k"), "exact V": (range(L), "v")}
for m in (1, 2, 4, 8):
    variants[f"exact layers 0..{m - 1}"] = (range(m), "kv")
variants["exact last 4 layers"] = (range(L - 4, L), "kv")
third = L // 3
variants["exact middle third"] = (range(third, 2 * third), "kv")
own_caches = []
with torch.inference_mode():
    for doc in div.documents:
        own_caches.append(prefill(t, torch.tensor([doc.prefix[:-1]]))[0])
rows = [{"variant": "source alone", **div.source_reference()}]
for name, (layers, what) in variants.items():
    it = iter(own_caches)

    def predict(doc, it=it, layers=layers, what=what):
        own = next(it)
        cache = handoff_cache(
            s, t, mapper, torch.tensor([doc.prefix[:-1]]), HandoffPlan(exact_prefix=4),
            source_cache=copy.deepcopy(doc.source_cache),
        )
        for i in layers:
            if "k" in what:
                cache.layers[i].keys.copy_(own.layers[i].keys)
            if "v" in what:
                cache.layers[i].values.copy_(own.layers[i].values)
        return feed(t, cache, [doc.prefix[-1], *doc.continuation[:-1]])

    with torch.inference_mode():
        r = div._divergence(predict)
    rows.append({"variant": name, **r})
    print(name, round(r["mean_kl"], 4), round(r["top1_agreement"], 3), flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))
