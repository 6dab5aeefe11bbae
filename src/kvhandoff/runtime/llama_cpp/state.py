"""llama.cpp's sequence state: the bytes `llama_state_seq_get_data` writes for one sequence and
`llama_state_seq_set_data` reads back, parsed into per-layer K/V rows and written from them.

The layout is the one of the llama.cpp that the pinned llama-cpp-python builds (`llama-context.cpp` and
`llama-kv-cache.cpp`'s ``state_write``), all little-endian:

    u32 magic (0xaf143cd8), i32 seq_id, u32 n_stream, then per stream:
      u32 cell_count; when > 0:
        per cell: i32 pos, u32 n_seq_id, n_seq_id × i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 K type, u64 K row bytes, cell_count K rows
        per layer, V rows: i32 type, u64 row bytes, cell_count rows
          or, transposed (v_trans): i32 type, u32 element bytes, u32 row width, width × cell_count elements

Only float K/V caches are read (f32, f16, bf16); a quantized cache, another model's width or layer count, or any
byte left over is refused with the mismatch named. Models whose cells carry extended fields (M-RoPE, per-layer
embeddings) are not read: their states do not parse as these. Pure functions of bytes and
tensors: nothing here touches a llama.cpp context.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from kvhandoff.errors import KVHandoffError

MAGIC = 0xAF143CD8
#: ggml type ids of the float caches kvhandoff reads and writes, and their torch dtypes
GGML_FLOAT_TYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
GGML_TYPE_NAMES: dict[str, int] = {"f32": 0, "f16": 1, "bf16": 30}


class StateFormatError(KVHandoffError):
    """A llama.cpp sequence state does not have the layout, model or cache type it was read for (named)."""


@dataclass(frozen=True)
class CacheLayout:
    """What a model's llama.cpp cache looks like: layers, the K/V row width (KV heads × head dim), the ggml type of
    K and V, whether V is stored transposed, and the context's stream count."""

    layers: int
    kv_heads: int
    head_dim: int
    k_type: int = 1
    v_type: int = 1
    v_trans: bool = True
    n_stream: int = 1

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def __post_init__(self) -> None:
        for name in ("k_type", "v_type"):
            kind = getattr(self, name)
            if kind not in GGML_FLOAT_TYPES:
                raise StateFormatError(
                    f"a {name[0].upper()} cache of ggml type {kind} is not a float cache: kvhandoff reads and writes "
                    f"f32, f16 and bf16 caches; start the llama.cpp context with type_k/type_v one of those")


