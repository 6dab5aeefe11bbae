"""The attention a llama.cpp model pays its cached positions while it reads a turn: what ranks positions for the
`turn_attention` recompute rule, and what a guard's preview of the turn reads.

llama.cpp returns no attention weights, but its evaluation callback shows each graph node as it is computed; each
layer names its RoPE-applied queries and keys "Qcur-<layer>" and "Kcur-<layer>" (the last node of that name in the
layer's graph: the ones before it are the same rows before RoPE). From those and the cached keys the weights follow
as the transformers engine computes them from its recorded queries (`kvhandoff.model.attention.received_attention`).

The callback is set on a context of its own (`TurnReader`), made from the model's weights on first use: the context
that serves conversations never pays a callback per graph node. A read copies the conversation's cells into it
through the sequence-state API, reads the turn there and leaves the conversation's own cells untouched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvhandoff.model.attention import received_attention
from kvhandoff.runtime.llama_cpp.context import LlamaContext, LlamaCppError, context_params
from kvhandoff.runtime.llama_cpp.state import GGML_TYPE_NAMES, CacheLayout

#: cells a reading context grows by: a longer read makes a new context rounded up to this
_CELL_STEP = 1024
#: the nodes read: RoPE-applied queries and keys, each suffixed "-<layer>"
_WATCHED = ("Qcur", "Kcur")


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml's ``struct ggml_tensor`` (ggml.h), up to its name: what a callback reads."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def _watched(name: bytes) -> tuple[str, int] | None:
    """("Qcur" | "Kcur", layer) for a watched node's name, else None."""
    kind, _, layer = name.decode("ascii", "replace").partition("-")
    return (kind, int(layer)) if kind in _WATCHED and layer.isdigit() else None


