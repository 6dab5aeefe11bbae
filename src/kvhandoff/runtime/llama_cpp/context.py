"""One llama.cpp context of a loaded model and its token batch: what decodes. A model's conversations share one
(`backend.LlamaCppModel`); reading a turn's attention uses another of the same weights (`attention.TurnReader`).
Callers hold the model's lock around every call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvhandoff.errors import KVHandoffError


class LlamaCppError(KVHandoffError):
    """llama.cpp refused a call (the call and the fix are named)."""


def context_params(lib, settings, cells: int, sequences: int, cache_type: int, callback=None):
    """llama.cpp's parameters for a context of ``cells`` KV cells shared by ``sequences`` sequences, under
    ``settings`` (`backend.LlamaCppSettings`: batch, threads, flash attention), its cache of ggml type
    ``cache_type``; ``callback``: an evaluation callback (`ggml_backend_sched_eval_callback`) shown each graph node."""
    params = lib.llama_context_default_params()
    params.n_ctx = cells
    params.n_batch = params.n_ubatch = settings.batch
    params.n_seq_max = sequences
    params.kv_unified = True
    params.type_k = params.type_v = cache_type
    params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                              else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    params.no_perf = True
    if settings.threads is not None:
        params.n_threads = params.n_threads_batch = settings.threads
    if callback is not None:
        params.cb_eval = callback
    return params


class LlamaContext:
    """A context made from ``model`` (llama.cpp's model pointer; ``name`` in messages) with ``params``, and a batch
    of ``batch`` tokens; `decode` runs tokens through it. `free` releases both."""

    def __init__(self, lib, model, params, batch: int, vocab_size: int, name: str = "the model") -> None:
        self._lib, self.size, self.vocab_size = lib, batch, vocab_size
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise LlamaCppError(f"llama.cpp could not make a context of {params.n_ctx} cells for {name}: lower the "
                                "context (memory)")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(batch, 0, 1)

    def free(self) -> None:
        if self.batch is not None:
            self._lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self._lib.llama_free(self.ctx)
            self.ctx = self.memory = None

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               keep: Sequence[int] = (), after_call=None) -> torch.Tensor:
        """Decode ``tokens`` at ``positions`` in ``seqs`` (one each), in calls of at most `size` tokens; the
        logits [len(keep), vocab] after the tokens at indices ``keep``. ``after_call``: called after each call
        (a reader collecting what the call computed). A failed call drops what earlier calls of this decode added
        (each sequence as it was) and raises LlamaCppError."""
        lib, batch, size = self._lib, self.batch, self.size
        wanted = set(keep)
        rows: dict[int, torch.Tensor] = {}
        for begin in range(0, len(tokens), size):
            end = min(begin + size, len(tokens))
            for slot, index in enumerate(range(begin, end)):
                batch.token[slot] = int(tokens[index])
                batch.pos[slot] = int(positions[index])
                batch.n_seq_id[slot] = 1
                batch.seq_id[slot][0] = int(seqs[index])
                batch.logits[slot] = index in wanted
            batch.n_tokens = end - begin
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:
                for seq, first in _first_positions(seqs, positions).items():
                    lib.llama_memory_seq_rm(self.memory, seq, first, -1)
                raise LlamaCppError(f"llama.cpp's decode failed (status {status})"
                                    + (": no room in the KV cache, raise LlamaCppSettings.context"
                                       if status == 1 else ""))
            if after_call is not None:
                after_call()
            for slot, index in enumerate(range(begin, end)):
                if index in wanted:
                    pointer = lib.llama_get_logits_ith(self.ctx, slot)
                    rows[index] = torch.frombuffer(
                        bytearray(ctypes.string_at(pointer, 4 * self.vocab_size)), dtype=torch.float32)
        return torch.stack([rows[index] for index in keep]) if keep else torch.empty(0, self.vocab_size)


def _first_positions(seqs: Sequence[int], positions: Sequence[int]) -> dict[int, int]:
    """Each sequence's first position among a decode's tokens."""
    first: dict[int, int] = {}
    for seq, position in zip(seqs, positions, strict=True):
        first[int(seq)] = min(first.get(int(seq), int(position)), int(position))
    return first
