"""The llama.cpp engine behind the cache seam: a model of a family loaded from its GGUF by llama.cpp (through the
pinned llama-cpp-python), and `LlamaCppCache`, one conversation's KV cache as a sequence of that model's context.

One context per model holds every conversation the model serves: a unified KV cache of ``context`` cells shared
by up to ``sequences`` sequences, each `LlamaCppCache` one sequence. Copies share cells (llama.cpp's
``seq_cp`` copies no data), so a fork or a kept prefix takes no new cells until it grows. Rows leave the context through
the sequence-state API (`state.parse`) and enter it through a scratch sequence (`state.write`, then ``seq_cp``), so
an import that llama.cpp refuses leaves the cache as it was. Positions are recomputed in runs: each run of
consecutive positions is decoded in a scratch sequence that sees the cache's cells before it, and its fresh cells
replace the mapped ones — the same attention as the transformers engine's recompute in one forward.

Every call into a model's context holds that model's lock: a llama.cpp context serves one call at a time.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.llama_cpp import INSTALL_HINT, LLAMA_CPP_PYTHON_VERSION
from kvhandoff.runtime.llama_cpp import state as seq_state
from kvhandoff.runtime.llama_cpp.attention import TurnReader
from kvhandoff.runtime.llama_cpp.context import LlamaContext, LlamaCppError, context_params
from kvhandoff.runtime.llama_cpp.state import GGML_TYPE_NAMES, CacheLayout, StateFormatError
from kvhandoff.runtime.recompute import TurnRead, check_turn_read
from kvhandoff.runtime.seam import Capabilities, KVCache, Pending, rows_of

logger = logging.getLogger(__name__)

#: GGUF architectures whose cached keys are the transformers model's (RoPE rotating halves, no weight permutation)
SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3")


#: what a llama.cpp model can do at a switch: the recompute rules that pick positions without the model's layers,
#: and `turn_attention` (the turn read in a context whose callback shows the queries: `attention.TurnReader`)
LLAMA_CPP_CAPABILITIES = Capabilities("llama.cpp", ("none", "sinks", "recent", "turn_attention"))


def llama_library():
    """The pinned ``llama_cpp`` module; ConfigError naming the install command when it is missing or another
    version (another version may write its sequence state in another layout)."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the llama.cpp engine needs llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}: "
                          f"{INSTALL_HINT}") from None
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise ConfigError(f"llama-cpp-python {version} is installed; the llama.cpp engine reads the sequence state "
                          f"of {LLAMA_CPP_PYTHON_VERSION}: {INSTALL_HINT}")
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below this to stderr
    return llama_cpp


