"""A mapper folder on disk: `mapper.safetensors` (the tensors, never a pickle) beside `manifest.json`.

Writes are atomic (`files.atomic_folder`; a manifest rewritten on its own, `write_manifest`, by `files.atomic_path`'s
temporary file renamed over it); reads finish an interrupted write first (`files.recover_folder`) and check the
tensor file against the manifest's size record and sha256 before a tensor is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvhandoff.errors import MapperFormatError, NonFiniteError
from kvhandoff.files import atomic_folder, atomic_write_text, recover_folder, sha256_file
from kvhandoff.mapper.manifest import MapperManifest, dumps, loads
from kvhandoff.model.capture import all_finite, nonfinite_layers

TENSOR_FILE = "mapper.safetensors"
MANIFEST_FILE = "manifest.json"


def storage_dtype(manifest: MapperManifest) -> torch.dtype:
    """The dtype a mapper's weight tensors are saved in (its fit config's `storage_dtype`)."""
    return getattr(torch, manifest.config.storage_dtype)


def to_storage(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weight tensors (named ``weight`` or ``….weight``, ``projection``) in ``dtype``; everything else as is."""
    if tensor.is_floating_point() and name.rsplit(".", 1)[-1] in ("weight", "projection"):
        return tensor.to(dtype)
    return tensor


def require_tensors(tensors: dict[str, torch.Tensor], names: Iterable[str], what: str) -> None:
    """MapperFormatError unless ``tensors`` holds every one of ``names`` (``what``: the mapper, for the message)."""
    missing = [name for name in names if name not in tensors]
    if missing:
        raise MapperFormatError(f"the {what} file lacks tensors {missing}; re-fit the mapper")


def refuse_nonfinite(tensors: dict[str, torch.Tensor], layer_axis: Callable[[str], int | None]) -> None:
    """NonFiniteError naming the first tensor that holds NaN/Inf, and its target layers where ``layer_axis(name)``
    says which axis indexes them."""
    for name, tensor in tensors.items():
        if all_finite(tensor):
            continue
        axis = layer_axis(name)
        where = f"target layer(s) {nonfinite_layers(tensor, dim=axis)}" if axis is not None else name
        raise NonFiniteError(
            f"the mapper's {name} holds NaN/Inf ({where}) as {tensor.dtype}: it is not saved; re-fit it (check the "
            "calibration data for NaN/Inf, raise ridge_lambda; float16 storage overflows past 65504: store bfloat16 "
            "or float32)"
        )


def storage_copies(tensors: dict[str, torch.Tensor], manifest: MapperManifest) -> dict[str, torch.Tensor]:
    """``tensors`` as a saved file holds them, each on its own device: weight tensors rounded to the fit config's
    storage dtype (`to_storage`), so that a fitted mapper behaves exactly like the one loaded back."""
    dtype = storage_dtype(manifest)
    return {name: to_storage(name, tensor.detach().cpu(), dtype).to(tensor.device) for name, tensor in tensors.items()}


def write_mapper(path: Path, tensors: dict[str, torch.Tensor], manifest: MapperManifest,
                 layer_axis: Callable[[str], int | None]) -> MapperManifest:
    """Write a mapper's ``tensors`` (`Mapper.saved_tensors`) and ``manifest`` into folder ``path``, atomically
    (`write_folder`); returns the manifest as written.

    The new mapper is written beside the old one and swapped in by rename (`files.atomic_folder`), so an
    interrupted save never leaves a half-written mapper where a good one was, nor loses the old one. Weight tensors
    are written in the fit config's `storage_dtype` (biases and indices as they are). The manifest records the
    tensor file's sha256, what the tensors take (`storage`: parameters, bytes) and a checksum over itself. Tensors
    with NaN/Inf (or weights past the storage dtype's range) are refused (`refuse_nonfinite`, naming target layers
    by ``layer_axis``): nothing is written."""
    dtype = storage_dtype(manifest)
    stored = {name: to_storage(name, tensor.detach().to("cpu"), dtype).contiguous() for name, tensor in tensors.items()}
    refuse_nonfinite(stored, layer_axis)
    return write_folder(path, stored, manifest, dtype)


