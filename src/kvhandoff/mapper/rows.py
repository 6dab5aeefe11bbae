"""Between a model pair's caches and a mapper's token rows (`TokenRows`): what a mapper maps is content-space token
rows [2, B, T, L, H, D] (K then V); a cache holds keys after RoPE, per layer [B, H, T, D]."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvhandoff.errors import ConfigError, MapperMismatchError, NonFiniteError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.model.cache import cache_of
from kvhandoff.model.capture import ContentKV, FeatureLayout, all_finite, nonfinite_layers
from kvhandoff.model.rope import RopeTable, rotate


class TokenRows:
    """A mapper's source and target layouts and the conversions of its inputs into token rows and of its outputs
    out of them: a source cache, a content-space capture (`ContentKV`) or calibration-layout feature rows in; a
    target `DynamicCache`, a capture or feature rows out.

    Laid out for speed where a cache is converted (`Mapper.transfer`): RoPE cos/sin tables are kept per side (made at
    the first transfer: a mapper solved from statistics alone has none, and its manifest may carry no RoPE), the
    source cache is gathered in one copy and de-rotated in place, the mapped rows are rotated straight into the
    target cache's buffers, and the DynamicCache layers are views of two buffers (no per-layer concatenation). RoPE
    is stripped and applied in float32, whatever the dtype the map runs in.
    """

    def __init__(self, source: FeatureLayout, target: FeatureLayout) -> None:
        self.source, self.target = source, target
        self._rope_tables: dict[str, RopeTable] = {}

    def check_source(self, layers: int, heads: int, head_dim: int) -> None:
        """MapperMismatchError unless a source cache or capture of this shape is the one the mapper was fitted for."""
        src = self.source
        if (layers, heads, head_dim) != (src.num_layers, src.num_kv_heads, src.head_dim):
            raise MapperMismatchError(
                f"source cache has {layers} layers × {heads} KV heads × head dim {head_dim}, "
                f"but this mapper was fitted for {src.num_layers} × {src.num_kv_heads} × {src.head_dim}: "
                "load the mapper fitted for this source model"
            )

    # -- feature rows and captures ----------------------------------------------------------------
    def from_features(self, x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Calibration-layout rows (`FeatureLayout`: K then V of every source layer) [n, source width] → token rows
        [2, 1, n, Ls, Hs, Ds] on ``device`` in ``dtype``."""
        src = self.source
        grid = x.to(device, dtype).view(-1, 2, src.num_layers, src.num_kv_heads, src.head_dim)
        return grid.transpose(0, 1).unsqueeze(1).contiguous()

    @staticmethod
    def to_features(y: torch.Tensor) -> torch.Tensor:
        """Mapped token rows [2, 1, n, Lt, Ht, Dt] → calibration-layout target rows [n, target width], float32."""
        return y.permute(1, 2, 0, 3, 4, 5).reshape(y.shape[2], -1).float()

    def from_content(self, content: ContentKV, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Content-space source K/V [Ls, B, Hs, T, Ds] (of the shape `check_source` accepts) → token rows
        [2, B, T, Ls, Hs, Ds] on ``device`` in ``dtype``: the permute and the cast in one copy."""
        layers, batch, heads, tokens, head_dim = content.keys.shape
        rows = torch.empty(2, batch, tokens, layers, heads, head_dim, dtype=dtype, device=device)
        rows.copy_(torch.stack([content.keys, content.values]).permute(0, 2, 4, 1, 3, 5))
        return rows

    @staticmethod
    def to_content(y: torch.Tensor) -> ContentKV:
        """Mapped token rows [2, B, T, Lt, Ht, Dt] → content-space target K/V [Lt, B, Ht, T, Dt] (views)."""
        y = y.permute(0, 3, 1, 4, 2, 5)  # [2, Lt, B, Ht, T, Dt]
        return ContentKV(keys=y[0], values=y[1])

    # -- caches -----------------------------------------------------------------------------------
    def from_cache(self, layers, position_ids: torch.Tensor | None, manifest: MapperManifest,
                   device: torch.device) -> torch.Tensor:
        """The source cache's ``layers`` gathered straight into token rows [2, B, T, Ls, Hs, Ds] (cache dtype), RoPE
        (``manifest``'s, tables on ``device``, the mapper's) stripped in place. Refused: a cache on another device
        than the mapper (ConfigError), NaN/Inf (the layer named)."""
        src = self.source
        keys0 = layers[0].keys
        if keys0.device != device:
            raise ConfigError(
                f"the source cache is on {keys0.device}, the mapper on {device}: move the mapper with "
                f"mapper.to({str(keys0.device)!r})"
            )
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
        cos, sin, scaling = self._rope("source", manifest).lookup(position_ids, tokens, device)  # [b, T, R]
        rotary = cos.shape[-1]
        keys = x[0, ..., :rotary]
        content = rotate(keys.float(), cos[:, :, None, None], sin[:, :, None, None], inverse=True)
        if scaling != 1.0:  # x / 1 is exact: skipping it changes nothing
            content = content / (scaling * scaling)
        keys.copy_(content)  # rounds to the cache dtype, as strip_rope does
        return x

    def to_cache(self, y: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype,
                 manifest: MapperManifest, device: torch.device) -> DynamicCache:
        """Rotate the mapped rows y [2, B, T, Lt, Ht, Dt] into the target cache's buffers [Lt, B, Ht, T, Dt] of
        ``dtype`` (``manifest``'s RoPE, tables on ``device``)."""
        tgt = self.target
        batch, tokens = y.shape[1:3]
        shape = (tgt.num_layers, batch, tgt.num_kv_heads, tokens, tgt.head_dim)
        out_keys = torch.empty(shape, dtype=dtype, device=y.device)
        out_values = torch.empty(shape, dtype=dtype, device=y.device)
        out_values.permute(1, 3, 0, 2, 4).copy_(y[1])
        cos, sin, _ = self._rope("target", manifest).lookup(position_ids, tokens, device)
        rotary = cos.shape[-1]
        rotated = rotate(y[0][..., :rotary].float(), cos[:, :, None, None], sin[:, :, None, None])
        keys_view = out_keys.permute(1, 3, 0, 2, 4)  # [B, T, Lt, Ht, Dt]
        keys_view[..., :rotary].copy_(rotated)
        if rotary < tgt.head_dim:
            keys_view[..., rotary:].copy_(y[0][..., rotary:])
        return cache_of(zip(out_keys.unbind(0), out_values.unbind(0), strict=True))

    def _rope(self, side: str, manifest: MapperManifest) -> RopeTable:
        """``side``'s RoPE table, made at the first transfer from ``manifest`` (the mapper's manifest then)."""
        if side not in self._rope_tables:
            self._rope_tables[side] = RopeTable(manifest.rope_config(side))
        return self._rope_tables[side]
