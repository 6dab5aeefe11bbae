"""Mappers: the frame every fitted mapper shares (`mapper.Mapper`: manifest, RoPE, transfer, save/load, pairing)
and its variants, one module each — `dense` (the full linear map), `blocks`, `lowrank` and `mlp`.

Each variant registers the methods it reads; they are imported here so that `Mapper.load` reads a mapper of any
method once any part of this package is imported.
"""

from kvhandoff.mapper import blocks, dense, lowrank, mlp  # noqa: F401 - register the methods with `Mapper.load`
