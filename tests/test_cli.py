import json

import pytest
from typer.testing import CliRunner

from kvhandoff.cli import app
from kvhandoff.mapper import Mapper

from conftest import save_tiny_pair


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    return save_tiny_pair(tmp_path)


def test_fit_writes_a_loadable_mapper(pair, tmp_path):
    small, large = pair
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--top-k", "1", "--lambda", "0.1", "--sequences", "3", "--seq-len", "48",
                                      "--exact-prefix", "2"])
    assert result.exit_code == 0, result.output
    assert "saved" in result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.top_k == 1 and mapper.manifest["config"]["ridge_lambda"] == 0.1 and mapper.exact_prefix == 2
    assert mapper.manifest["calibration"]["num_tokens"] == 3 * 48


def test_fit_on_a_text_file_and_gcv(pair, tmp_path):
    small, large = pair
    texts = tmp_path / "texts.txt"
    texts.write_text("\n\n".join(f"Paragraph {i}: the cache moves from one model to another." for i in range(40)))
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--texts", str(texts), "--lambda", "gcv", "--sequences", "2", "--seq-len", "40"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["config"]["ridge_lambda"] == "gcv"
    assert str(texts) in json.dumps(manifest["calibration"])


def test_fit_refuses_a_missing_texts_file(pair, tmp_path):
    small, large = pair
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--texts", str(tmp_path / "no")])
    assert result.exit_code != 0 and "not a file" in result.output


def test_tune_prints_and_saves_the_sweep(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(app, ["tune", "--source", small, "--target", large, "--ks", "1,all",
                                      "--lambdas", "0.01", "--exact-prefixes", "0,2", "--docs", "1",
                                      "--prefix-len", "40", "--continuation-len", "8", "--sequences", "3",
                                      "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 4 and "mean_kl" in saved["source_reference"]
    assert "dev sweep" in result.output


def test_fit_mlp_then_score_it_in_tune(pair, tmp_path):
    small, large = pair
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--method", "mlp", "--sequences", "3", "--seq-len", "48", "--epochs", "1",
                                      "--hidden", "8", "--mlp-inputs", "1"])
    assert result.exit_code == 0, result.output
    assert "held-out loss" in result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.manifest["method"] == "mlp" and mapper.manifest["mlp_config"]["hidden"] == 8
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(app, ["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--docs", "1", "--prefix-len", "40",
                                      "--continuation-len", "8", "--sequences", "3", "--seq-len", "48",
                                      "--mapper", str(tmp_path / "m"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert {row.get("method", "ridge") for row in rows} == {"ridge", "mlp"}


def test_fit_refuses_unknown_method_and_mlp_on_texts(pair, tmp_path):
    small, large = pair
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--method", "forest"])
    assert result.exit_code != 0 and "unknown method" in result.output
    texts = tmp_path / "t.txt"
    texts.write_text("some text")
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--method", "mlp",
                                      "--texts", str(texts)])
    assert result.exit_code != 0 and "built-in corpus" in result.output


def test_fit_with_an_exam_mix_and_joint_inputs(pair, tmp_path):
    small, large = pair
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "2", "--seq-len", "48", "--mix", "prose,exams",
                                      "--inputs", "kv"])
    assert result.exit_code == 0, result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.joint_inputs and mapper.manifest["calibration"]["mix"] == {"prose": 1, "exams": 1}
    bad = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--mix", "poetry"])
    assert bad.exit_code != 0 and "mix" in str(bad.exception)


def test_tune_on_the_mmlu_dev_set_sweeps_inputs(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(app, ["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--inputs", "own,kv", "--dev", "mmlu", "--docs", "1",
                                      "--sequences", "3", "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert {row["source_inputs"] for row in saved["rows"]} == {"own", "kv"}
    assert saved["dev"]["kind"] == "mmlu-validation" and saved["rows"][0]["documents"] == 1


def test_tune_on_the_gsm8k_dev_set(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(app, ["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--dev", "gsm8k", "--docs", "1",
                                      "--sequences", "3", "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["dev"]["kind"] == "gsm8k-dev-pool" and saved["rows"][0]["documents"] == 1
    assert "prefix_len" not in saved and saved["calibration_windows"] == 3  # prose-only settings left out
    assert 0 < saved["rows"][0]["mean_kl"] < float("inf")  # an unrelated pair: the handoff changes the target
    bad = CliRunner().invoke(app, ["tune", "--source", small, "--target", large, "--dev", "poems"])
    assert bad.exit_code != 0 and "gsm8k" in bad.output


def test_refine_writes_a_refined_mapper_and_never_overwrites_its_input(pair, tmp_path):
    small, large = pair
    assert CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                    "--sequences", "3", "--seq-len", "48"]).exit_code == 0
    common = ["refine", "--source", small, "--target", large, "--mapper", str(tmp_path / "m"), "--windows", "4",
              "--seq-len", "40", "--steps", "2", "--batch-size", "1", "--min-context", "4", "--max-context", "24",
              "--continuation", "8", "--validation-windows", "2", "--validate-every", "1"]
    result = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "held-out KL" in result.output
    refined = Mapper.load(tmp_path / "r")
    record = refined.manifest["refinement"]
    assert record["config"]["steps"] == 2 and record["corpus"]["base_mapper"] == str(tmp_path / "m")
    assert [h["step"] for h in record["history"]] == [0, 1, 2]
    before = (tmp_path / "m" / "mapper.safetensors").read_bytes()
    same = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "m")])
    assert same.exit_code != 0 and "another folder" in same.output
    short = CliRunner().invoke(app, [*common, "--seq-len", "16", "--out", str(tmp_path / "s")])
    assert short.exit_code != 0 and "shorter than" in short.output
    assert (tmp_path / "m" / "mapper.safetensors").read_bytes() == before
