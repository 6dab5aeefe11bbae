"""What a switch's recompute costs by the number of rows the target reads, with the small-batch kernels as
`load_model` sets them (oneDNN for 4–256 rows, torch's `linear` above) and with oneDNN for every row count; and the
target's re-prefill of the same context both ways.

    python experiments/recompute_rows_cost.py OUT_JSON [MODEL] [CACHED] [THREADS]

MODEL (default qwen2.5-coder:1.5b) holds a cache of CACHED (default 2048) random tokens; each measurement recomputes
n random positions of it and reads a 16-token turn in one forward (`recompute_and_read`), n from 0 to 408 (the
rows read are n + 16); median of three, each on a fresh copy of the cache, the two kernel settings interleaved.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvhandoff.model import kernels
from kvhandoff.model.cache import cache_copy, prefill
from kvhandoff.model.loading import load_model
from kvhandoff.runtime.recompute import recompute_and_read

COUNTS = (0, 128, 204, 240, 256, 306, 408)
SETTINGS = {"small-batch kernels (4–256 rows)": kernels.SMALL_BATCH_ROWS, "oneDNN for every row count": (4, 1 << 30)}


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main(out: str, model_spec: str = "qwen2.5-coder:1.5b", cached: str = "2048", threads: str = "2") -> None:
    torch.set_num_threads(int(threads))
    model, _ = load_model(model_spec)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, int(cached)), generator=generator)
    turn = torch.randint(100, 20000, (1, 16), generator=generator)
    with torch.inference_mode():
        cache, _ = prefill(model, ids)
    rows: dict[str, dict[str, float]] = {name: {} for name in SETTINGS}
    try:
        for count in COUNTS:
            positions = (torch.randperm(ids.shape[1] - 4, generator=generator)[:count].sort().values + 4)[None]
            samples: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for _ in range(3):
                for name, bounds in SETTINGS.items():
                    kernels.SMALL_BATCH_ROWS = bounds
                    fresh = cache_copy(cache)
                    samples[name].append(timed(lambda c=fresh, p=positions: recompute_and_read(model, c, ids, p, turn)))
            for name in SETTINGS:
                rows[name][str(count)] = float(np.median(samples[name]))
            print(f"{count} recomputed: " + ", ".join(f"{name} {rows[name][str(count)]:.2f} s" for name in SETTINGS),
                  flush=True)
        everything = torch.cat([ids, turn], dim=1)
        reprefill = {}
        for name, bounds in SETTINGS.items():
            kernels.SMALL_BATCH_ROWS = bounds
            with torch.inference_mode():
                reprefill[name] = timed(lambda: prefill(model, everything))
        print("re-prefill: " + ", ".join(f"{name} {s:.2f} s" for name, s in reprefill.items()))
    finally:
        kernels.SMALL_BATCH_ROWS = SETTINGS["small-batch kernels (4–256 rows)"]
    Path(out).write_text(json.dumps({"model": model_spec, "cached_tokens": int(cached), "turn_tokens": 16,
                                     "threads": int(threads), "recompute_and_read_seconds": rows,
                                     "reprefill_seconds": reprefill}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
