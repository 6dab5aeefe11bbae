"""The fitted mapper: source cache → target cache (strip source RoPE → linear map → apply target RoPE).

Tensors are laid out once, at construction, for the hot path: K and V maps of all target layers are one
stacked weight [2·target_layers, k·source_features, target_features], applied with a single batched matmul;
when every target layer reads every source layer (k = all) the whole map is one dense GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from kvhandoff.errors import (
    ConfigError,
    ContextTooLongError,
    MapperFormatError,
    MapperMismatchError,
    NonFiniteError,
)
from kvhandoff.files import atomic_folder, recover_folder, sha256_file
from kvhandoff.mapper.manifest import MapperManifest, dumps, loads
from kvhandoff.model.cache import cache_of
from kvhandoff.model.capture import ContentKV, all_finite, nonfinite_layers
from kvhandoff.model.geometry import PAIRING_KEYS, model_fingerprint, signatures_match
from kvhandoff.model.rope import rope_frequencies

TENSOR_FILE = "mapper.safetensors"
MANIFEST_FILE = "manifest.json"



def check_mapper_dtype(dtype: torch.dtype | None) -> None:
    """ConfigError unless ``dtype`` (what a mapper's `to` casts to) is None or a floating dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"a mapper's dtype must be a floating dtype, got {dtype}")

class Mapper:
    """A linear content-space map from a source model's KV cache to a target model's.

    weight: [2, target_layers, k · source_kv_features, target_kv_features] (modality K=0, V=1)
    bias:   [2, target_layers, target_kv_features]
    selected: [target_layers, k] source layers feeding each target layer
    manifest: a `MapperManifest` (a mapping of its JSON form is accepted and validated): geometry,
        fingerprints, config, calibration description and fit metrics.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, selected: torch.Tensor,
                 manifest: MapperManifest | Mapping):
        manifest = self._adopt_manifest(manifest)
        self.selected = selected.long()
        if self.selected.tolist() != [list(row) for row in manifest.selected_layers]:
            raise MapperFormatError(
                "the mapper's selected source layers differ from its manifest's selected_layers; re-fit the mapper"
            )
        # "kv": each map reads the selected source layers' K and V (input columns: K block, then V block)
        self.joint_inputs = manifest.joint_inputs
        expected = self._weight_shape()
        if tuple(weight.shape) != expected or tuple(bias.shape) != (2, *expected[1:2], expected[3]):
            raise MapperFormatError(
                f"mapper tensors have shapes {tuple(weight.shape)}/{tuple(bias.shape)}, expected {expected}: "
                "the file does not match its manifest; re-fit the mapper"
            )
        self._lay_out(weight.float(), bias.float())

    def _adopt_manifest(self, manifest: MapperManifest | Mapping) -> MapperManifest:
        """Take the (validated) manifest and what follows from it alone; every mapper class starts here."""
        if not isinstance(manifest, MapperManifest):
            manifest = MapperManifest.from_dict(manifest)
        self.manifest = manifest
        self.source, self.target = manifest.source_layout, manifest.target_layout
        self._verified: dict[str, weakref.WeakSet] = {"source": weakref.WeakSet(), "target": weakref.WeakSet()}
        self._rope_tables: dict = {}
        return manifest

    def _weight_shape(self) -> tuple[int, int, int, int]:
        return (
            2,
            self.target.num_layers,
            (2 if self.joint_inputs else 1) * self.selected.shape[1] * self.source.layer_width,
            self.target.layer_width,
        )

    def _lay_out(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Lay out (weight, bias) for the hot path, on their device and dtype."""
        expected = self._weight_shape()
        self.bias = bias.contiguous()
        self.selected = self.selected.to(weight.device)
        k = self.selected.shape[1]
        self._dense = k == self.source.num_layers and bool(
            (self.selected.cpu() == torch.arange(self.source.num_layers)).all()
        )
        # the dense layouts are made from `weight` as given: one that is a view of them already (a ridge fit's
        # maps, `fit.RidgeSolution`; this mapper moved by `to`) is not copied
        if self._dense and self.joint_inputs:
            # [2·Ls·Fs, 2·Lt·Ft]: K and V of every target layer from all source K and V in one GEMM
            self._dense_weight = weight.permute(2, 0, 1, 3).reshape(expected[2], -1).contiguous()
            self.weight = self._dense_weight.view(expected[2], 2, expected[1], expected[3]).permute(1, 2, 0, 3)
            self._dense_bias = self.bias.reshape(-1)
        elif self._dense:
            # [2, Ls·Fs, Lt·Ft]: all target layers of one modality in one GEMM. `weight` becomes a view of it,
            # so the mapper holds its parameters once.
            self._dense_weight = weight.permute(0, 2, 1, 3).reshape(2, expected[2], -1).contiguous()
            self.weight = self._dense_weight.view(2, expected[2], expected[1], expected[3]).permute(0, 2, 1, 3)
            self._dense_bias = self.bias.reshape(2, -1)
        else:
            self.weight = weight.contiguous()
            self._flat_weight = self.weight.reshape(-1, *expected[2:])
        self._rope_tables: dict = {}  # (side, seq_len or None) → (cos, sin, scaling), see _cos_sin

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the map's GEMM runs in (float32 unless `to` changed it)."""
        return self.weight.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Mapper:
        """Move the mapper's tensors to ``device`` and/or cast them to the floating ``dtype`` (in place; returns
        the mapper). `transfer` then runs its GEMM in that dtype on that device; RoPE is stripped and applied
        in float32 whatever the dtype."""
        check_mapper_dtype(dtype)
        self._lay_out(self.weight.to(device=device, dtype=dtype), self.bias.to(device=device, dtype=dtype))
        return self

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def top_k(self) -> int:
        return int(self.selected.shape[1])

    @property
    def exact_prefix(self) -> int:
        """Leading tokens the target should recompute at handoff (the fit config's exact_prefix)."""
        return self.manifest.exact_prefix

    @property
    def recompute(self) -> str:
        """The handoffs' default selective-recompute policy spec (the fit config's recompute;
        `config.DEFAULT_RECOMPUTE` unless set)."""
        return self.manifest.config.recompute

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The map's fitted tensors (what `num_parameters` counts; a subclass with another layout overrides it)."""
        return [self.weight, self.bias]

    def index_tensors(self) -> list[torch.Tensor]:
        """Integer tensors the map reads beside its parameters (counted by `nbytes`, not `num_parameters`)."""
        return []

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

    def flops_per_token(self) -> int:
        """Floating-point operations of mapping one token's K/V (multiply-adds of the GEMMs ×2, plus the bias)."""
        return 2 * self.weight.numel() + self.bias.numel()

    def map_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weight, bias) tensors the map reads, in their applied layout. `weight` and `bias` share their
        storage, so training these in place (`refine.refine_mapper`) changes the mapper."""
        if self._dense:
            return self._dense_weight, self._dense_bias
        return self._flat_weight, self.bias

    # -- application ------------------------------------------------------------------------------
    def _check_source(self, layers: int, heads: int, head_dim: int) -> None:
        src = self.source
        if (layers, heads, head_dim) != (src.num_layers, src.num_kv_heads, src.head_dim):
            raise MapperMismatchError(
                f"source cache has {layers} layers × {heads} KV heads × head dim {head_dim}, "
                f"but this mapper was fitted for {src.num_layers} × {src.num_kv_heads} × {src.head_dim}: "
                "load the mapper fitted for this source model"
            )

    def map_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Content-space source K/V as token rows x [2, B, T, Ls, Hs, Ds] (float32, contiguous) → target
        K/V as a float32 view [2, B, T, Lt, Ht, Dt] of one batched GEMM's output."""
        src, tgt = self.source, self.target
        _, batch, tokens = x.shape[:3]
        rows = batch * tokens
        if self._dense and self.joint_inputs:
            joint = x.view(2, rows, -1).transpose(0, 1).reshape(rows, -1)  # [N, K of all layers ‖ V of all layers]
            y = torch.addmm(self._dense_bias, joint, self._dense_weight)
            return y.view(batch, tokens, 2, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim).permute(2, 0, 1, 3, 4, 5)
        if self._dense:
            y = torch.baddbmm(self._dense_bias[:, None], x.view(2, rows, -1), self._dense_weight)
            return y.view(2, batch, tokens, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim)
        gathered = x.view(2, rows, src.num_layers, src.layer_width)[:, :, self.selected]  # [2, N, Lt, k, Fs]
        if self.joint_inputs:  # both maps of a target layer read [its K block ‖ its V block]
            joint = gathered.permute(2, 1, 0, 3, 4).reshape(tgt.num_layers, rows, -1)
            gathered = torch.cat([joint, joint])
        else:
            gathered = gathered.transpose(1, 2).reshape(2 * tgt.num_layers, rows, -1)
        y = torch.baddbmm(self.bias.reshape(2 * tgt.num_layers, 1, -1), gathered, self._flat_weight)
        y = y.view(2, tgt.num_layers, batch, tokens, tgt.num_kv_heads, tgt.head_dim)
        return y.permute(0, 2, 3, 1, 4, 5)

    @torch.no_grad()
    def map_feature_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Calibration-layout rows (`FeatureLayout`: K then V of every source layer) [n, source width] → target
        rows [n, target width], content space."""
        src = self.source
        grid = x.to(self.device, self.dtype).view(-1, 2, src.num_layers, src.num_kv_heads, src.head_dim)
        y = self.map_rows(grid.transpose(0, 1).unsqueeze(1).contiguous())  # [2, 1, n, Lt, Ht, Dt]
        return y.permute(1, 2, 0, 3, 4, 5).reshape(x.shape[0], -1).float()

    @torch.inference_mode()
    def map_content(self, content: ContentKV) -> ContentKV:
        """Map content-space source K/V [Ls, B, Hs, T, Ds] to content-space target K/V [Lt, B, Ht, T, Dt]."""
        layers, _, heads, _, head_dim = content.keys.shape
        self._check_source(layers, heads, head_dim)
        # [2, Ls, B, Hs, T, Ds] → token rows [2, B, T, Ls, Hs, Ds]: the permute and the float cast in one copy
        batch, tokens = content.keys.shape[1], content.keys.shape[3]
        rows = torch.empty(2, batch, tokens, layers, heads, head_dim, dtype=self.dtype, device=self.device)
        rows.copy_(torch.stack([content.keys, content.values]).permute(0, 2, 4, 1, 3, 5))
        y = self.map_rows(rows).permute(0, 3, 1, 4, 2, 5)  # [2, Lt, B, Ht, T, Dt]
        return ContentKV(keys=y[0], values=y[1])

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
    def transfer(
        self,
        source_cache,
        position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DynamicCache:
        """Turn a source `transformers` cache into a target `DynamicCache` for the same positions.

        position_ids: [batch, tokens] (or [tokens]) positions of the cached tokens (default 0..T−1).
        dtype: dtype of the returned cache (default: the source cache's dtype).

        Same arithmetic as `cache_to_content` → `map_content` → `apply_rope`, laid out for speed: RoPE
        cos/sin tables are cached per mapper, the source cache is gathered in one copy and de-rotated in
        place, the GEMM output is rotated straight into the target cache's buffers, and the DynamicCache
        layers are views of two buffers (no per-layer concatenation). RoPE is stripped and applied in float32;
        the GEMM runs in the mapper's dtype (float32 unless `to` changed it). Refused: positions past the
        target's context window, a cache on another device than the mapper, NaN/Inf in the cache.
        """
        layers = source_cache.layers
        keys0 = layers[0].keys
        _, heads, tokens, head_dim = keys0.shape
        self._check_source(len(layers), heads, head_dim)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        self.check_context(tokens if position_ids is None else int(position_ids.max()) + 1)
        if keys0.device != self.device:
            raise ConfigError(
                f"the source cache is on {keys0.device}, the mapper on {self.device}: move the mapper with "
                f"mapper.to({str(keys0.device)!r})"
            )
        x = self._content_rows(layers, position_ids)
        y = self.map_rows(x.to(self.dtype))  # [2, B, T, Lt, Ht, Dt]
        return self._target_cache(y, position_ids, dtype or keys0.dtype)

    def _content_rows(self, layers, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The source cache gathered straight into GEMM rows [2, B, T, Ls, Hs, Ds] (cache dtype), RoPE stripped
        in place; NaN/Inf refused with the layer named."""
        src = self.source
        keys0 = layers[0].keys
        batch, heads, tokens, head_dim = keys0.shape
        x = torch.empty(2, batch, tokens, src.num_layers, heads, head_dim, dtype=keys0.dtype, device=keys0.device)
        torch.stack([layer.keys.transpose(1, 2) for layer in layers], dim=2, out=x[0])
        torch.stack([layer.values.transpose(1, 2) for layer in layers], dim=2, out=x[1])
        if not all_finite(x):
            bad = nonfinite_layers(x, dim=3)
            raise NonFiniteError(
                f"the source cache holds NaN/Inf in layer(s) {bad}: the source model's prefill overflowed (e.g. in "
                "float16); prefill in bfloat16 or float32 and hand off again"
            )
        cos, sin, scaling = self._cos_sin("source", position_ids, tokens)  # [b, T, R]
        rotary = cos.shape[-1]
        keys = x[0, ..., :rotary]
        content = _rotate(keys.float(), cos[:, :, None, None], sin[:, :, None, None], inverse=True)
        if scaling != 1.0:  # x / 1 is exact: skipping it changes nothing
            content = content / (scaling * scaling)
        keys.copy_(content)  # rounds to the cache dtype, as strip_rope does
        return x

    def _target_cache(self, y: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype) -> DynamicCache:
        """Rotate the mapped rows y [2, B, T, Lt, Ht, Dt] into the target cache's buffers [Lt, B, Ht, T, Dt]."""
        tgt = self.target
        batch, tokens = y.shape[1:3]
        shape = (tgt.num_layers, batch, tgt.num_kv_heads, tokens, tgt.head_dim)
        out_keys = torch.empty(shape, dtype=dtype, device=y.device)
        out_values = torch.empty(shape, dtype=dtype, device=y.device)
        out_values.permute(1, 3, 0, 2, 4).copy_(y[1])
        cos, sin, _ = self._cos_sin("target", position_ids, tokens)
        rotary = cos.shape[-1]
        rotated = _rotate(y[0][..., :rotary].float(), cos[:, :, None, None], sin[:, :, None, None], inverse=False)
        keys_view = out_keys.permute(1, 3, 0, 2, 4)  # [B, T, Lt, Ht, Dt]
        keys_view[..., :rotary].copy_(rotated)
        if rotary < tgt.head_dim:
            keys_view[..., rotary:].copy_(y[0][..., rotary:])
        return cache_of(zip(out_keys.unbind(0), out_values.unbind(0), strict=True))

    def _cos_sin(
        self, side: str, positions: torch.Tensor | None, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Scaled cos/sin [b, T, rotary_dim] for integer positions [b, T] (None: 0..tokens−1) and the
        attention scaling, from a per-mapper table.

        Table rows are exactly what `rope.apply_rope` computes for each position (the op is elementwise);
        rope types whose frequencies depend on the sequence length (dynamic, longrope) get a table per length.
        """
        seq_len = tokens if positions is None else int(positions.max()) + 1
        config = self._rope_configs()[0 if side == "source" else 1]
        device = self.device
        fixed = config.rope_parameters.get("rope_type", "default") in _SEQ_LEN_FREE_ROPE
        key = (side, None if fixed else seq_len)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < seq_len:
            inv_freq, scaling = rope_frequencies(config, seq_len=seq_len)
            length = -(-seq_len // 1024) * 1024 if fixed else seq_len
            angles = torch.arange(length, device=device).to(torch.float32)[:, None] * inv_freq.to(device)
            emb = torch.cat((angles, angles), dim=-1)
            table = (emb.cos() * scaling, emb.sin() * scaling, scaling)
            if not fixed:  # keep one length-dependent table per side
                self._rope_tables = {k: v for k, v in self._rope_tables.items() if k[0] != side}
            self._rope_tables[key] = table
        cos_table, sin_table, scaling = table
        if positions is None:
            return cos_table[None, :tokens], sin_table[None, :tokens], scaling
        return cos_table[positions], sin_table[positions], scaling

    def _rope_configs(self):
        """Minimal configs carrying each side's RoPE parameters, for transformers' rope initialisers."""
        if not hasattr(self, "_rope_config_cache"):
            self._rope_config_cache = tuple(self.manifest.rope_config(side) for side in ("source", "target"))
        return self._rope_config_cache

    # -- persistence ------------------------------------------------------------------------------
    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors `save` writes (a subclass with another layout overrides this and `from_tensors`)."""
        return {"weight": self.weight, "bias": self.bias, "selected": self.selected, **self.extra_tensors()}

    def stored(self) -> Mapper:
        """This mapper as its saved file will hold it: weight tensors rounded to the fit config's storage dtype
        (itself when that is float32), so a fitted mapper behaves exactly like the one loaded back."""
        dtype = storage_dtype(self.manifest)
        if dtype == torch.float32:
            return self
        tensors = {name: _to_storage(name, tensor.detach().cpu(), dtype).to(tensor.device)
                   for name, tensor in self.saved_tensors().items()}
        return type(self).from_tensors(tensors, self.manifest)

    def save(self, path: str | Path) -> Path:
        """Write `mapper.safetensors` + `manifest.json` into directory `path`, atomically.

        The new mapper is written beside the old one and swapped in by rename (`files.atomic_folder`), so an
        interrupted save never leaves a half-written mapper where a good one was, nor loses the old one. Weight
        tensors are written in the fit config's `storage_dtype` (biases and indices as they are). The manifest
        records the tensor file's sha256, what the tensors take (`storage`: parameters, bytes) and a checksum
        over itself. A mapper with NaN/Inf weights (or weights past the storage dtype's range) is refused
        (nothing is written).
        """
        path = Path(path)
        dtype = storage_dtype(self.manifest)
        tensors = {name: _to_storage(name, tensor.detach().to("cpu"), dtype).contiguous()
                   for name, tensor in self.saved_tensors().items()}
        for name, tensor in tensors.items():
            if not all_finite(tensor):
                # the linear map is [K|V, target layer, ...]; a subclass's tensors are [target layer, ...]
                axis = 1 if name in ("weight", "bias") else 0
                where = f"target layer(s) {nonfinite_layers(tensor, dim=axis)}" if tensor.dim() > 2 else name
                raise NonFiniteError(
                    f"the mapper's {name} holds NaN/Inf ({where}) as {tensor.dtype}: it is not saved; re-fit "
                    "it (check the calibration data for NaN/Inf, raise ridge_lambda; float16 storage overflows past "
                    "65504: store bfloat16 or float32)"
                )
        floats = [t for t in tensors.values() if t.is_floating_point()]
        with atomic_folder(path) as staging:
            save_file(tensors, str(staging / TENSOR_FILE))
            storage = {"parameters": sum(t.numel() for t in floats),
                       "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                       "file_bytes": (staging / TENSOR_FILE).stat().st_size,
                       "weight_dtype": str(dtype).removeprefix("torch.")}
            manifest = dataclasses.replace(self.manifest, tensor_sha256=sha256_file(staging / TENSOR_FILE),
                                           storage=storage)
            (staging / MANIFEST_FILE).write_text(dumps(manifest))
        self.manifest = manifest
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        source_model=None,
        target_model=None,
        source_tokenizer=None,
        target_tokenizer=None,
        lazy: bool = False,
    ) -> Mapper:
        """Load a saved mapper; with models given, verify it was fitted for exactly this pair. Never runs code.

        An interrupted save is finished first (`files.recover_folder`): the good copy is what loads. The manifest
        (and its checksum) is always read and checked here. lazy: the tensors are read only at the mapper's first
        use (a router holding several mappers pays for the ones it uses); the tensor file's size is checked now
        against the manifest's `storage` record and its sha256 at that first use, before any tensor is read —
        a damaged file then raises MapperFormatError from the first transfer instead of from `load`.
        """
        path = Path(path)
        recover_folder(path)
        manifest_path, tensor_path = path / MANIFEST_FILE, path / TENSOR_FILE
        if not manifest_path.is_file() or not tensor_path.is_file():
            raise MapperFormatError(
                f"{path} is not a saved mapper (needs {MANIFEST_FILE} and {TENSOR_FILE}); "
                "fit one with `kvhandoff fit --source ... --target ... --out DIR`"
            )
        manifest = loads(manifest_path.read_text(), str(manifest_path))
        kind = mapper_class(manifest.method, str(path))
        if lazy:
            mapper = kind.__new__(kind)
            mapper._adopt_manifest(manifest)
            _check_file_size(tensor_path, manifest)
            mapper._pending = tensor_path
        else:
            mapper = kind.from_tensors(_read_tensors(tensor_path, manifest), manifest)
        mapper.verify_pair(source_model, target_model, source_tokenizer, target_tokenizer)
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
        verified = self._verified
        built = type(self).from_tensors(_read_tensors(self.__dict__["_pending"], self.manifest), self.manifest)
        del self.__dict__["_pending"]  # only now: a damaged file keeps raising MapperFormatError at every use
        self.__dict__.update(built.__dict__)
        self._verified = verified  # the models already checked stay checked

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> Mapper:
        """The mapper of a saved file's tensors (what `save` wrote: weight, bias, selected, `extra_tensors`)."""
        missing = [name for name in ("weight", "bias", "selected") if name not in tensors]
        if missing:
            raise MapperFormatError(f"the mapper file lacks tensors {missing}; re-fit the mapper")
        return cls(tensors["weight"], tensors["bias"], tensors["selected"], manifest)

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors a subclass saves beside the linear map's."""
        return {}

    # -- pairing ----------------------------------------------------------------------------------
    def check_models(self, source_model=None, target_model=None) -> None:
        """`verify_pair` for these models, once per (mapper, model): the hot path (`handoff_cache`, `catch_up`,
        `SwitchingSession`) calls it every time and fingerprints a model only the first time it sees it."""
        for side, model in (("source", source_model), ("target", target_model)):
            if model is None or model in self._verified[side]:
                continue
            self.verify_pair(**{f"{side}_model": model})
            self._verified[side].add(model)

    def verify_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None):
        """Raise MapperMismatchError unless the given models (and tokenizers) are the ones fitted for."""
        for side, model, tokenizer in (
            ("source", source_model, source_tokenizer),
            ("target", target_model, target_tokenizer),
        ):
            if model is None:
                continue
            expected = getattr(self.manifest, f"{side}_fingerprint")
            actual = model_fingerprint(model, tokenizer)
            for key in PAIRING_KEYS:
                if key == "tokenizer_hash" and (actual[key] is None or expected.get(key) is None):
                    continue
                same = (
                    signatures_match(actual[key], expected.get(key) or [])
                    if key == "weight_signature"
                    else actual[key] == expected.get(key)
                )
                if not same:
                    raise MapperMismatchError(
                        f"this mapper was fitted for a different {side} model ({key} differs: fitted "
                        f"{_short(expected.get(key))}, given {_short(actual[key])}); load the mapper fitted for "
                        f"this pair or fit one with `kvhandoff fit`"
                    )


