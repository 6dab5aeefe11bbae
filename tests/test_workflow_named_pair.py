"""The named pair (kvhandoff.workflow.named_pair): each side's own tokenizer, a pair whose tokenizers differ refused,
and the cache entries keyed by the settings."""


import pytest

from kvhandoff import FitConfig
from kvhandoff.config import CalibrationSpec
from kvhandoff.workflow import load_named_pair, mapper_dir, obtain_mapper
from kvhandoff.workflow.named_pair import statistics_path

from conftest import TINY_CALIBRATION as CALIBRATION
from conftest import save_tiny_pair


def test_a_calibration_mix_is_its_own_cache_entry(named_pair):
    mixed = CalibrationSpec(num_sequences=4, seq_len=64, mix=("prose", "exams"))
    assert statistics_path(named_pair, FitConfig(), mixed) != statistics_path(named_pair, FitConfig(), CALIBRATION)
    mapper, folder, reused = obtain_mapper(named_pair, calibration=mixed, progress=False)
    assert not reused and folder == mapper_dir(named_pair, FitConfig(), mixed)
    assert mapper.manifest["calibration"]["mix"] == {"prose": 2, "exams": 2}
    assert mapper.manifest["calibration"]["num_tokens"] == 4 * 64


def test_the_manifest_records_each_sides_own_tokenizer(named_pair):
    from kvhandoff.model.geometry import tokenizer_hash

    mapper, _, _ = obtain_mapper(named_pair, calibration=CALIBRATION, progress=False)
    assert mapper.manifest["source_fingerprint"]["tokenizer_hash"] == tokenizer_hash(named_pair.models.source_tokenizer)
    assert mapper.manifest["target_fingerprint"]["tokenizer_hash"] == tokenizer_hash(named_pair.models.target_tokenizer)


def test_a_pair_whose_tokenizers_differ_is_refused(tmp_path):
    from kvhandoff.errors import IncompatiblePairError

    from conftest import chat_tokenizer

    small, large = save_tiny_pair(tmp_path / "models")
    chat_tokenizer().save_pretrained(large)
    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        load_named_pair(small, large, progress=False)