@dataclass
class SeqState:
    """One sequence's cells, in position order: ``positions`` [n] and per layer ``keys``/``values`` [n, width] in
    the cache's dtype."""

    positions: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.positions.numel())


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.view, self.offset = memoryview(blob), 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.view):
            raise StateFormatError(f"the state ends at byte {len(self.view)} inside a field at byte {self.offset}: "
                                   "truncated, or written by another llama.cpp version")
        values = struct.unpack_from(fmt, self.view, self.offset)
        self.offset += size
        return values if len(values) > 1 else values[0]

    def tensor(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = count * element_size(dtype)
        if self.offset + size > len(self.view):
            raise StateFormatError(f"the state ends at byte {len(self.view)}, {size} bytes of K/V expected from "
                                   f"byte {self.offset}: truncated, or written for another model")
        data = torch.frombuffer(bytearray(self.view[self.offset:self.offset + size]), dtype=dtype) if size else \
            torch.empty(0, dtype=dtype)
        self.offset += size
        return data


def _check(found, expected, what: str, hint: str) -> None:
    if found != expected:
        raise StateFormatError(f"the state's {what} is {found}, this model's cache has {expected}: {hint}")


def parse(blob: bytes, layout: CacheLayout) -> SeqState:
    """The cells of one sequence's state ``blob`` (`llama_state_seq_get_data`), sorted by position. Refused
    (StateFormatError) unless it is a sequence state of the pinned layout for a cache of ``layout``."""
    reader = _Reader(blob)
    magic = reader.take("<I")
    if magic != MAGIC:
        raise StateFormatError(f"not a llama.cpp sequence state (magic {magic:#010x}, expected {MAGIC:#010x}): pass "
                               "the bytes of llama_state_seq_get_data from the pinned llama-cpp-python")
    reader.take("<i")  # the sequence it was read from; set_data writes into the one it is given
    n_stream = reader.take("<I")
    _check(n_stream, layout.n_stream, "stream count", "a context with another kv_unified/n_seq_max setting")
    positions: list[int] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for _ in range(n_stream):
        cells = reader.take("<I")
        if not cells:
            continue
        if positions:
            raise StateFormatError("the state holds cells in two streams: not the state of one sequence")
        meta = reader.tensor(3 * cells, torch.int32).view(cells, 3)  # per cell: pos, n_seq_id (1), seq_id
        if not bool((meta[:, 1] == 1).all()):
            raise StateFormatError("a cell of the state belongs to several sequences or none: read a single "
                                   "sequence's state (seq_id ≥ 0); a state with extended cells (M-RoPE models) "
                                   "is not supported")
        positions = meta[:, 0].tolist()
        keys, values = _read_rows(reader, layout, cells)
    if reader.offset != len(reader.view):
        raise StateFormatError(f"{len(reader.view) - reader.offset} bytes follow the state's last field: written by "
                               "another llama.cpp version, or for another model")
    order = torch.tensor(positions, dtype=torch.int64).argsort()
    return SeqState(torch.tensor(positions, dtype=torch.int64)[order], [k[order] for k in keys],
                    [v[order] for v in values])


def _read_rows(reader: _Reader, layout: CacheLayout, cells: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    v_trans, n_layer = reader.take("<II")
    _check(n_layer, layout.layers, "layer count", "a state of another model")
    _check(bool(v_trans), layout.v_trans, "V layout (transposed)",
           "a context with another flash-attention setting")
    keys = [_read_plain(reader, layout.k_type, layout.width, cells, "K") for _ in range(n_layer)]
    if not v_trans:
        values = [_read_plain(reader, layout.v_type, layout.width, cells, "V") for _ in range(n_layer)]
    else:
        values = []
        for _ in range(n_layer):
            kind, element, width = reader.take("<iII")
            _check_type(kind, layout.v_type, "V")
            _check(element, element_size(GGML_FLOAT_TYPES[kind]), "V element size",
                   "written by another llama.cpp version")
            _check(width, layout.width, "V row width (KV heads × head dim)", "a state of another model")
            values.append(reader.tensor(width * cells, GGML_FLOAT_TYPES[kind]).view(width, cells).T.contiguous())
    return keys, values


def _check_type(found: int, expected: int, which: str) -> None:
    if found != expected:
        found_name = next((name for name, kind in GGML_TYPE_NAMES.items() if kind == found), f"ggml type {found}")
        expected_name = next(name for name, kind in GGML_TYPE_NAMES.items() if kind == expected)
        raise StateFormatError(f"the state's {which} cache type is {found_name}, this context's {expected_name}: "
                               f"a state of a context with another type_{which.lower()}")


def _read_plain(reader: _Reader, expected_type: int, width: int, cells: int, which: str) -> torch.Tensor:
    kind, row_bytes = reader.take("<iQ")
    _check_type(kind, expected_type, which)
    dtype = GGML_FLOAT_TYPES[kind]
    _check(row_bytes, width * element_size(dtype), f"{which} row size in bytes",
           "a state of another model (another KV head count or head dim)")
    return reader.tensor(width * cells, dtype).view(cells, width)


def write(state: SeqState, layout: CacheLayout, seq_id: int = 0) -> bytes:
    """The bytes `llama_state_seq_set_data` reads for ``state`` (cells in its order) into a context of ``layout``;
    the inverse of `parse`."""
    cells = state.length
    if len(state.keys) != layout.layers or len(state.values) != layout.layers:
        raise StateFormatError(f"{len(state.keys)} layers of rows for a cache of {layout.layers}")
    parts = [struct.pack("<IiI", MAGIC, seq_id, layout.n_stream)]
    if cells:
        parts.append(struct.pack("<I", cells))
        meta = torch.stack([state.positions.to(torch.int32), torch.ones(cells, dtype=torch.int32),
                            torch.full((cells,), seq_id, dtype=torch.int32)], dim=1)
        parts.append(meta.numpy().tobytes())
        parts.append(struct.pack("<II", int(layout.v_trans), layout.layers))
        k_dtype, v_dtype = GGML_FLOAT_TYPES[layout.k_type], GGML_FLOAT_TYPES[layout.v_type]
        for keys in state.keys:
            parts.append(struct.pack("<iQ", layout.k_type, layout.width * element_size(k_dtype)))
            parts.append(_bytes(_rows(keys, cells, layout.width).to(k_dtype)))
        for values in state.values:
            rows = _rows(values, cells, layout.width).to(v_dtype)
            if layout.v_trans:
                parts.append(struct.pack("<iII", layout.v_type, element_size(v_dtype), layout.width))
                parts.append(_bytes(rows.T))
            else:
                parts.append(struct.pack("<iQ", layout.v_type, layout.width * element_size(v_dtype)))
                parts.append(_bytes(rows))
    parts.extend(struct.pack("<I", 0) for _ in range(layout.n_stream - (1 if cells else 0)))
    return b"".join(parts)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.tensor([], dtype=dtype).element_size()


def _rows(tensor: torch.Tensor, cells: int, width: int) -> torch.Tensor:
    if tuple(tensor.shape) != (cells, width):
        raise StateFormatError(f"rows of shape {tuple(tensor.shape)} for {cells} cells of width {width}")
    return tensor


def _bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def to_rows(state: SeqState, layout: CacheLayout, dtype: torch.dtype = torch.float32):
    """``state``'s rows as the cache seam exchanges them: per layer (keys, values) [1, kv_heads, n, head_dim]."""
    def shaped(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(dtype).view(1, -1, layout.kv_heads, layout.head_dim).transpose(1, 2)

    return [(shaped(k), shaped(v)) for k, v in zip(state.keys, state.values, strict=True)]


def from_rows(layers, positions: torch.Tensor, layout: CacheLayout) -> SeqState:
    """A `SeqState` of the cells at ``positions`` [n] from rows per layer (keys, values) [1, kv_heads, n,
    head_dim] (the seam's exchange format), converted to the layout's cache types."""
    keys, values = [], []
    for layer_keys, layer_values in layers:
        for name, rows in (("keys", layer_keys), ("values", layer_values)):
            if rows.dim() != 4 or rows.shape[0] != 1 or (rows.shape[1], rows.shape[3]) != (layout.kv_heads,
                                                                                          layout.head_dim):
                raise StateFormatError(f"{name} of shape {tuple(rows.shape)} for a cache of {layout.kv_heads} KV "
                                       f"heads × head dim {layout.head_dim} (one sequence)")
        keys.append(layer_keys[0].transpose(0, 1).reshape(-1, layout.width).to(GGML_FLOAT_TYPES[layout.k_type]))
        values.append(layer_values[0].transpose(0, 1).reshape(-1, layout.width).to(GGML_FLOAT_TYPES[layout.v_type]))
    return SeqState(positions.to(torch.int64), keys, values)