#: mapper classes by the manifest's ``method``; a method defined in another module registers itself there
MAPPER_METHODS: dict[str, type[Mapper]] = {"ridge": Mapper, "synthetic": Mapper}


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


_SEQ_LEN_FREE_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x·cos ± rotate_half(x)·sin written per half (negation is exact, so this equals `rope.apply_rope` /
    the numerator of `rope.strip_rope` bit for bit, without materialising rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    if inverse:  # (x·cos − rotate_half(x)·sin): first half + x2·sin1, second half − x1·sin2
        out[..., :half] += x2 * sin[..., :half]
        out[..., half:] -= x1 * sin[..., half:]
    else:
        out[..., :half] -= x2 * sin[..., :half]
        out[..., half:] += x1 * sin[..., half:]
    return out


def storage_dtype(manifest: MapperManifest) -> torch.dtype:
    """The dtype a mapper's weight tensors are saved in (its fit config's `storage_dtype`)."""
    return getattr(torch, manifest.config.storage_dtype)


def _to_storage(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weight tensors (named ``weight`` or ``….weight``, ``projection``) in ``dtype``; everything else as is."""
    if tensor.is_floating_point() and name.rsplit(".", 1)[-1] in ("weight", "projection"):
        return tensor.to(dtype)
    return tensor


def _check_file_size(tensor_path: Path, manifest: MapperManifest) -> None:
    recorded = (manifest.storage or {}).get("file_bytes")
    if recorded is not None and tensor_path.stat().st_size != recorded:
        raise MapperFormatError(
            f"{tensor_path} does not match its manifest ({tensor_path.stat().st_size} bytes, the manifest records "
            f"{recorded}): the file is truncated or was edited; re-fit the mapper or restore it from a backup"
        )


def _read_tensors(tensor_path: Path, manifest: MapperManifest) -> dict[str, torch.Tensor]:
    """The saved tensors, after checking the file against the manifest's size and sha256."""
    _check_file_size(tensor_path, manifest)
    if sha256_file(tensor_path) != manifest.tensor_sha256:
        raise MapperFormatError(
            f"{tensor_path} does not match the checksum in its manifest: the file is truncated or was "
            "edited; re-fit the mapper or restore it from a backup"
        )
    with safe_open(str(tensor_path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
