import hashlib
import os

import pytest

from kvhandoff.files import (
    atomic_folder,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    backup_of,
    recover_folder,
    sha256_file,
    sha256_json,
)


def test_atomic_path_keeps_the_old_content_on_error_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("boom")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_text("new")
        assert path.read_text() == "old"  # not visible until the block ends
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["a.txt"]


def test_atomic_write_json_creates_folders_and_writes_indented_json(tmp_path):
    path = tmp_path / "deep" / "er" / "x.json"
    atomic_write_json(path, {"b": 1, "a": [1, 2], "n": float("nan")})
    assert path.read_text() == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ],\n  "n": NaN\n}\n'


def test_atomic_folder_publishes_on_success_and_keeps_the_old_folder_on_error(tmp_path):
    folder = tmp_path / "m"
    with atomic_folder(folder) as staging:
        (staging / "f").write_text("one")
    assert (folder / "f").read_text() == "one" and sorted(os.listdir(tmp_path)) == ["m"]
    with pytest.raises(OSError, match="disk full"), atomic_folder(folder) as staging:
        (staging / "f").write_text("two")
        raise OSError("disk full")
    assert (folder / "f").read_text() == "one" and sorted(os.listdir(tmp_path)) == ["m"]
    with atomic_folder(folder) as staging:
        (staging / "g").write_text("three")
    assert sorted(os.listdir(folder)) == ["g"] and sorted(os.listdir(tmp_path)) == ["m"]


def test_recover_folder_restores_the_backup_only_when_the_folder_is_missing(tmp_path):
    folder = tmp_path / "m"
    backup = backup_of(folder)
    assert backup.name == "m.previous"
    backup.mkdir()
    (backup / "f").write_text("good")
    recover_folder(folder)  # crash between the renames: the backup is the good copy
    assert (folder / "f").read_text() == "good" and not backup.exists()
    backup.mkdir()
    (backup / "f").write_text("stale")
    recover_folder(folder)  # crash after the new folder arrived: the backup is stale
    assert (folder / "f").read_text() == "good" and not backup.exists()
    recover_folder(tmp_path / "nothing")  # nothing to recover: nothing happens
    assert sorted(os.listdir(tmp_path)) == ["m"]
    backup.mkdir()
    (backup / "f").write_text("good again")
    folder.rename(tmp_path / "gone")
    with atomic_folder(folder) as staging:  # a save recovers first, then swaps as usual
        assert (folder / "f").read_text() == "good again"
        (staging / "f").write_text("newest")
    assert (folder / "f").read_text() == "newest" and not backup.exists()


def test_hashes_are_stable_and_canonical(tmp_path):
    assert sha256_json({"a": 1, "b": [1, 2]}) == sha256_json({"b": [1, 2], "a": 1})
    # the hash of the canonical text: sorted keys, json's default separators
    assert sha256_json({"b": 2, "a": 1}) == hashlib.sha256(b'{"a": 1, "b": 2}').hexdigest()
    assert sha256_json({"a": 1}, 12) == sha256_json({"a": 1})[:12]
    assert sha256_json({"a": 1}) != sha256_json({"a": 2}) and sha256_json([1, 2]) != sha256_json([2, 1])
    assert sha256_json({"p": tmp_path}) == sha256_json({"p": str(tmp_path)})  # non-JSON values via str
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
