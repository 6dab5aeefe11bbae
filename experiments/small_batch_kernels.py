"""One forward of a few tokens over a cached context, with torch's `linear` and with the small-batch kernels
(`kvhandoff.model.kernels`), interleaved, per row count: what a switch's read costs either way.

    python experiments/small_batch_kernels.py OUT.json [MODEL] [CACHE_TOKENS] [ROWS ...]

MODEL defaults to the 1.5B of the default pair, CACHE_TOKENS to 2,048 (random K/V: the cost does not depend on
their values), ROWS to 1 5 16 64 107 256 (5 = the exact prefix and one new token; 107 = that plus the default
recompute's 5% of 2,047 positions). Two torch threads, weights resident, 1 warm-up and 5 timed rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvhandoff.model.cache import cache_of
from kvhandoff.model.kernels import use_small_batch_kernels
from kvhandoff.model.loading import load_model
from kvhandoff_lab.bench import keep_resident


def main(out: str, model_name: str = "qwen2.5-coder:1.5b", cache_tokens: str = "2048", *rows: str) -> dict:
    torch.set_num_threads(2)
    model, _ = load_model(model_name, progress=False)
    keep_resident(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    shape = (1, config.num_key_value_heads, int(cache_tokens), head_dim)
    layers = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(config.num_hidden_layers)]
    result = {"model": model_name, "cache_tokens": int(cache_tokens), "threads": 2, "rounds": 5, "rows": []}
    for count in [int(r) for r in rows] or [1, 5, 16, 64, 107, 256]:
        ids = torch.randint(0, config.vocab_size, (1, count), generator=generator)
        seconds: dict[str, list[float]] = {"linear": [], "small_batch": []}
        logits = {}
        with torch.inference_mode():
            for round_ in range(6):
                for name in seconds:
                    use_small_batch_kernels(model, enabled=name == "small_batch")
                    cache = cache_of((k.clone(), v.clone()) for k, v in layers)
                    started = time.perf_counter()
                    logits[name] = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
                    if round_:
                        seconds[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        row = {"rows": count, **{f"{name}_seconds": medians[name] for name in medians},
               "speedup": medians["linear"] / medians["small_batch"],
               "max_logit_difference": float((logits["linear"] - logits["small_batch"]).abs().max())}
        result["rows"].append(row)
        print(f"{count:>4} rows: linear {medians['linear'] * 1e3:.0f} ms, small-batch kernels "
              f"{medians['small_batch'] * 1e3:.0f} ms, {row['speedup']:.2f}×, logits within "
              f"{row['max_logit_difference']:.1e}", flush=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main(*sys.argv[1:])
