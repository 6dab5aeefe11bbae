import json

import pytest
import torch

from kvhandoff import FitConfig
from kvhandoff.fit.pipeline import collect_statistics, mapper_from_statistics
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.model.capture import ContentKV, capture_content_kv
from kvhandoff.model.geometry import model_fingerprint
from kvhandoff_lab.analyze import (
    attention_diagnostics,
    causal_attention,
    load_retention,
    pearson,
    query_spectrum,
    run_analysis,
    summary_rows,
)

from conftest import exactly_related, random_batches, tiny_model


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen2", layers=3)
    target = exactly_related(source)
    stats = collect_statistics(source, target, random_batches(4), FitConfig(token_stride=1), progress=False)
    fingerprints = model_fingerprint(source), model_fingerprint(target)
    exact = mapper_from_statistics(stats, FitConfig(ridge_lambda=1e-6, token_stride=1), *fingerprints)
    return source, target, stats, exact


def _perturbed(mapper: DenseMapper, scale: float) -> DenseMapper:
    gen = torch.Generator().manual_seed(3)
    weight = mapper.weight + scale * mapper.weight.std() * torch.randn(mapper.weight.shape, generator=gen)
    return DenseMapper(weight, mapper.bias, mapper.selected, mapper.manifest)


def _diagnose(source, target, mappers, batches):
    diagnostics = None
    for ids in batches:
        true = capture_content_kv(target, ids, with_queries=True)
        mapped = {name: m.map_content(capture_content_kv(source, ids)) for name, m in mappers.items()}
        diagnostics = attention_diagnostics(target, true, mapped, diagnostics)
    return {name: d.result() for name, d in diagnostics.items()}


def test_exact_mapper_keeps_attention_and_noise_lowers_it(pair):
    source, target, _, exact = pair
    results = _diagnose(source, target, {"exact": exact, "noisy": _perturbed(exact, 0.5)},
                        random_batches(2, tokens=32, seed=9))
    good, bad = results["exact"], results["noisy"]
    assert good["attention_cosine"] >= 0.9999 and good["attention_cosine_min_head"] >= 0.999
    assert good["r2_k"] > 0.9999 and good["r2_v"] > 0.9999
    assert bad["attention_cosine"] < good["attention_cosine"] - 1e-3
    assert bad["r2_k"] < 0.99 and bad["r2_v"] < 0.99
    assert len(good["attention_cosine_per_head"]) == 3 and len(good["attention_cosine_per_head"][0]) == 4


def test_isotropic_noise_has_concentration_near_one(pair):
    _, target, _, _ = pair
    gen = torch.Generator().manual_seed(4)
    diagnostics = None
    for ids in random_batches(2, batch=4, tokens=64, seed=11):
        true = capture_content_kv(target, ids, with_queries=True)
        noisy = ContentKV(keys=true.keys + 0.1 * torch.randn(true.keys.shape, generator=gen),
                          values=true.values + 0.1 * torch.randn(true.values.shape, generator=gen))
        diagnostics = attention_diagnostics(target, true, {"iso": noisy}, diagnostics)
    result = diagnostics["iso"].result()
    assert result["concentration_k"] == pytest.approx(1.0, abs=0.05)
    assert result["concentration_v"] == pytest.approx(1.0, abs=0.08)


def test_error_along_the_top_query_direction_is_concentrated(pair):
    _, target, _, _ = pair
    bases, weights = query_spectrum(target)
    assert torch.allclose(weights.mean(-1), torch.ones(3, 2), atol=1e-5)
    ids = random_batches(1, tokens=16, seed=2)[0]
    true = capture_content_kv(target, ids, with_queries=True)
    top = bases[:, :, :, 0]  # [L, Hkv, D]: the strongest query direction of each KV head
    keys = true.keys + 0.1 * top[:, None, :, None, :]
    result = attention_diagnostics(target, true, {"top": ContentKV(keys, true.values)})["top"].result()
    assert result["concentration_k"] == pytest.approx(float(weights[..., 0].mean()), rel=1e-4)
    assert result["concentration_k"] > 1.5


def test_causal_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 7, 8, generator=gen) for h in (4, 2, 2))
    out, probs = causal_attention(q, k, v, 8**-0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, reference, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 7)) and probs[0, 0, 0, 1] == 0


def test_run_analysis_writes_figures_json_and_correlations(pair, tmp_path):
    source, target, stats, exact = pair
    retention = [("k=1", 0.5), ("k=2", 0.8), ("k=all", 0.97), ("exact", 1.0)]
    run_analysis(source, target, random_batches(2, tokens=24, seed=5), mappers={"exact": exact},
                 stats=stats, ks=(1, 2, "all"), out_dir=tmp_path, retention=retention, progress=False)
    for name in ("heatmaps.png", "r2_vs_k.png", "selection.png", "attention.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert set(saved["mappers"]) == {"exact", "k=1", "k=2", "k=all"}
    assert torch.tensor(saved["calibration_r2"]).shape == (2, 3, 3)
    post_rope = torch.tensor(saved["heldout_key_r2"]["post_rope"])
    content = torch.tensor(saved["heldout_key_r2"]["content"])
    assert post_rope.shape == content.shape == (3, 3)
    assert content.diagonal().min() > 0.999  # the exactly related target's keys are a linear map of the source's
    assert saved["mappers"]["k=1"]["selected_layers"] == [[0], [1], [2]]  # the diagonal structure
    assert {row["mapper"]: row["retention"] for row in saved["summary"]} == dict(retention)
    assert saved["correlations"]["rows"] == 4
    r2_k, kept = ([row[m] for row in saved["summary"]] for m in ("r2_k", "retention"))
    expected = torch.corrcoef(torch.tensor([r2_k, kept], dtype=torch.float64))[0, 1]
    assert saved["correlations"]["r2_k"] == pytest.approx(float(expected))


def test_retention_sources(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"mapper": {"manifest_sha": "abc", "top_k": 4},
                                                    "summary": {"all": {"mean_retention": 0.9}}}))
    assert load_retention(tmp_path) == {"abc": 0.9, "k=4": 0.9}
    assert load_retention({"k=1": 0.5}) == {"k=1": 0.5}
    result = {"source": {"name": "a"}, "target": {"name": "b"},
              "mappers": {"m": {"top_k": 4, "manifest_sha": "zzz", "r2_k": 0.9, "r2_v": 0.8,
                                "attention_cosine": 0.99, "concentration_k": 1.2, "concentration_v": 0.9}}}
    assert summary_rows([result], tmp_path)[0]["retention"] == 0.9
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and pearson([1, 2], [1, 2]) is None
