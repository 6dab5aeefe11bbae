"""The fitted mapper: source cache → target cache (strip source RoPE → linear map → apply target RoPE).

Tensors are laid out once, at construction, for the hot path: K and V maps of all target layers are one
stacked weight [2·target_layers, k·source_features, target_features], applied with a single batched matmul;
when every target layer reads every source layer (k = all) the whole map is one dense GEMM.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from kvhandoff.capture import ContentKV, cache_positions, cache_to_content
from kvhandoff.config import MAPPER_FORMAT_VERSION
from kvhandoff.errors import MapperFormatError, MapperMismatchError
from kvhandoff.geometry import model_fingerprint, signatures_match
from kvhandoff.rope import apply_rope, rope_frequencies
from kvhandoff.statistics import FeatureLayout

TENSOR_FILE = "mapper.safetensors"
MANIFEST_FILE = "manifest.json"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Mapper:
    """A linear content-space map from a source model's KV cache to a target model's.

    weight: [2, target_layers, k · source_kv_features, target_kv_features] (modality K=0, V=1)
    bias:   [2, target_layers, target_kv_features]
    selected: [target_layers, k] source layers feeding each target layer
    manifest: geometry, fingerprints, config, calibration description and fit metrics.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, selected: torch.Tensor, manifest: dict):
        self.manifest = manifest
        self.source = FeatureLayout(**manifest["source_layout"])
        self.target = FeatureLayout(**manifest["target_layout"])
        self.selected = selected.long()
        expected = (
            2,
            self.target.num_layers,
            self.selected.shape[1] * self.source.layer_width,
            self.target.layer_width,
        )
        if tuple(weight.shape) != expected or tuple(bias.shape) != (2, *expected[1:2], expected[3]):
            raise MapperFormatError(
                f"mapper tensors have shapes {tuple(weight.shape)}/{tuple(bias.shape)}, expected {expected}: "
                "the file does not match its manifest; re-fit the mapper"
            )
        self.weight = weight.float().contiguous()
        self.bias = bias.float().contiguous()
        k = self.selected.shape[1]
        self._dense = k == self.source.num_layers and bool(
            (self.selected == torch.arange(self.source.num_layers)).all()
        )
        if self._dense:
            # [2, Ls·Fs, Lt·Ft]: all target layers of one modality in one GEMM
            self._dense_weight = self.weight.permute(0, 2, 1, 3).reshape(2, expected[2], -1).contiguous()
            self._dense_bias = self.bias.reshape(2, -1)
        else:
            self._flat_weight = self.weight.reshape(-1, *expected[2:])
            self._gather = torch.cat([self.selected, self.selected + self.source.num_layers])  # [2Lt, k]

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def top_k(self) -> int:
        return int(self.selected.shape[1])

    def num_parameters(self) -> int:
        return self.weight.numel() + self.bias.numel()

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.bias.numel() * self.bias.element_size()

    # -- application ------------------------------------------------------------------------------
    @torch.inference_mode()
    def map_content(self, content: ContentKV) -> ContentKV:
        """Map content-space source K/V [Ls, B, Hs, T, Ds] to content-space target K/V [Lt, B, Ht, T, Dt]."""
        src, tgt = self.source, self.target
        _, batch, heads, tokens, head_dim = content.keys.shape
        if (content.keys.shape[0], heads, head_dim) != (src.num_layers, src.num_kv_heads, src.head_dim):
            raise MapperMismatchError(
                f"source cache has {content.keys.shape[0]} layers × {heads} KV heads × head dim {head_dim}, "
                f"but this mapper was fitted for {src.num_layers} × {src.num_kv_heads} × {src.head_dim}: "
                "load the mapper fitted for this source model"
            )
        # [2, Ls, B, H, T, D] → [2, Ls, N, H·D] with N = B·T token rows
        x = torch.stack([content.keys, content.values]).float()
        x = x.permute(0, 1, 2, 4, 3, 5).reshape(2, src.num_layers, batch * tokens, src.layer_width)
        if self._dense:
            x = x.permute(0, 2, 1, 3).reshape(2, batch * tokens, -1)
            y = torch.baddbmm(self._dense_bias[:, None], x, self._dense_weight)  # [2, N, Lt·Ft]
            y = y.view(2, batch * tokens, tgt.num_layers, tgt.layer_width).transpose(1, 2)
        else:
            gathered = x.reshape(2 * src.num_layers, batch * tokens, -1)[self._gather]  # [2Lt, k, N, Fs]
            gathered = gathered.transpose(1, 2).reshape(2 * tgt.num_layers, batch * tokens, -1)
            y = torch.baddbmm(self.bias.reshape(2 * tgt.num_layers, 1, -1), gathered, self._flat_weight)
            y = y.view(2, tgt.num_layers, batch * tokens, tgt.layer_width)
        # [2, Lt, N, Ht·Dt] → [2, Lt, B, Ht, T, Dt]
        y = y.reshape(2, tgt.num_layers, batch, tokens, tgt.num_kv_heads, tgt.head_dim).permute(
            0, 1, 2, 4, 3, 5
        )
        return ContentKV(keys=y[0], values=y[1])

    def transfer(
        self,
        source_cache,
        position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DynamicCache:
        """Turn a source `transformers` cache into a target `DynamicCache` for the same positions.

        position_ids: [batch, tokens] positions of the cached tokens (default 0..T−1).
        dtype: dtype of the returned cache (default: the source cache's dtype).
        """
        source_config, target_config = self._rope_configs()
        keys0 = source_cache.layers[0].keys
        batch, tokens = keys0.shape[0], keys0.shape[2]
        if position_ids is None:
            position_ids = cache_positions(tokens, batch)
        mapped = self.map_content(cache_to_content(source_cache, source_config, position_ids))
        inv_freq, scaling = rope_frequencies(target_config, seq_len=int(position_ids.max()) + 1)
        keys = apply_rope(mapped.keys, position_ids, inv_freq, scaling)
        out_dtype = dtype or keys0.dtype
        cache = DynamicCache()
        for layer in range(self.target.num_layers):
            cache.update(keys[layer].to(out_dtype), mapped.values[layer].to(out_dtype), layer)
        return cache

    def _rope_configs(self):
        """Minimal configs carrying each side's RoPE parameters, for transformers' rope initialisers."""
        if not hasattr(self, "_rope_config_cache"):
            from transformers import PretrainedConfig

            configs = []
            for side in ("source", "target"):
                geometry = self.manifest[f"{side}_fingerprint"]["geometry"]
                config = PretrainedConfig()
                config.rope_parameters = json.loads(geometry["rope"]["parameters"])
                config.head_dim = geometry["head_dim"]
                config.hidden_size = geometry["hidden_size"]
                config.num_attention_heads = geometry["num_attention_heads"]
                config.max_position_embeddings = self.manifest[f"{side}_max_position_embeddings"]
                configs.append(config)
            self._rope_config_cache = tuple(configs)
        return self._rope_config_cache

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write `mapper.safetensors` + `manifest.json` into directory `path`, atomically.

        The new mapper is written beside the old one and swapped in by rename, so an interrupted save
        never leaves a half-written mapper where a good one was.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.saving")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        tensors = {"weight": self.weight, "bias": self.bias, "selected": self.selected}
        save_file(tensors, str(staging / TENSOR_FILE))
        manifest = {**self.manifest, "tensor_sha256": _sha256_file(staging / TENSOR_FILE)}
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        staging.rename(path)
        shutil.rmtree(old, ignore_errors=True)
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
    ) -> Mapper:
        """Load a saved mapper; with models given, verify it was fitted for exactly this pair. Never runs code."""
        path = Path(path)
        manifest_path, tensor_path = path / MANIFEST_FILE, path / TENSOR_FILE
        if not manifest_path.is_file() or not tensor_path.is_file():
            raise MapperFormatError(
                f"{path} is not a saved mapper (needs {MANIFEST_FILE} and {TENSOR_FILE}); "
                "fit one with `kvhandoff fit --source ... --target ... --out DIR`"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise MapperFormatError(
                f"{manifest_path} is not valid JSON ({exc}); re-fit or restore the mapper"
            ) from exc
        version = manifest.get("format_version")
        if not isinstance(version, int) or version > MAPPER_FORMAT_VERSION:
            raise MapperFormatError(
                f"{path} has mapper format version {version!r}; this kvhandoff reads versions up to "
                f"{MAPPER_FORMAT_VERSION}: upgrade kvhandoff (`pip install -U kvhandoff`)"
            )
        if _sha256_file(tensor_path) != manifest.get("tensor_sha256"):
            raise MapperFormatError(
                f"{tensor_path} does not match the checksum in its manifest: the file is truncated or was "
                "edited; re-fit the mapper or restore it from a backup"
            )
        with safe_open(str(tensor_path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        mapper = cls(tensors["weight"], tensors["bias"], tensors["selected"], manifest)
        mapper.verify_pair(source_model, target_model, source_tokenizer, target_tokenizer)
        return mapper

    def verify_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None):
        """Raise MapperMismatchError unless the given models (and tokenizers) are the ones fitted for."""
        for side, model, tokenizer in (
            ("source", source_model, source_tokenizer),
            ("target", target_model, target_tokenizer),
        ):
            if model is None:
                continue
            expected = self.manifest[f"{side}_fingerprint"]
            actual = model_fingerprint(model, tokenizer)
            for key in ("architecture", "geometry", "weights_hash", "weight_signature", "tokenizer_hash"):
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


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
