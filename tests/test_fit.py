import pytest
import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.config import MAPPER_FORMAT_VERSION
from kvhandoff.errors import IncompatiblePairError, StatisticsError
from kvhandoff.fit import collect_statistics, mapper_from_statistics
from kvhandoff.geometry import check_pair, model_fingerprint

from conftest import exactly_related, random_batches, tiny_model


def test_any_k_from_the_same_statistics():
    source = tiny_model("qwen2", layers=4)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(3), progress=False)
    fps = model_fingerprint(source), model_fingerprint(target)
    for k in (1, 2, 4, "all"):
        mapper = mapper_from_statistics(stats, FitConfig(top_k=k, ridge_lambda=1e-6), *fps)
        assert mapper.top_k == (4 if k == "all" else k)
        assert mapper.manifest["fit_metrics"]["r2_k_mean"] > 0.9999


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

        def encode(self, text, add_special_tokens=True):
            return [self.vocab.get(c, 0) for c in text]

    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        check_pair(tiny_model(), tiny_model(), FakeTokenizer({"a": 0}), FakeTokenizer({"b": 0}))


def test_bad_batches_are_refused():
    with pytest.raises(StatisticsError, match=r"\[batch, tokens\]"):
        fit_mapper(tiny_model(), tiny_model(seed=2), [torch.zeros(5, dtype=torch.long)], progress=False)


def _cross_modal_stats(source, target, rows: int = 600, seed: int = 0):
    """Synthetic rows where every target K and V is an exact linear function of source K *and* V."""
    from kvhandoff.fit import feature_layout
    from kvhandoff.statistics import CalibrationStats

    src, tgt = feature_layout(source), feature_layout(target)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, src.width, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(src.width, tgt.width, generator=gen, dtype=torch.float64) / src.width**0.5 + 0.3
    return CalibrationStats.from_rows(src, tgt, x, y), x, y


@pytest.mark.parametrize("top_k", [1, "all"])
def test_joint_inputs_recover_maps_that_read_source_k_and_v(top_k):
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, head_dim=32, seed=3)
    stats, x, y = _cross_modal_stats(source, target)
    fps = model_fingerprint(source), model_fingerprint(target)
    own = mapper_from_statistics(stats, FitConfig(top_k=top_k, ridge_lambda=1e-8), *fps)
    joint = mapper_from_statistics(stats, FitConfig(top_k=top_k, ridge_lambda=1e-8, source_inputs="kv"), *fps)
    assert joint.weight.shape[2] == 2 * own.weight.shape[2]
    assert joint.manifest["format_version"] == own.manifest["format_version"] == MAPPER_FORMAT_VERSION
    assert "source_inputs" not in own.manifest["config"] and joint.manifest["config"]["source_inputs"] == "kv"
    own_r2, joint_r2 = own.manifest["fit_metrics"]["r2_v_mean"], joint.manifest["fit_metrics"]["r2_v_mean"]
    assert own_r2 + 0.1 < joint_r2 <= 1.0 + 1e-9
    if top_k == "all":  # every source layer is an input: the map is exact
        assert own_r2 < 0.9 and joint_r2 > 1 - 1e-6
        assert torch.allclose(joint.map_feature_rows(x.float()), y.float(), atol=1e-4, rtol=0)


def test_joint_inputs_are_refused_with_the_heldout_choice():
    from kvhandoff.errors import ConfigError

    with pytest.raises(ConfigError, match="source_inputs"):
        FitConfig(top_k="heldout", ridge_lambda="heldout", source_inputs="kv")
    with pytest.raises(ConfigError, match="source_inputs"):
        FitConfig(source_inputs="k")


def test_nan_solved_weights_are_refused_naming_the_map():
    source, target = tiny_model("qwen2", layers=2), tiny_model("qwen2", layers=3, seed=2)
    stats = collect_statistics(source, target, random_batches(2), progress=False)
    mapper_from_statistics(stats, FitConfig(), {}, {})  # the clean statistics solve
    columns = stats.target.layer_slice(1, 2)  # V of target layer 2
    stats.sum_xy[:, columns.start] = float("nan")
    with pytest.raises(StatisticsError, match="NaN/Inf weights for V of target layer 2"):
        mapper_from_statistics(stats, FitConfig(), {}, {})
