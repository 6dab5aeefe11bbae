"""The mapper frame: what every fitted mapper does, whatever its map.

A mapper turns a source model's KV cache into a target model's (`Mapper.transfer`): the source RoPE is stripped
from the keys, the content-space K/V rows are mapped, the target RoPE is applied and the result is a
`DynamicCache`. The frame holds the manifest, the refusals (another model pair, a context past the target's
window, a cache on another device, NaN/Inf), save and load (eager or lazy) and the registry of methods a manifest
can name; its collaborators: `rows.TokenRows` (the layouts around the map, RoPE included), `pairing.PairingCheck`
(the models against the manifest's fingerprints) and `storage` (the folder on disk). A variant (`dense`,
`blocks`, `lowrank`, `mlp`) says only how rows are mapped (`map_rows`), which tensors it holds and saves, how
they move, and what a token costs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import DynamicCache

from kvhandoff.errors import ConfigError, ContextTooLongError, MapperFormatError
from kvhandoff.mapper.manifest import GuardCalibration, MapperManifest, RecomputeChoice
from kvhandoff.mapper.pairing import PairingCheck
from kvhandoff.mapper.rows import TokenRows
from kvhandoff.mapper.storage import (
    UnreadTensors,
    read_manifest,
    read_tensors,
    record_manifest,
    storage_copies,
    storage_dtype,
    write_mapper,
)
from kvhandoff.model.capture import ContentKV


def check_mapper_dtype(dtype: torch.dtype | None) -> None:
    """ConfigError unless ``dtype`` (what a mapper's `to` casts to) is None or a floating dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"a mapper's dtype must be a floating dtype, got {dtype}")


class Mapper(ABC):
    """A fitted map from a source model's KV cache to a target model's, in content space.

    selected: [target_layers, k] source layers feeding each target layer (the manifest's selected_layers).
    manifest: a `MapperManifest` (a mapping of its JSON form is accepted and validated): geometry, fingerprints,
        config, calibration description and fit metrics.
    folder: the folder the mapper was loaded from or last saved to (None: only in memory).
    """

    folder: Path | None = None

    def __init__(self, selected: torch.Tensor, manifest: MapperManifest | Mapping):
        manifest = self._adopt_manifest(manifest)
        self.selected = selected.long()
        if self.selected.tolist() != [list(row) for row in manifest.selected_layers]:
            raise MapperFormatError(
                "the mapper's selected source layers differ from its manifest's selected_layers; re-fit the mapper"
            )

    def _adopt_manifest(self, manifest: MapperManifest | Mapping) -> MapperManifest:
        """Take the (validated) manifest and what follows from it alone (a lazy load stops here)."""
        if not isinstance(manifest, MapperManifest):
            manifest = MapperManifest.from_dict(manifest)
        self.manifest = manifest
        self.source, self.target = manifest.source_layout, manifest.target_layout
        self._pairing = PairingCheck()  # the models it verified
        self._rows = TokenRows(self.source, self.target)  # its RoPE tables, made at the first transfer
        return manifest

    # -- what a variant defines -------------------------------------------------------------------
    @abstractmethod
    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Content-space source K/V as token rows x [2, B, T, Ls, Hs, Ds] (the mapper's dtype, contiguous) →
        target K/V [2, B, T, Lt, Ht, Dt] (may be a view of one buffer)."""

    @abstractmethod
    def parameter_tensors(self) -> list[torch.Tensor]:
        """The map's fitted tensors (what `num_parameters` counts); the first sets the mapper's device and dtype."""

    def index_tensors(self) -> list[torch.Tensor]:
        """Integer tensors the map reads beside its parameters (counted by `nbytes`, not `num_parameters`)."""
        return []

    @abstractmethod
    def flops_per_token(self) -> int:
        """Floating-point operations of mapping one token's K/V (multiply-adds ×2, plus the biases)."""

    @abstractmethod
    def _move(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Move the map's tensors to ``device`` and cast its floating ones to ``dtype`` (either may be None)."""

    @abstractmethod
    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors `save` writes, by name (what `from_tensors` reads back)."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> Mapper:
        """The mapper of a saved file's tensors (what `saved_tensors` gave)."""

    def _target_layer_axis(self, name: str) -> int | None:
        """The axis of saved tensor ``name`` that indexes target layers (None: none does), for messages."""
        return None

    def map_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weight, bias) tensors a linear map reads, for training in place (`refine.refine_mapper`)."""
        raise ConfigError(f"a {self.manifest.method!r} mapper is not refined end to end; refine the full ridge mapper")

    # -- placement and size -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.parameter_tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the map runs in (float32 unless `to` changed it)."""
        return self.parameter_tensors()[0].dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Mapper:
        """Move the mapper's tensors to ``device`` and/or cast them to the floating ``dtype`` (in place; returns
        the mapper). `transfer` then maps in that dtype on that device; RoPE is stripped and applied in float32
        whatever the dtype."""
        check_mapper_dtype(dtype)
        self._move(device, dtype)
        self.selected = self.selected.to(self.device)
        return self

    @property
    def top_k(self) -> int:
        return int(self.selected.shape[1])

    @property
    def exact_prefix(self) -> int:
        """Leading tokens the target should recompute at handoff (the fit config's exact_prefix)."""
        return self.manifest.exact_prefix

    def num_parameters(self) -> int:
        """Parameters of the map (a lazily loaded mapper answers from its manifest's `storage` record)."""
        if self.pending and self.manifest.storage:
            return int(self.manifest.storage["parameters"])
        return sum(t.numel() for t in self.parameter_tensors())

    def nbytes(self) -> int:
        """Bytes the map's tensors take in memory (a lazily loaded mapper: 0 until its first use)."""
        if self.pending:
            return 0
        return sum(t.numel() * t.element_size() for t in [*self.parameter_tensors(), *self.index_tensors()])

    # -- application ------------------------------------------------------------------------------
    @torch.no_grad()
    def map_feature_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Calibration-layout rows (`FeatureLayout`: K then V of every source layer) [n, source width] → target
        rows [n, target width], content space."""
        return self._rows.to_features(self.map_rows(self._rows.from_features(x, self.device, self.dtype)))

    @torch.inference_mode()
    def map_content(self, content: ContentKV) -> ContentKV:
        """Map content-space source K/V [Ls, B, Hs, T, Ds] to content-space target K/V [Lt, B, Ht, T, Dt]."""
        layers, _, heads, _, head_dim = content.keys.shape
        self._rows.check_source(layers, heads, head_dim)
        return self._rows.to_content(self.map_rows(self._rows.from_content(content, self.device, self.dtype)))

    def check_context(self, length: int) -> None:
        """ContextTooLongError unless ``length`` positions fit the target's context window (checked before any
        work: the target cannot attend past its max_position_embeddings)."""
        limit = self.manifest.target_max_position_embeddings
        if length > limit:
            raise ContextTooLongError(
                f"a context of {length} tokens exceeds the target's max_position_embeddings ({limit}): shorten the "
                "context (drop earlier turns) or hand off to a model with a longer context window"
            )

    @torch.no_grad()  # not inference_mode: the cache's tensors must stay usable (in place) outside it
    def transfer(self, source_cache, position_ids: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> DynamicCache:
        """Turn a source `transformers` cache into a target `DynamicCache` for the same positions.

        position_ids: [batch, tokens] (or [tokens]) positions of the cached tokens (default 0..T−1).
        dtype: dtype of the returned cache (default: the source cache's dtype).

        Same arithmetic as `cache_to_content` → `map_content` → `apply_rope`, laid out for speed (`TokenRows`).
        RoPE is stripped and applied in float32; the map runs in the mapper's dtype (float32 unless `to` changed
        it). Refused: positions past the target's context window, a cache on another device than the mapper,
        NaN/Inf in the cache.
        """
        layers = source_cache.layers
        keys0 = layers[0].keys
        _, heads, tokens, head_dim = keys0.shape
        self._rows.check_source(len(layers), heads, head_dim)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        self.check_context(tokens if position_ids is None else int(position_ids.max()) + 1)
        x = self._rows.from_cache(layers, position_ids, self.manifest, self.device)
        y = self.map_rows(x.to(self.dtype))  # [2, B, T, Lt, Ht, Dt]
        return self._rows.to_cache(y, position_ids, dtype or keys0.dtype, self.manifest, self.device)

    # -- persistence (`storage`) ------------------------------------------------------------------
    def stored(self) -> Mapper:
        """This mapper as its saved file will hold it (`storage.storage_copies`; itself when the fit config's storage
        dtype is float32), so a fitted mapper behaves exactly like the one loaded back."""
        if storage_dtype(self.manifest) == torch.float32:
            return self
        return type(self).from_tensors(storage_copies(self.saved_tensors(), self.manifest), self.manifest)

    def save(self, path: str | Path) -> Path:
        """Write `mapper.safetensors` + `manifest.json` into directory `path`, atomically (`storage.write_mapper`:
        an interrupted save never leaves a half-written mapper where a good one was, nor loses the old one; weights
        in the fit config's `storage_dtype`; a mapper with NaN/Inf weights is refused and nothing written)."""
        path = Path(path)
        self.manifest = write_mapper(path, self.saved_tensors(), self.manifest, self._target_layer_axis)
        self.folder = path
        return path

    def record_guard(self, guard: GuardCalibration | None) -> MapperManifest:
        """Record ``guard`` (the quality guard measured for this pair; None: drop the record) in this mapper's
        manifest, in memory and in its `folder`: only `manifest.json` is rewritten, atomically
        (`storage.write_manifest`); the tensors stay as they are. Refused (MapperFormatError) for a mapper that is
        only in memory, or when the folder holds another mapper by now."""
        return self._record(self.manifest.with_guard(guard), "its guard")

    def record_recompute(self, recompute: RecomputeChoice | None) -> MapperManifest:
        """Record ``recompute`` (the selective-recompute policy chosen for this pair; None: drop the record) in
        this mapper's manifest, in memory and in its `folder`, as `record_guard` does."""
        return self._record(self.manifest.with_recompute(recompute), "its recompute policy")

    def record_measured(self, guard: GuardCalibration | None, recompute: RecomputeChoice | None) -> MapperManifest:
        """Record what was measured for this pair, its guard and its recompute policy (None: leave that record as
        it is), in one rewrite of the manifest, as `record_guard` does."""
        manifest = self.manifest
        if guard is not None:
            manifest = manifest.with_guard(guard)
        if recompute is not None:
            manifest = manifest.with_recompute(recompute)
        return self._record(manifest, "what was measured for it")

    def _record(self, manifest: MapperManifest, what: str) -> MapperManifest:
        self.manifest = record_manifest(self.folder, manifest, what)
        return self.manifest

    @classmethod
    def load(cls, path: str | Path, source_model=None, target_model=None, source_tokenizer=None,
             target_tokenizer=None, lazy: bool = False) -> Mapper:
        """Load a saved mapper of any registered method; with models given, verify it was fitted for exactly this
        pair. Never runs code. The manifest (and its checksum) is always read and checked here, an interrupted save
        finished first (`storage.read_manifest`: the good copy is what loads). lazy: the tensors are read only at
        the mapper's first use (a router holding several mappers pays for the ones it uses), the file checked as
        `storage.UnreadTensors` says: a damaged one then raises MapperFormatError from the first transfer instead
        of from `load`."""
        manifest, tensor_path = read_manifest(Path(path))
        kind = mapper_class(manifest.method, str(path))
        if lazy:
            mapper = kind.__new__(kind)
            mapper._adopt_manifest(manifest)
            mapper._pending = UnreadTensors(tensor_path, manifest)
        else:
            mapper = kind.from_tensors(read_tensors(tensor_path, manifest), manifest)
        mapper.verify_pair(source_model, target_model, source_tokenizer, target_tokenizer)
        mapper.folder = Path(path)
        return mapper

    @property
    def pending(self) -> bool:
        """Whether this (lazily loaded) mapper has not read its tensors yet."""
        return "_pending" in self.__dict__

    def __getattr__(self, name: str):
        # only reached for attributes the instance lacks: a lazily loaded mapper reads its tensors at the first
        # use of any of them, then is exactly the mapper an eager load would have built
        if name.startswith("__") or "_pending" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._materialise()
        return getattr(self, name)

    def _materialise(self) -> None:
        pairing = self._pairing
        built = type(self).from_tensors(self.__dict__["_pending"].read(self.manifest), self.manifest)
        del self.__dict__["_pending"]  # only now: a damaged file keeps raising MapperFormatError at every use
        self.__dict__.update(built.__dict__)
        self._pairing = pairing  # the models already checked stay checked

    # -- pairing (`PairingCheck`) -----------------------------------------------------------------
    def check_models(self, source_model=None, target_model=None) -> None:
        """`verify_pair` for these models, once per (mapper, model) (`PairingCheck.check_models`: the hot path calls
        it every time and fingerprints a model only the first time it sees it)."""
        self._pairing.check_models(self.manifest, source_model, target_model)

    def verify_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None):
        """Raise MapperMismatchError unless the given models (and tokenizers) are the ones fitted for."""
        PairingCheck.verify(self.manifest, source_model, target_model, source_tokenizer, target_tokenizer)


#: mapper classes by the manifest's ``method``; each variant module registers its own (`kvhandoff.mapper` imports
#: them all, so every method loads once any part of the package is imported)
MAPPER_METHODS: dict[str, type[Mapper]] = {}


def register_method(name: str, mapper_class: type[Mapper]) -> None:
    """Make `Mapper.load` build ``mapper_class`` for manifests whose ``method`` is ``name``."""
    MAPPER_METHODS[name] = mapper_class


def mapper_class(method: str, where: str = "the manifest") -> type[Mapper]:
    """The mapper class registered for ``method``; MapperFormatError naming ``where`` when none is."""
    if method not in MAPPER_METHODS:
        raise MapperFormatError(
            f"{where} holds a mapper of unknown method {method!r} (known: {', '.join(sorted(MAPPER_METHODS))}); "
            "upgrade kvhandoff or re-fit it"
        )
    return MAPPER_METHODS[method]