class TurnReader:
    """Reads turns on copies of a model's conversations in a context with an evaluation callback, collecting each
    layer's RoPE-applied queries and keys of the tokens read.

    lib: the ``llama_cpp`` module; model: llama.cpp's model pointer; settings: the model's `LlamaCppSettings` (its
    cache type and flash attention must match the conversations' context, whose sequence state is copied in);
    layout: the model's `CacheLayout`; heads: its query heads. Every call runs under the model's lock."""

    def __init__(self, lib, model, settings, layout: CacheLayout, heads: int, vocab_size: int) -> None:
        self._lib, self._model, self._settings, self._layout = lib, model, settings, layout
        self._heads, self._vocab_size = heads, vocab_size
        self._callback = lib.ggml_backend_sched_eval_callback(self._observe)  # kept: llama.cpp holds the pointer
        self._context: LlamaContext | None = None
        self._cells = 0
        self._seen: dict[tuple[str, int], torch.Tensor] = {}  # this call's nodes, the last of each name
        self._calls: list[dict[tuple[str, int], torch.Tensor]] = []
        self._failure: str | None = None

    def free(self) -> None:
        if self._context is not None:
            self._context.free()
            self._context = None

    # -- the callback -------------------------------------------------------------------------------------------------
    def _observe(self, pointer, ask: bool, _user) -> bool:
        """Asked: whether the node is watched. Told: its rows, kept (a later node of the same name replaces them)."""
        try:
            head = _TensorHead.from_address(pointer)
            found = _watched(head.name)
            if ask or found is None:
                return found is not None if ask else True
            self._seen[found] = self._rows(head)
        except Exception as exc:  # an exception must not cross into C: the read raises it after the decode
            self._failure = f"{type(exc).__name__}: {exc}"
        return True

    @staticmethod
    def _rows(head: _TensorHead) -> torch.Tensor:
        """A watched node's f32 data as [ne3, ne2, ne1, ne0] (contiguous, as RoPE writes it)."""
        shape = [int(head.ne[index]) for index in range(4)]
        if head.type != GGML_TYPE_NAMES["f32"] or int(head.nb[0]) != 4 or any(
                int(head.nb[index]) != int(head.nb[index - 1]) * shape[index - 1] for index in range(1, 4)):
            raise LlamaCppError(f"node {head.name.decode()} is not a contiguous f32 tensor")
        count = shape[0] * shape[1] * shape[2] * shape[3]
        data = ctypes.string_at(head.data, 4 * count)
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape[::-1])

    def _collect(self) -> None:
        """After a decode call: keep what it computed, for the next call to start afresh."""
        self._calls.append(self._seen)
        self._seen = {}

    # -- reading ------------------------------------------------------------------------------------------------------
    def _ready(self, cells: int) -> LlamaContext:
        """The reading context, holding no cells, of at least ``cells`` cells (made anew when it is smaller)."""
        if self._context is None or self._cells < cells:
            self.free()
            size = -(-cells // _CELL_STEP) * _CELL_STEP
            kind = self._layout.k_type
            self._context = LlamaContext(self._lib, self._model,
                                         context_params(self._lib, self._settings, size, 1, kind, self._callback),
                                         self._settings.batch, self._vocab_size)
            self._cells = size
        else:
            self._lib.llama_memory_clear(self._context.memory, True)
        return self._context

    def read(self, state: bytes | None, cached_keys: Sequence[torch.Tensor], tokens: Sequence[int], keep: int,
             lookahead: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Read ``tokens`` after the T cached positions whose sequence ``state`` (None: T = 0) and keys
        ``cached_keys`` (per layer [1, kv_heads, T, head_dim], float32) are given, then answer ``lookahead`` tokens
        greedily: the attention [1, T] the turn's (and the answer's) queries paid each cached position, summed
        over layers, heads and queries, and the float32 log-probs [keep, vocab] after the turn's last ``keep``
        tokens."""
        total = cached_keys[0].shape[2] if cached_keys else 0
        count = len(tokens)
        context = self._ready(total + count + lookahead)
        if state:
            buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
            if self._lib.llama_state_seq_set_data(context.ctx, buffer, len(state), 0) != len(state):
                raise LlamaCppError(f"llama.cpp's reading context did not take the {total} cached cells")
        self._calls, self._seen, self._failure = [], {}, None
        logits = context.decode(tokens, range(total, total + count), [0] * count, range(count - keep, count),
                                self._collect)
        last = logits[-1]
        for step in range(lookahead):
            token = int(last.argmax())
            last = context.decode([token], [total + count + step], [0], [0], self._collect)[0]
        if self._failure is not None:
            raise LlamaCppError(f"reading the turn's attention failed in llama.cpp's callback: {self._failure}")
        self._lib.llama_memory_clear(context.memory, True)
        return self._scores(cached_keys, total, scaling), logits.float().log_softmax(-1)

    def _layer_rows(self, kind: str, layer: int, heads: int) -> torch.Tensor:
        """[1, heads, n, head_dim]: layer ``layer``'s ``kind`` rows of every token read, in order."""
        parts = []
        for index, call in enumerate(self._calls):
            rows = call.get((kind, layer))
            if rows is None:
                raise LlamaCppError(f"llama.cpp's graph named no {kind}-{layer} in decode call {index}: this "
                                    "llama.cpp build does not show the RoPE-applied rows the engine reads")
            parts.append(rows.reshape(-1, heads, self._layout.head_dim))
        return torch.cat(parts).transpose(0, 1)[None]

    def _scores(self, cached_keys: Sequence[torch.Tensor], total: int, scaling: float) -> torch.Tensor:
        received = None
        for layer in range(self._layout.layers):
            queries = self._layer_rows("Qcur", layer, self._heads)
            keys = self._layer_rows("Kcur", layer, self._layout.kv_heads)
            if total:
                keys = torch.cat([cached_keys[layer].float(), keys], dim=2)
            at = torch.arange(total, total + queries.shape[2])
            scores = received_attention(queries, keys, at, scaling)[:, :total]
            received = scores if received is None else received + scores
        self._calls = []
        return received