@dataclass(frozen=True)
class LlamaCppSettings:
    """How a model's llama.cpp context is made.

    context: KV cells of the context, shared by every conversation the model holds. sequences: conversations (and
    scratch sequences: a handoff uses one while it imports or recomputes) the context holds at once. threads: CPU
    threads (None: llama.cpp's default). batch: tokens per decode call. cache_type: the K/V cache's float type
    (f16, f32, bf16). flash_attn: llama.cpp's flash attention (its V cache is then not transposed).
    """

    context: int = 16384
    sequences: int = 32
    threads: int | None = None
    batch: int = 512
    cache_type: str = "f16"
    flash_attn: bool = False

    def __post_init__(self) -> None:
        for name, low, high in (("context", 16, 1 << 22), ("sequences", 2, 256), ("batch", 1, 1 << 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"llama.cpp {name} must be an integer in {low}..{high}, got {value!r}", field=name)
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ConfigError(f"llama.cpp threads must be a positive integer or None, got {self.threads!r}",
                              field="threads")
        if self.batch > self.context:
            raise ConfigError(f"llama.cpp batch {self.batch} is past the context's {self.context} cells: give a batch "
                              "of at most the context", field="batch")
        if self.cache_type not in GGML_TYPE_NAMES:
            raise ConfigError(f"llama.cpp cache_type must be one of {', '.join(GGML_TYPE_NAMES)} (kvhandoff maps "
                              f"float caches), got {self.cache_type!r}", field="cache_type")


class LlamaCppModel:
    """A model run by llama.cpp from ``gguf`` (a path), for the runtime: `config` is the model's transformers config
    (its geometry and context window: what `check_context` reads), `kvhandoff_fingerprint` the fingerprint of the
    transformers model the mapper was fitted on for these weights (what `verify_mapper` checks), and
    `new_cache` the `CacheFactory` of its conversations (`seam.new_cache` calls it). `close` frees the context and
    the weights. Recompute policies that rank positions by the target's own forward (deviation, blend,
    target_turn_attention, mix) or record the source's prefill (source_attention) need a transformers model;
    `turn_attention` reads the new turn in a context of its own (`read_turn`). `kvhandoff_capabilities` names the
    rules it serves."""

    kvhandoff_capabilities = LLAMA_CPP_CAPABILITIES
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, gguf: str | Path, config, fingerprint: dict, settings: LlamaCppSettings | None = None,
                 name: str | None = None, generation_config=None) -> None:
        self.settings = settings or LlamaCppSettings()
        self.config, self.kvhandoff_fingerprint = config, fingerprint
        self.generation_config = generation_config  # the stop ids a server reads (`decoding.end_ids`)
        self.gguf = Path(gguf)
        self.name_or_path = name or str(self.gguf)
        if not self.gguf.is_file():
            raise ConfigError(f"no GGUF file at {self.gguf}: pass the path of the model's .gguf")
        self._lib = llama_library()
        self._lock = threading.RLock()
        self._model = self._context = self._reader = None
        self._dropped: list[int] = []  # sequences of caches let go while another thread held the lock
        self._load()
        self._free_seqs = list(range(self.settings.sequences - 1, -1, -1))

    # -- loading ------------------------------------------------------------------------------------------------------
    def _load(self) -> None:
        lib, settings = self._lib, self.settings
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.gguf).encode(), params)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {self.gguf}: not a GGUF file, or a model architecture "
                                "this llama.cpp does not know")
        architecture = self._meta("general.architecture")
        if architecture not in SUPPORTED_ARCHITECTURES:
            self.close()
            raise ConfigError(f"{self.gguf.name} is a {architecture!r} model; the llama.cpp engine maps the caches of "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)} models, whose cached keys llama.cpp rotates as "
                              "transformers does")
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        kind = GGML_TYPE_NAMES[settings.cache_type]
        try:
            self._context = LlamaContext(lib, self._model, context_params(lib, settings, settings.context,
                                                                          settings.sequences, kind),
                                         settings.batch, self.vocab_size, self.gguf.name)
        except LlamaCppError:
            self.close()
            raise
        geometry = (self.config.num_hidden_layers, self.config.num_key_value_heads,
                    getattr(self.config, "head_dim", None)
                    or self.config.hidden_size // self.config.num_attention_heads)
        found = (lib.llama_model_n_layer(self._model), lib.llama_model_n_head_kv(self._model),
                 lib.llama_model_n_embd(self._model) // max(lib.llama_model_n_head(self._model), 1))
        if found[:2] != geometry[:2] or self.vocab_size != self.config.vocab_size:
            self.close()
            raise ConfigError(f"{self.gguf.name} has {found[0]} layers, {found[1]} KV heads and a vocabulary of "
                              f"{self.vocab_size}; its transformers config {geometry[0]}, {geometry[1]} and "
                              f"{self.config.vocab_size}: give the GGUF and the config of the same model")
        self.layout = CacheLayout(*geometry, k_type=kind, v_type=kind, v_trans=not settings.flash_attn)
        logger.info("llama.cpp: %s, %d cells × %d sequences, %s cache", self.gguf.name, settings.context,
                    settings.sequences, settings.cache_type)

    @property
    def _ctx(self):
        """The conversations' llama.cpp context (None once closed)."""
        return None if self._context is None else self._context.ctx

    @property
    def _memory(self):
        return None if self._context is None else self._context.memory

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        size = self._lib.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    def close(self) -> None:
        """Free the context, the batch and the weights (caches of this model are unusable after)."""
        with self._lock:
            for context in (self._reader, self._context):
                if context is not None:
                    context.free()
            self._reader = self._context = None
            if self._model:
                self._lib.llama_model_free(self._model)
                self._model = None

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name_or_path!r})"

    # -- what the runtime asks of a model -----------------------------------------------------------------------------
    def new_cache(self, model=None) -> LlamaCppCache:
        """An empty conversation in this model's context (a `CacheFactory`: ``model`` must be this one or None)."""
        if model is not None and model is not self:
            raise ConfigError(f"{self!r} makes caches for itself, not for {model!r}")
        return LlamaCppCache(self)

    @property
    def bytes_per_token(self) -> int:
        layout = self.layout
        element = seq_state.element_size(seq_state.GGML_FLOAT_TYPES[layout.k_type])
        return 2 * layout.layers * layout.width * element

    # -- the context's calls, each under the lock ---------------------------------------------------------------------
    def _live(self) -> None:
        """LlamaCppError once the model is closed (a context call would then touch freed memory); frees the
        sequences of caches dropped meanwhile. Called under the lock."""
        if not self._ctx:
            raise LlamaCppError(f"{self!r} is closed: its caches cannot be used")
        while self._dropped:
            seq = self._dropped.pop()
            self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free_seqs.append(seq)

    def _acquire(self) -> int:
        with self._lock:
            self._live()
            if not self._free_seqs:
                raise LlamaCppError(f"the llama.cpp context of {self.gguf.name} holds {self.settings.sequences} "
                                    "sequences, all in use: raise LlamaCppSettings.sequences, or hold fewer "
                                    "conversations at once")
            return self._free_seqs.pop()

    def _release(self, seq: int) -> None:
        """Give ``seq`` back: at once when the lock is free, else at the next call into the context (a cache dropped
        on another thread, e.g. the server's event loop, never waits for a running decode)."""
        if not self._lock.acquire(blocking=False):
            self._dropped.append(seq)
            return
        try:
            if self._ctx:
                self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free_seqs.append(seq)
        finally:
            self._lock.release()

    def _seq_rm(self, seq: int, start: int, end: int = -1) -> None:
        with self._lock:
            self._live()
            if not self._lib.llama_memory_seq_rm(self._memory, seq, start, end):
                raise LlamaCppError(f"llama.cpp could not drop positions {start}..{end} of sequence {seq}")

    def _seq_cp(self, source: int, target: int, start: int, end: int) -> None:
        with self._lock:
            self._live()
            self._lib.llama_memory_seq_cp(self._memory, source, target, start, end)

    def state_bytes(self, seq: int) -> bytes:
        """Sequence ``seq``'s state as llama.cpp writes it (`llama_state_seq_get_data`)."""
        lib = self._lib
        with self._lock:
            self._live()
            size = lib.llama_state_seq_get_size(self._ctx, seq)
            buffer = (ctypes.c_uint8 * size)()
            written = lib.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        if written != size:
            raise LlamaCppError(f"llama.cpp wrote {written} of the {size} bytes of sequence {seq}'s state")
        return bytes(buffer)

    def _read_state(self, seq: int, start: int, end: int) -> tuple[bytes, seq_state.SeqState]:
        """Sequence ``seq``'s state, as written and parsed; StateFormatError unless it holds positions start..end − 1
        exactly."""
        blob = self.state_bytes(seq)
        state = seq_state.parse(blob, self.layout)
        if not torch.equal(state.positions, torch.arange(start, end)):
            raise StateFormatError(f"sequence {seq} does not hold positions {start}..{end - 1} exactly")
        return blob, state

    def _write_state(self, seq: int, state: seq_state.SeqState) -> None:
        blob = seq_state.write(state, self.layout, seq)
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        with self._lock:
            self._live()
            read = self._lib.llama_state_seq_set_data(self._ctx, buffer, len(blob), seq)
        if read != len(blob):
            raise LlamaCppError(f"llama.cpp did not take the {state.length} cells (read {read} of {len(blob)} bytes): "
                                f"the context of {self.settings.context} cells has no room for them; raise "
                                "LlamaCppSettings.context")

    def read_turn(self, seq: int, length: int, tokens: Sequence[int], keep: int,
                  lookahead: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq`` (its first ``length`` positions) reads ``tokens`` in the reading context and answers
        ``lookahead`` more greedily: the attention [1, length] paid each cached position, the log-probs [keep,
        vocab] after the last ``keep`` tokens (`attention.TurnReader.read`)."""
        with self._lock:
            self._live()
            state, keys = None, []
            if length:
                state, parsed = self._read_state(seq, 0, length)
                keys = [layer_keys for layer_keys, _ in seq_state.to_rows(parsed, self.layout)]
            if self._reader is None:
                self._reader = TurnReader(self._lib, self._model, self.settings, self.layout,
                                          self._lib.llama_model_n_head(self._model), self.vocab_size)
            return self._reader.read(state, keys, tokens, keep, lookahead, self.layout.head_dim ** -0.5)

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
                keep: Sequence[int] = ()) -> torch.Tensor:
        """Decode ``tokens`` at ``positions`` in ``seqs`` (one each) in the conversations' context: the logits
        [len(keep), vocab] after the tokens at indices ``keep`` (`LlamaContext.decode`)."""
        with self._lock:
            self._live()
            return self._context.decode(tokens, positions, seqs, keep)


def llama_cpp_twin(model, gguf: str | Path, settings: LlamaCppSettings | None = None,
                   name: str | None = None) -> LlamaCppModel:
    """The llama.cpp model of ``gguf``, the same weights as the transformers ``model`` (e.g. the GGUF a registry
    model was converted from, `kvhandoff.model.loading.model_gguf`): its config and fingerprint are ``model``'s, so
    the mappers fitted on ``model`` serve it."""
    from kvhandoff.model.geometry import model_fingerprint

    return LlamaCppModel(gguf, model.config, model_fingerprint(model), settings,
                         name=name or str(getattr(model, "name_or_path", "") or gguf),
                         generation_config=getattr(model, "generation_config", None))


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted positions as maximal runs of consecutive ones, (first, last + 1)."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and position == runs[-1][1]:
            runs[-1] = (runs[-1][0], position + 1)
        elif runs and position < runs[-1][1]:
            raise ConfigError(f"recompute positions must be sorted and distinct, got {list(positions)}")
        else:
            runs.append((position, position + 1))
    return runs


class LlamaCppCache(KVCache):
    """`KVCache` on one sequence of a `LlamaCppModel`'s context: positions 0..length − 1, always contiguous. The
    rows it exports and takes are float32 [1, kv_heads, n, head_dim]; the context stores them in its cache type."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.seq = model._acquire()
        self._length = 0
        self._finalizer = weakref.finalize(self, model._release, self.seq)

    @property
    def length(self) -> int:
        return self._length

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def native(self) -> LlamaCppCache:
        return self

    def geometry(self) -> tuple[int, int, int] | None:
        layout = self.model.layout
        return (layout.layers, layout.kv_heads, layout.head_dim) if self._length else None

    def _own_model(self, model) -> LlamaCppModel:
        if model is not self.model:
            raise ConfigError(f"this cache lives in {self.model!r}'s llama.cpp context; {model!r} cannot read it")
        return model

    def export(self, start: int = 0, end: int | None = None) -> DynamicCache:
        """The rows of start..end − 1, float32: the range's cells shared into a scratch sequence (no data copied),
        whose state alone is read and parsed."""
        end = self._length if end is None else end
        if not 0 <= start <= end <= self._length:
            raise ConfigError(f"export {start}..{end} of a cache of {self._length} positions")
        layout = self.model.layout
        if start == end:
            empty = torch.empty(1, layout.kv_heads, 0, layout.head_dim)
            return rows_of((empty, empty) for _ in range(layout.layers))
        whole = start == 0 and end == self._length
        seq = self.seq if whole else self.model._acquire()
        try:
            if not whole:
                self.model._seq_cp(self.seq, seq, start, end)
            _, state = self.model._read_state(seq, start, end)
        finally:
            if not whole:
                self.model._release(seq)
        return rows_of(seq_state.to_rows(state, layout))

    def _place(self, rows: DynamicCache, start: int) -> int:
        """Put ``rows`` at positions start.. of this sequence, replacing what it holds there: written into a scratch
        sequence first, so a refused import leaves this one as it was. Returns the count."""
        count = rows.layers[0].keys.shape[2] if rows.layers else 0
        if not count:
            return 0
        positions = torch.arange(start, start + count)
        state = seq_state.from_rows([(layer.keys, layer.values) for layer in rows.layers], positions,
                                    self.model.layout)
        scratch = self.model._acquire()
        try:
            self.model._write_state(scratch, state)
            self.model._seq_rm(self.seq, start, start + count)
            self.model._seq_cp(scratch, self.seq, start, start + count)
        finally:
            self.model._release(scratch)
        return count

    def append(self, rows: DynamicCache) -> None:
        self._length += self._place(rows, self._length)

    def write(self, start: int, rows: DynamicCache) -> None:
        count = rows.layers[0].keys.shape[2] if rows.layers else 0
        if not start >= 0 or start + count > self._length:
            raise ConfigError(f"write {start}..{start + count} past a cache of {self._length} positions")
        self._place(rows, start)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ConfigError(f"cannot truncate a cache of {self._length} positions to {length}")
        self.model._seq_rm(self.seq, length, -1)
        self._length = length

    def copy(self) -> LlamaCppCache:
        twin = LlamaCppCache(self.model)
        if self._length:
            self.model._seq_cp(self.seq, twin.seq, 0, self._length)
        twin._length = self._length
        return twin

    def empty(self) -> LlamaCppCache:
        return LlamaCppCache(self.model)

    def storages(self) -> dict[tuple, int]:
        """The bytes of this sequence's cells, as if it held them alone: cells a copy shares are counted for each
        sequence that holds them (llama.cpp does not say which are shared), so a server's accounting errs high."""
        return {("llama.cpp", id(self.model), self.seq): self._length * self.model.bytes_per_token}

    def supports_recompute(self, model) -> bool:
        return model is self.model

    def recompute(self, model, pending: Pending) -> None:
        """Each run of consecutive pending positions is decoded in a scratch sequence holding this one's cells
        before it; its cells then replace this one's there."""
        model = self._own_model(model)
        if not pending:
            return
        positions, ids = pending.positions, pending.input_ids
        if positions.dim() != 2 or positions.shape[0] != 1 or ids.dim() != 2 or ids.shape != (1, self._length):
            raise ConfigError(f"a llama.cpp cache of {self._length} positions recomputes positions [1, n] of its "
                              f"tokens [1, {self._length}], got {tuple(positions.shape)} of {tuple(ids.shape)}")
        positions = torch.unique(positions[0])  # sorted, each once
        if positions.numel() and not 0 <= int(positions[0]) <= int(positions[-1]) < self._length:
            raise ConfigError(f"recompute positions must be in 0..{self._length - 1}, got {positions.tolist()}")
        ids = ids[0].tolist()
        for first, stop in _runs(positions.tolist()):
            scratch = model._acquire()
            try:
                if first:
                    model._seq_cp(self.seq, scratch, 0, first)
                model._decode(ids[first:stop], range(first, stop), [scratch] * (stop - first))
                model._seq_rm(self.seq, first, stop)
                model._seq_cp(scratch, self.seq, first, stop)
            finally:
                model._release(scratch)

    def read(self, model, new_ids: torch.Tensor, logits_to_keep: int = 1,
             pending: Pending | None = None) -> torch.Tensor:
        model = self._own_model(model)
        if new_ids.dim() != 2 or new_ids.shape[0] != 1 or not new_ids.shape[1]:
            raise ConfigError(f"a llama.cpp cache reads new ids [1, N ≥ 1], got {tuple(new_ids.shape)}")
        if pending:
            self.recompute(model, pending)
        tokens = new_ids[0].tolist()
        count = len(tokens)
        keep = min(max(int(logits_to_keep), 1), count) if logits_to_keep else count
        start = self._length
        logits = model._decode(tokens, range(start, start + count), [self.seq] * count,
                               range(count - keep, count))
        self._length += count
        return logits[None]

    def read_turn(self, model, new_ids: torch.Tensor, keep: int = 1, lookahead: int = 0) -> TurnRead:
        """`KVCache.read_turn` in llama.cpp: the turn is read on a copy of this sequence's cells in the model's
        reading context (`attention.TurnReader`), whose callback shows each layer's queries and keys; this
        sequence is left as it was."""
        model = self._own_model(model)
        if new_ids.dim() != 2 or new_ids.shape[0] != 1 or not new_ids.shape[1]:
            raise ConfigError(f"a llama.cpp cache reads new ids [1, N ≥ 1], got {tuple(new_ids.shape)}")
        tokens = new_ids[0].tolist()
        check_turn_read(len(tokens), keep, lookahead)
        scores, logprobs = model.read_turn(self.seq, self._length, tokens, keep, lookahead)
        return TurnRead(scores, logprobs[None])

    @classmethod
    def read_batch(cls, model, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode call: each cache's token in its own sequence, at its own position."""
        if not all(isinstance(cache, LlamaCppCache) and cache.model is model for cache in caches):
            return super().read_batch(model, caches, tokens)
        logits = model._decode(list(tokens), [cache.length for cache in caches], [cache.seq for cache in caches],
                               range(len(caches)))
        for cache in caches:
            cache._length += 1
        return logits

    def generate(self, model, input_ids: torch.Tensor,
                 first_read: Callable[[torch.Tensor, int], torch.Tensor] | None = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 generator: torch.Generator | None = None, **unknown) -> torch.Tensor:
        """Greedy decoding (or sampling at ``temperature`` with ``do_sample``) of up to ``max_new_tokens``, stopping
        after an ``eos_token_id`` (None: the model's generation config's, as ``transformers``' ``generate``; its
        other sampling settings are not applied); the last token is not fed back (as ``generate``)."""
        if unknown:
            raise ConfigError(f"the llama.cpp engine's generate takes max_new_tokens, do_sample, temperature, "
                              f"eos_token_id, pad_token_id and generator; not {', '.join(sorted(unknown))}")
        model = self._own_model(model)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] <= self._length:
            raise ConfigError(f"input_ids must be [1, tokens] with more than the {self._length} cached tokens, got "
                              f"{tuple(input_ids.shape)}")
        if eos_token_id is None:
            eos_token_id = getattr(model.generation_config, "eos_token_id", None)
        stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        sequence = input_ids[0].tolist()
        new_ids = input_ids[:, self._length:]
        logits = first_read(new_ids, 1) if first_read is not None else self.read(model, new_ids, 1)
        for step in range(max_new_tokens):
            scores = logits[0, -1].float()
            if do_sample:
                probabilities = torch.softmax(scores / max(temperature, 1e-5), dim=-1)
                token = int(torch.multinomial(probabilities, 1, generator=generator))
            else:
                token = int(scores.argmax())
            sequence.append(token)
            if token in stops or step + 1 == max_new_tokens:
                break
            logits = self.read(model, torch.tensor([[token]]), 1)
        return torch.tensor([sequence])
