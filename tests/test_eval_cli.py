"""The typer command functions of the evaluation, with model loading faked by tiny models."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from _eval_support import NoisyMapper
from kvhandoff.errors import ConfigError, IncompatiblePairError
from kvhandoff.evaluation import cli as C

from conftest import BYTE_MODEL, ByteTokenizer, tiny_model

MODELS = {}


@pytest.fixture
def app(monkeypatch):
    import kvhandoff.assets
    import kvhandoff.mapper

    MODELS.setdefault("small", tiny_model("qwen2", seed=0, **BYTE_MODEL))
    MODELS.setdefault("large", tiny_model("qwen2", seed=1, **BYTE_MODEL))
    loaded = []

    def fake_load_model(spec, dtype=torch.float32, progress=True):
        loaded.append(spec)
        return MODELS[spec], ByteTokenizer()

    def fake_mapper_load(path, source_model=None, target_model=None, **kwargs):
        return NoisyMapper(scale=0.2, seed=len(str(path)))

    monkeypatch.setattr(kvhandoff.assets, "load_model", fake_load_model)
    monkeypatch.setattr(kvhandoff.mapper.Mapper, "load", staticmethod(fake_mapper_load))
    application = typer.Typer()
    application.command("eval")(C.eval_command)
    application.command("render")(C.render_command)
    application.loaded = loaded
    return application


def test_eval_both_directions(app, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "eval", "--source", "small", "--target", "large", "--mapper", str(tmp_path / "m"),
        "--reverse-mapper", str(tmp_path / "rev"), "--tasks", "winogrande", "--limit", "2",
        "--n-resamples", "20", "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    assert app.loaded == ["small", "large"]
    forward = json.loads((out / "forward.json").read_text())
    reverse = json.loads((out / "reverse.json").read_text())
    assert forward["direction"] == {"source": "small", "target": "large"}
    assert reverse["direction"] == {"source": "large", "target": "small"}
    assert forward["tasks"]["winogrande"]["n"] == 2
    for name in ("summary.md", "summary.png", "forward.md", "reverse.png"):
        assert (out / name).is_file()
    assert "### small → large" in result.output and "### large → small" in result.output
    # re-render from the result files alone
    rendered = CliRunner().invoke(app, ["render", str(out / "forward.json"), "--out", str(tmp_path / "r")])
    assert rendered.exit_code == 0 and (tmp_path / "r" / "summary.png").is_file()


def test_eval_with_statistics_and_k_sweep(app, tmp_path):
    from kvhandoff.config import FitConfig
    from kvhandoff.fit import collect_statistics

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 48), generator=gen) for _ in range(3)]
    stats = collect_statistics(MODELS["small"], MODELS["large"], batches, FitConfig(token_stride=1), False)
    stats.save(tmp_path / "stats")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "eval", "--source", "small", "--target", "large", "--statistics", str(tmp_path / "stats"),
        "--sweep-k", "--sweep-limit", "2", "--tasks", "winogrande", "--limit", "2", "--n-resamples", "10",
        "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["candidates"] == ["1", "all"] and "best k" in result.output
    forward = json.loads((out / "forward.json").read_text())
    assert forward["mapper"]["top_k"] == sweep["best_k"]
    # --sweep-ks restricts the candidates (the dev records of k = 1 are reused from the first sweep)
    result = CliRunner().invoke(app, [
        "eval", "--source", "small", "--target", "large", "--statistics", str(tmp_path / "stats"),
        "--sweep-k", "--sweep-ks", "1", "--sweep-limit", "2", "--tasks", "winogrande", "--limit", "2",
        "--n-resamples", "10", "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "sweep.json").read_text())["candidates"] == ["1"]


def test_argument_errors(app, tmp_path):
    runner = CliRunner()
    base = ["eval", "--source", "small", "--target", "large", "--out", str(tmp_path), "--no-progress"]
    result = runner.invoke(app, [*base, "--mapper", "m", "--statistics", "s"])
    assert isinstance(result.exception, ConfigError) and "--mapper" in str(result.exception)
    result = runner.invoke(app, [*base, "--mapper", "m", "--sweep-k"])
    assert isinstance(result.exception, ConfigError)
    result = runner.invoke(app, [*base, "--mapper", "m", "--dtype", "int8"])
    assert isinstance(result.exception, ConfigError)
    result = runner.invoke(app, [*base, "--mapper", "m", "--tasks", "nope"])
    assert isinstance(result.exception, ConfigError)
    result = runner.invoke(app, [*base, "--mapper", "m", "--sweep-ks", "1,zero"])
    assert isinstance(result.exception, ConfigError) and "zero" in str(result.exception)
    result = runner.invoke(app, [*base, "--mapper", "m", "--mapped", "question"])
    assert isinstance(result.exception, ConfigError) and "history" in str(result.exception)


def test_tokenizers_must_agree():
    class Other(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [b ^ 1 for b in super().encode(text)]

    class Renamed(ByteTokenizer):
        pass

    class OtherVocab(ByteTokenizer):
        def get_vocab(self):
            return {**super().get_vocab(), "<extra>": 258}

    C.check_tokenizers(ByteTokenizer(), Renamed())
    with pytest.raises(IncompatiblePairError):
        C.check_tokenizers(ByteTokenizer(), Other())
    with pytest.raises(IncompatiblePairError):
        C.check_tokenizers(ByteTokenizer(), OtherVocab())
