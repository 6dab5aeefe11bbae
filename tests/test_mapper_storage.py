import pytest
import torch

from _mapper_support import hand_manifest
from kvhandoff.errors import MapperFormatError, NonFiniteError
from kvhandoff.mapper.storage import (
    MANIFEST_FILE,
    TENSOR_FILE,
    read_manifest,
    read_tensors,
    refuse_nonfinite,
    require_tensors,
    to_storage,
    write_folder,
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
