"""Files: atomic writes of files and folders, and content hashes. Every saved artefact goes through here.

A reader never sees a half-written file: each write goes to a temporary name beside the destination and is
renamed over it once complete (a rename within one folder is atomic). A folder is published the same way; while
an old folder is being swapped out it lives under a backup name that `recover_folder` (called by every loader)
restores, so an interrupted save never leaves the only good copy under a name no loader reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: suffix of the folder an old copy waits under while a new one is swapped in
BACKUP_SUFFIX = ".previous"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed over ``path``, on error
    removed (``path`` keeps its old content)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON (non-finite floats allowed, as ``json`` writes them)."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def backup_of(folder: Path) -> Path:
    return folder.with_name(folder.name + BACKUP_SUFFIX)


def recover_folder(folder: str | Path) -> None:
    """Finish a folder swap that was interrupted: the backup is the good copy when ``folder`` is missing."""
    folder = Path(folder)
    backup = backup_of(folder)
    if backup.is_dir():
        if folder.exists():
            shutil.rmtree(backup)
        else:
            os.replace(backup, folder)


def staging_folder(folder: str | Path) -> Path:
    """A new empty folder beside ``folder`` to build its next content in; `publish_folder` swaps it in."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(folder)
    return Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".staging", dir=folder.parent))


def publish_folder(staging: Path, folder: str | Path) -> Path:
    """Replace ``folder`` by ``staging``; the old folder waits under `backup_of` until the swap is done."""
    folder = Path(folder)
    backup = backup_of(folder)
    if folder.exists():
        os.replace(folder, backup)
    os.replace(staging, folder)
    if backup.exists():
        shutil.rmtree(backup)
    return folder


@contextlib.contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder beside ``folder``; on success it replaces ``folder`` (`publish_folder`), on
    error it is removed and ``folder`` stays as it was."""
    staging = staging_folder(folder)
    try:
        yield staging
        publish_folder(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes, length: int | None = None) -> str:
    """Hex sha256 of ``data``, cut to ``length`` characters when given."""
    return hashlib.sha256(data).hexdigest()[:length]


def sha256_json(obj: Any, length: int | None = None) -> str:
    """Hash of ``obj`` as canonical JSON (sorted keys; values JSON cannot hold are written with ``str``)."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return sha256_bytes(text.encode("utf-8"), length)
