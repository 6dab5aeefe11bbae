"""Does `torch.compile` speed up `Mapper.transfer` on CPU? Times the eager transfer and a compiled one
(`torch.compile(mapper.transfer, dynamic=False)`), interleaved, on a random source cache of the mapper's source
geometry (the transfer's cost does not depend on the values), per context length; checks the outputs agree.

    python experiments/transfer_compile.py MAPPER_DIR OUT.json [LENGTHS=64,1024,2048] [REPEATS=5]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import cache_of


def random_cache(mapper: Mapper, tokens: int, seed: int = 0):
    src = mapper.source
    gen = torch.Generator().manual_seed(seed)
    shape = (1, src.num_kv_heads, tokens, src.head_dim)
    return cache_of((torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
                    for _ in range(src.num_layers))


def largest_difference(a, b) -> float:
    return max(max((x.keys - y.keys).abs().max().item(), (x.values - y.values).abs().max().item())
               for x, y in zip(a.layers, b.layers, strict=True))


def time_length(mapper: Mapper, compiled, tokens: int, repeats: int) -> dict:
    cache = random_cache(mapper, tokens)
    reference = mapper.transfer(cache)
    started = time.perf_counter()
    difference = largest_difference(reference, compiled(cache))  # the first call compiles
    first_call = time.perf_counter() - started
    eager, fast = [], []
    for _ in range(repeats):
        for fn, samples in ((mapper.transfer, eager), (compiled, fast)):
            started = time.perf_counter()
            fn(cache)
            samples.append(time.perf_counter() - started)
    return {"tokens": tokens, "eager_s": {"median": statistics.median(eager), "min": min(eager), "samples": eager},
            "compiled_s": {"median": statistics.median(fast), "min": min(fast), "samples": fast},
            "compile_first_call_s": first_call, "max_abs_difference": difference}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    mapper = Mapper.load(argv[0])
    lengths = [int(t) for t in (argv[2] if len(argv) > 2 else "64,1024,2048").split(",")]
    repeats = int(argv[3]) if len(argv) > 3 else 5
    compiled = torch.compile(mapper.transfer, dynamic=False)
    rows = []
    for tokens in lengths:
        row = time_length(mapper, compiled, tokens, repeats)
        rows.append(row)
        eager, fast = row["eager_s"], row["compiled_s"]
        print(f"T={tokens}: eager median {eager['median'] * 1e3:.1f} ms (min {eager['min'] * 1e3:.1f}), compiled "
              f"median {fast['median'] * 1e3:.1f} ms (min {fast['min'] * 1e3:.1f}); first compiled call "
              f"{row['compile_first_call_s']:.1f} s; max |difference| "
              f"{row['max_abs_difference']:.1e}", flush=True)
    result = {"mapper": argv[0], "parameters": mapper.num_parameters(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "repeats": repeats, "results": rows}
    with open(argv[1], "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
