import pytest
import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.errors import IncompatiblePairError, StatisticsError
from kvhandoff.fit import check_pair, collect_statistics, mapper_from_statistics
from kvhandoff.geometry import model_fingerprint

from conftest import exactly_related, random_batches, tiny_model


def test_any_k_from_the_same_statistics():
    source = tiny_model("qwen2", layers=4)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(3), progress=False)
    fps = model_fingerprint(source), model_fingerprint(target)
    for k in (1, 2, 4, "all"):
        mapper = mapper_from_statistics(stats, FitConfig(top_k=k, ridge_lambda=1e-6), *fps)
        assert mapper.top_k == (4 if k == "all" else k)
        assert mapper.manifest["fit_metrics"]["r2_k_mean"] > 0.999


def test_calibration_description_and_token_count_recorded():
    source, target = tiny_model("llama"), tiny_model("llama", seed=1)
    mapper = fit_mapper(source, target, random_batches(2), calibration={"name": "random ids"}, progress=False)
    assert mapper.manifest["calibration"] == {"name": "random ids", "tokens_in_statistics": 2 * 2 * 12}
    assert mapper.manifest["method"] == "ridge"


def test_different_vocabularies_are_refused():
    source = tiny_model("qwen2")
    target = tiny_model("qwen2", vocab_size=200)
    with pytest.raises(IncompatiblePairError, match="different vocabulary sizes"):
        fit_mapper(source, target, random_batches(1), progress=False)


def test_different_tokenizers_are_refused():
    class FakeTokenizer:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        check_pair(tiny_model(), tiny_model(), FakeTokenizer({"a": 0}), FakeTokenizer({"b": 0}))


def test_bad_batches_are_refused():
    with pytest.raises(StatisticsError, match=r"\[batch, tokens\]"):
        fit_mapper(tiny_model(), tiny_model(seed=2), [torch.zeros(5, dtype=torch.long)], progress=False)