def write_folder(path: Path, tensors: dict[str, torch.Tensor], manifest: MapperManifest,
                 dtype: torch.dtype) -> MapperManifest:
    """Write ``tensors`` (CPU, contiguous, as stored) and ``manifest`` into folder ``path`` atomically; returns the
    manifest as written: with the tensor file's sha256 and the `storage` record (parameters, bytes, weight dtype)."""
    floats = [t for t in tensors.values() if t.is_floating_point()]
    with atomic_folder(path) as staging:
        save_file(tensors, str(staging / TENSOR_FILE))
        storage = {"parameters": sum(t.numel() for t in floats),
                   "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                   "file_bytes": (staging / TENSOR_FILE).stat().st_size,
                   "weight_dtype": str(dtype).removeprefix("torch.")}
        manifest = dataclasses.replace(manifest, tensor_sha256=sha256_file(staging / TENSOR_FILE), storage=storage)
        (staging / MANIFEST_FILE).write_text(dumps(manifest))
    return manifest


def read_manifest(path: Path) -> tuple[MapperManifest, Path]:
    """The checked manifest of the mapper folder ``path`` and its tensor file's path (an interrupted save is
    finished first, so the good copy is what reads)."""
    recover_folder(path)
    manifest_path, tensor_path = path / MANIFEST_FILE, path / TENSOR_FILE
    if not manifest_path.is_file() or not tensor_path.is_file():
        raise MapperFormatError(
            f"{path} is not a saved mapper (needs {MANIFEST_FILE} and {TENSOR_FILE}); "
            "fit one with `kvhandoff fit --source ... --target ... --out DIR`"
        )
    return loads(manifest_path.read_text(), str(manifest_path)), tensor_path


def write_manifest(path: Path, manifest: MapperManifest) -> MapperManifest:
    """Replace the manifest of the saved mapper in folder ``path`` by ``manifest`` — the same mapper with other
    records (e.g. its guard): its tensor record (`tensor_sha256`, `storage`) must equal the folder's. Atomic
    (`files.atomic_write_text`: a temporary file in the folder, renamed over `manifest.json`): a reader sees the
    old manifest or the new one, an interrupted write leaves the old one; the tensor file is not touched."""
    current, _ = read_manifest(path)
    if (manifest.tensor_sha256, manifest.storage) != (current.tensor_sha256, current.storage):
        raise MapperFormatError(
            f"{path} holds other tensors than this manifest describes (the mapper was re-fitted or replaced); "
            "nothing written: load the mapper again and record what is measured for it"
        )
    atomic_write_text(path / MANIFEST_FILE, dumps(manifest))
    return manifest


def record_manifest(folder: Path | None, manifest: MapperManifest, what: str) -> MapperManifest:
    """`write_manifest` for a mapper saved in ``folder``; MapperFormatError naming ``what`` it records when the mapper
    is only in memory (no folder)."""
    if folder is None:
        raise MapperFormatError(f"this mapper is not saved (no folder): save it (`Mapper.save`) before recording "
                                f"{what}")
    return write_manifest(folder, manifest)


def check_file_size(tensor_path: Path, manifest: MapperManifest) -> None:
    """MapperFormatError when the tensor file's size differs from the manifest's record (a cheap check, no read)."""
    recorded = (manifest.storage or {}).get("file_bytes")
    if recorded is not None and tensor_path.stat().st_size != recorded:
        raise MapperFormatError(
            f"{tensor_path} does not match its manifest ({tensor_path.stat().st_size} bytes, the manifest records "
            f"{recorded}): the file is truncated or was edited; re-fit the mapper or restore it from a backup"
        )


def read_tensors(tensor_path: Path, manifest: MapperManifest) -> dict[str, torch.Tensor]:
    """The saved tensors, after checking the file against the manifest's size and sha256."""
    check_file_size(tensor_path, manifest)
    if sha256_file(tensor_path) != manifest.tensor_sha256:
        raise MapperFormatError(
            f"{tensor_path} does not match the checksum in its manifest: the file is truncated or was "
            "edited; re-fit the mapper or restore it from a backup"
        )
    with safe_open(str(tensor_path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


class UnreadTensors:
    """The tensor file of a mapper loaded lazily (`Mapper.load`), read at the mapper's first use: its size is checked
    against the manifest's `storage` record at once (a cheap check, no read), its sha256 when it is read, before any
    tensor is."""

    def __init__(self, path: Path, manifest: MapperManifest) -> None:
        check_file_size(path, manifest)
        self.path = path

    def read(self, manifest: MapperManifest) -> dict[str, torch.Tensor]:
        """The saved tensors (`read_tensors`)."""
        return read_tensors(self.path, manifest)
