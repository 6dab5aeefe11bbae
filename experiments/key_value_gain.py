"""Dev KL of a ridge mapper with its K (and V) outputs' deviations from the target mean scaled by a gain
(undoing ridge shrinkage). The mapper is the 40-window prose-only one (`--mix prose --sequences 40`), on which
the documented numbers were measured. Usage:
.venv/bin/python experiments/key_value_gain.py qwen2.5-coder:0.5b qwen2.5-coder:1.5b 512 runs/gain.json \
    1:1,1.15:1,1.3:1,1.5:1,1:1.15,1.3:1.15 2
"""

import argparse
import json
import time
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.fit.corpus import heldout_documents
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.model.loading import load_model
from kvhandoff.workflow import obtain_mapper, obtain_statistics
from kvhandoff_lab.tuning import HandoffDivergence

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("source", help="source model, e.g. qwen2.5-coder:0.5b")
parser.add_argument("target", help="target model, e.g. qwen2.5-coder:1.5b")
parser.add_argument("prefix_len", type=int, help="dev prefix tokens in the cache (512)")
parser.add_argument("out", help="JSON file written after every gain")
parser.add_argument("gains", help="comma-separated K:V gain pairs, e.g. 1:1,1.15:1")
parser.add_argument("threads", type=int, nargs="?", default=2, help="torch threads")
args = parser.parse_args()

src, tgt = args.source, args.target
prefix_len = args.prefix_len
out = args.out
alphas = [tuple(map(float, a.split(":"))) for a in args.gains.split(",")]
torch.set_num_threads(args.threads)
s, tok = load_model(src)
t, _ = load_model(tgt)
prose40 = CalibrationSpec(num_sequences=40, mix=("prose",))  # the documented numbers' mapper
mapper, _, _ = obtain_mapper(src, tgt, s, t, tok, calibration=prose40)
stats, _ = obtain_statistics(src, tgt, s, t, tok, FitConfig(), prose40)
mean_y = torch.stack(
    [
        stats.mean_y(stats.target.layer_indices(m, list(range(stats.target.num_layers))))
        .float()
        .view(stats.target.num_layers, -1)
        for m in (0, 1)
    ]
)
docs = heldout_documents(tok, 4, min_tokens=prefix_len + 128, source="lambada-heldout")
div = HandoffDivergence(s, t, docs, prefix_len, 128)
rows = [{"alpha": "source", **div.source_reference()}]
print(rows[-1], flush=True)
for ak, av in alphas:
    w = mapper.weight.clone()
    b = mapper.bias.clone()
    for m, a in ((0, ak), (1, av)):
        w[m] *= a
        b[m] = a * b[m] + (1 - a) * mean_y[m]
    m2 = DenseMapper(w, b, mapper.selected, mapper.manifest)
    t0 = time.time()
    r = div.score(m2, 4)
    rows.append({"alpha_k": ak, "alpha_v": av, "prefix_len": prefix_len, **r, "seconds": time.time() - t0})
    print(rows[-1], flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))
