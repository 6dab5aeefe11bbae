import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from _mapper_support import hand_manifest
from kvhandoff.errors import MapperFormatError, NonFiniteError
from kvhandoff.mapper.manifest import GUARD_RULES, GuardCalibration, RecomputeChoice
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.mapper.storage import (
    MANIFEST_FILE,
    TENSOR_FILE,
    read_manifest,
    read_tensors,
    refuse_nonfinite,
    require_tensors,
    to_storage,
    write_folder,
    write_manifest,
)


def test_only_weights_and_projections_take_the_storage_dtype():
    floats, ints = torch.ones(2), torch.ones(2, dtype=torch.long)
    assert to_storage("weight", floats, torch.float16).dtype == torch.float16
    assert to_storage("blocks.3.weight", floats, torch.float16).dtype == torch.float16
    assert to_storage("projection", floats, torch.bfloat16).dtype == torch.bfloat16
    assert to_storage("bias", floats, torch.float16).dtype == torch.float32
    assert to_storage("mlp.in_scale", floats, torch.float16).dtype == torch.float32
    assert to_storage("weight", ints, torch.float16).dtype == torch.long


def test_missing_and_nonfinite_tensors_are_named():
    with pytest.raises(MapperFormatError, match=r"the block mapper file lacks tensors \['b'\]"):
        require_tensors({"a": torch.zeros(1)}, ("a", "b"), "block mapper")
    bad = torch.zeros(2, 3, 4)
    bad[1, 2, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"the mapper's w holds NaN/Inf \(target layer\(s\) \[2\]\)"):
        refuse_nonfinite({"ok": torch.zeros(2), "w": bad}, lambda name: 1)
    with pytest.raises(NonFiniteError, match=r"w holds NaN/Inf \(w\)"):
        refuse_nonfinite({"w": bad}, lambda name: None)


def test_a_written_folder_reads_back_and_records_its_storage(tmp_path):
    tensors = {"weight": torch.arange(6.0).view(2, 3), "selected": torch.zeros(3, 2, dtype=torch.long)}
    written = write_folder(tmp_path / "m", tensors, hand_manifest("ridge"), torch.float32)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted([MANIFEST_FILE, TENSOR_FILE])
    assert written.storage["parameters"] == 6 and written.storage["tensor_bytes"] == 6 * 4 + 6 * 8
    manifest, tensor_path = read_manifest(tmp_path / "m")
    assert manifest == written
    assert torch.equal(read_tensors(tensor_path, manifest)["weight"], tensors["weight"])


@pytest.fixture
def saved_mapper(tmp_path):
    """A tiny fitted mapper saved in a folder: (mapper, folder)."""
    from kvhandoff import FitConfig, fit_mapper

    from conftest import random_batches, tiny_model

    mapper = fit_mapper(tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, seed=4), random_batches(2),
                        FitConfig(top_k=1), progress=False)
    return mapper, mapper.save(tmp_path / "m")


CHOICE = RecomputeChoice("recent:20%", "fastest_at_min_retention", 0.97, "generative", ("coqa_gen",), "dev", 24,
                         0.98, 2048, 3.1)
GUARD = GuardCalibration("entropy", 2.5, 0.8, "answer_changed", GUARD_RULES[0], None, 30, 12, 0.75, 0.1, 10,
                         "recent:5%", 64)


def test_recording_a_guard_rewrites_only_the_manifest_and_it_loads_back(saved_mapper, tmp_path):
    mapper, folder = saved_mapper
    tensors_before = (folder / TENSOR_FILE).read_bytes()
    assert mapper.folder == folder and Mapper.load(folder).manifest.guard is None
    recorded = mapper.record_guard(GUARD)
    assert recorded.guard == GUARD and mapper.manifest.guard == GUARD  # in memory too
    assert (folder / TENSOR_FILE).read_bytes() == tensors_before  # the tensors untouched
    assert sorted(p.name for p in folder.iterdir()) == sorted([MANIFEST_FILE, TENSOR_FILE])  # no temporary left
    for lazy in (False, True):  # the checksum verifies, the tensors read
        again = Mapper.load(folder, lazy=lazy)
        assert again.manifest.guard == GUARD and again.folder == folder
        assert torch.equal(again.map_tensors()[0], mapper.map_tensors()[0])
    mapper.record_guard(None)
    assert Mapper.load(folder).manifest.guard is None
    assert "guard" not in json.loads((folder / MANIFEST_FILE).read_text())
    in_memory = type(mapper).from_tensors(mapper.saved_tensors(), mapper.manifest)
    with pytest.raises(MapperFormatError, match="not saved"):
        in_memory.record_guard(GUARD)  # no folder to write to
    # the recompute policy chosen for the pair is recorded the same way
    mapper.record_recompute(CHOICE)
    assert Mapper.load(folder).manifest.recompute == CHOICE and (folder / TENSOR_FILE).read_bytes() == tensors_before
    mapper.record_recompute(None)
    assert "recompute" not in json.loads((folder / MANIFEST_FILE).read_text())
    with pytest.raises(MapperFormatError, match="not saved"):
        in_memory.record_recompute(CHOICE)


def test_a_failed_manifest_write_leaves_the_old_manifest(saved_mapper, monkeypatch):
    mapper, folder = saved_mapper
    before = (folder / MANIFEST_FILE).read_bytes()
    real_write = Path.write_bytes

    def half_then_fail(self, data):  # the disk fills half-way through the new manifest
        real_write(self, data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        mapper.record_guard(GUARD)
    monkeypatch.undo()
    assert (folder / MANIFEST_FILE).read_bytes() == before  # the old manifest, whole
    assert sorted(p.name for p in folder.iterdir()) == sorted([MANIFEST_FILE, TENSOR_FILE])
    assert Mapper.load(folder).manifest.guard is None  # its checksum verifies
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("interrupted before the rename")))
    with pytest.raises(OSError, match="interrupted"):
        write_manifest(folder, mapper.manifest.with_guard(GUARD))
    monkeypatch.undo()
    assert (folder / MANIFEST_FILE).read_bytes() == before and Mapper.load(folder).manifest.guard is None


def test_a_manifest_of_other_tensors_is_not_written(saved_mapper, tmp_path):
    mapper, folder = saved_mapper
    other = dataclasses.replace(mapper.manifest, tensor_sha256="0" * 64)
    before = (folder / MANIFEST_FILE).read_bytes()
    with pytest.raises(MapperFormatError, match="other tensors"):
        write_manifest(folder, other.with_guard(GUARD))
    assert (folder / MANIFEST_FILE).read_bytes() == before
