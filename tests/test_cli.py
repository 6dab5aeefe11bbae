import json
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _eval_support import NoisyMapper
from kvhandoff.cli import app
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.runtime.policy import Recent, Sinks
from kvhandoff.runtime.switch.guard import Escalate
from kvhandoff_lab.cli import app as lab_app

from conftest import BYTE_MODEL, ByteTokenizer, chat_tokenizer, pair_guards, save_tiny_pair, tiny_model

#: the product's commands (`kvhandoff`); every other command is the lab's (`kvhandoff-lab`)
PRODUCT_COMMANDS = ("prepare", "fit", "refine", "demo", "serve", "guard-calibrate", "vllm-config")


def invoke(args, **kwargs):
    """The command line that has ``args``' command, run on ``args``."""
    args = list(args)
    command_line = app if not args or args[0] in PRODUCT_COMMANDS or args[0].startswith("-") else lab_app
    return CliRunner().invoke(command_line, args, **kwargs)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    return save_tiny_pair(tmp_path)


def test_vllm_config_prints_a_server_per_model_with_the_connector(pair, tmp_path):
    small, large = pair
    for source, target, folder in ((small, large, "up"), (large, small, "down")):
        fitted = invoke(["fit", "--source", source, "--target", target, "--out", str(tmp_path / folder), "--top-k",
                         "1", "--sequences", "3", "--seq-len", "48"])
        assert fitted.exit_code == 0, fitted.output
    result = invoke(["vllm-config", "--models", f"small={small},large={large}", "--mapper",
                     f"small:large={tmp_path / 'up'}", "--mapper", f"large:small={tmp_path / 'down'}", "--store-url",
                     "redis://10.0.0.5:6379/0", "--recompute", "recent:10%", "--port", "9001"])
    assert result.exit_code == 0, result.output
    commands = [line for line in result.output.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    assert len(commands) == 2
    for command, name, port in zip(commands, ("small", "large"), (9001, 9002), strict=True):
        args = shlex.split(command)
        extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert extra == {"store_url": "redis://10.0.0.5:6379/0", "model": name, "recompute": "recent:10%",
                         "mappers": {"small->large": str(tmp_path / "up"), "large->small": str(tmp_path / "down")},
                         "models": {"small": str(Path(small).resolve()), "large": str(Path(large).resolve())}}
        assert args[args.index("--port") + 1] == str(port) and args[args.index("--served-model-name") + 1] == name
        assert args[args.index("--model") + 1] == str(Path(small if name == "small" else large).resolve())
    refused = invoke(["vllm-config", "--recompute", "sinks:10%", "--no-scattered-recompute"])
    assert refused.exit_code != 0 and "a vLLM target recomputes by the rules recent" in refused.output
    refused = invoke(["vllm-config", "--recompute", "layers:10%"])
    assert refused.exit_code != 0 and "a vLLM (connector with model copies) target recomputes" in refused.output


def test_fit_writes_a_loadable_mapper(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--top-k", "1", "--lambda", "0.1", "--sequences", "3", "--seq-len", "48",
                                      "--exact-prefix", "2"])
    assert result.exit_code == 0, result.output
    assert "saved" in result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.top_k == 1 and mapper.manifest["config"]["ridge_lambda"] == 0.1 and mapper.exact_prefix == 2
    assert mapper.manifest["calibration"]["num_tokens"] == 3 * 48


def test_fit_for_both_directions_leaves_the_reverse_fit_no_pass_to_run(pair, tmp_path):
    small, large = pair
    common = ["--sequences", "3", "--seq-len", "48", "--top-k", "1"]
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--both-directions", *common])
    assert result.exit_code == 0, result.output
    result = invoke(["fit", "--source", large, "--target", small, "--out", str(tmp_path / "r"),
                                      *common])
    assert result.exit_code == 0, result.output
    assert Mapper.load(tmp_path / "r").manifest["calibration"]["reused_reverse_pass"] is True


def test_fit_with_attention_weighted_rows_records_it_and_keeps_its_own_pass(pair, tmp_path):
    small, large = pair
    common = ["--source", small, "--target", large, "--sequences", "3", "--seq-len", "48", "--top-k", "1"]
    assert invoke(["fit", *common, "--out", str(tmp_path / "u")]).exit_code == 0
    result = invoke(["fit", *common, "--out", str(tmp_path / "w"), "--row-weights", "attention"])
    assert result.exit_code == 0, result.output
    uniform, weighted = Mapper.load(tmp_path / "u"), Mapper.load(tmp_path / "w")
    assert weighted.manifest["config"]["row_weights"] == "attention" and "row_weights" not in uniform.manifest["config"]
    assert weighted.manifest["calibration"]["tokens_in_statistics"] != uniform.manifest["calibration"][
        "tokens_in_statistics"]
    assert not torch.allclose(weighted.weight, uniform.weight)


def test_bench_fit_measures_the_fit_next_to_the_forwards(pair, tmp_path):
    small, large = pair
    result = invoke(["bench-fit", "--source", small, "--target", large, "--windows", "3",
                                      "--seq-len", "40", "--out", str(tmp_path / "b"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "time ÷ forward-only" in result.output and "peak memory above the loaded models" in result.output
    written = json.loads((tmp_path / "b" / "bench-fit.json").read_text())
    assert len(written["windows"]) == 3 and written["description"]["calibration"]["num_sequences"] == 3
    assert written["settings"]["tokens_per_window"] == 40


def test_fit_in_bf16_on_an_auto_device_map_in_layer_blocks(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "3", "--seq-len", "48", "--dtype", "bf16", "--device-map", "auto",
                                      "--layer-block", "2"])
    assert result.exit_code == 0, result.output
    manifest = Mapper.load(tmp_path / "m").manifest
    assert manifest["source_fingerprint"]["dtype"] == manifest["target_fingerprint"]["dtype"] == "bfloat16"
    assert manifest["fit_metrics"]["target_layer_blocks"] == [[0, 1], [2, 2]]


def test_fit_chooses_the_layer_block_for_a_statistics_memory(pair, tmp_path):
    from kvhandoff.fit.pipeline import estimate_memory
    from kvhandoff.model.capture import FeatureLayout

    small, large = pair  # 2 layers × 2 KV heads × 16 → 3 layers × 2 KV heads × 32
    budget = estimate_memory(FeatureLayout(2, 2, 16), FeatureLayout(3, 2, 32), layer_block=1).peak_bytes
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "3", "--seq-len", "40", "--stats-memory", str(budget)])
    assert result.exit_code == 0, result.output
    assert "--layer-block 1: 3 passes" in result.output
    assert Mapper.load(tmp_path / "m").manifest["fit_metrics"]["statistics_passes"] == 3
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "3", "--seq-len", "40", "--stats-memory", "1kB"])
    assert result.exit_code == 2 and "even one target layer per pass needs" in result.output


def test_fit_on_a_text_file_and_gcv(pair, tmp_path):
    small, large = pair
    texts = tmp_path / "texts.txt"
    texts.write_text("\n\n".join(f"Paragraph {i}: the cache moves from one model to another." for i in range(40)))
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--texts", str(texts), "--lambda", "gcv", "--sequences", "2", "--seq-len", "40"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["config"]["ridge_lambda"] == "gcv"
    assert str(texts) in json.dumps(manifest["calibration"])


def test_fit_refuses_a_missing_texts_file(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--texts", str(tmp_path / "no")])
    assert result.exit_code != 0 and "not a file" in result.output


def test_tune_prints_and_saves_the_sweep(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = invoke(["tune", "--source", small, "--target", large, "--ks", "1,all",
                                      "--lambdas", "0.01", "--exact-prefixes", "0,2", "--docs", "1",
                                      "--prefix-len", "40", "--continuation-len", "8", "--sequences", "3",
                                      "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 4 and "mean_kl" in saved["source_reference"]
    assert "dev sweep" in result.output


def test_fit_mlp_then_score_it_in_tune(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--method", "mlp", "--sequences", "3", "--seq-len", "48", "--epochs", "1",
                                      "--hidden", "8", "--mlp-inputs", "1"])
    assert result.exit_code == 0, result.output
    assert "held-out loss" in result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.manifest["method"] == "mlp" and mapper.manifest["mlp_config"]["hidden"] == 8
    out = tmp_path / "tune.json"
    result = invoke(["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--docs", "1", "--prefix-len", "40",
                                      "--continuation-len", "8", "--sequences", "3", "--seq-len", "48",
                                      "--mapper", str(tmp_path / "m"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert {row.get("method", "ridge") for row in rows} == {"ridge", "mlp"}


def test_fit_refuses_unknown_method_and_mlp_on_texts(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--method", "forest"])
    assert result.exit_code != 0 and "unknown method" in result.output
    texts = tmp_path / "t.txt"
    texts.write_text("some text")
    result = invoke(["fit", "--source", small, "--target", large, "--method", "mlp",
                                      "--texts", str(texts)])
    assert result.exit_code != 0 and "built-in corpus" in result.output


def test_fit_with_an_exam_mix_and_joint_inputs(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "2", "--seq-len", "48", "--mix", "prose,exams",
                                      "--inputs", "kv"])
    assert result.exit_code == 0, result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.joint_inputs and mapper.manifest["calibration"]["mix"] == {"prose": 1, "exams": 1}
    bad = invoke(["fit", "--source", small, "--target", large, "--mix", "poetry"])
    assert bad.exit_code == 2 and "--mix" in bad.output and "prose" in bad.output


def test_tune_on_the_mmlu_dev_set_sweeps_inputs(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = invoke(["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--inputs", "own,kv", "--dev", "mmlu", "--docs", "1",
                                      "--sequences", "3", "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert {row["source_inputs"] for row in saved["rows"]} == {"own", "kv"}
    assert saved["dev"]["kind"] == "mmlu-validation" and saved["rows"][0]["documents"] == 1


def test_tune_on_the_gsm8k_dev_set(pair, tmp_path):
    small, large = pair
    out = tmp_path / "tune.json"
    result = invoke(["tune", "--source", small, "--target", large, "--ks", "all",
                                      "--lambdas", "0.01", "--dev", "gsm8k", "--docs", "1",
                                      "--sequences", "3", "--seq-len", "48", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["dev"]["kind"] == "gsm8k-dev-pool" and saved["rows"][0]["documents"] == 1
    assert "prefix_len" not in saved and saved["calibration_windows"] == 3  # prose-only settings left out
    assert 0 < saved["rows"][0]["mean_kl"] < float("inf")  # an unrelated pair: the handoff changes the target
    bad = invoke(["tune", "--source", small, "--target", large, "--dev", "poems"])
    assert bad.exit_code != 0 and "gsm8k" in bad.output


def test_refine_writes_a_refined_mapper_and_never_overwrites_its_input(pair, tmp_path):
    small, large = pair
    assert invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                    "--sequences", "3", "--seq-len", "48"]).exit_code == 0
    common = ["refine", "--source", small, "--target", large, "--mapper", str(tmp_path / "m"), "--windows", "4",
              "--seq-len", "40", "--steps", "2", "--batch-size", "1", "--min-context", "4", "--max-context", "24",
              "--continuation", "8", "--validation-windows", "2", "--validate-every", "1"]
    result = invoke([*common, "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "held-out KL" in result.output
    refined = Mapper.load(tmp_path / "r")
    record = refined.manifest["refinement"]
    assert record["config"]["steps"] == 2 and record["corpus"]["base_mapper"] == str(tmp_path / "m")
    assert [h["step"] for h in record["history"]] == [0, 1, 2]
    before = (tmp_path / "m" / "mapper.safetensors").read_bytes()
    same = invoke([*common, "--out", str(tmp_path / "m")])
    assert same.exit_code != 0 and "another folder" in same.output
    short = invoke([*common, "--seq-len", "16", "--out", str(tmp_path / "s")])
    assert short.exit_code != 0 and "shorter than" in short.output
    assert (tmp_path / "m" / "mapper.safetensors").read_bytes() == before


# -- eval and eval-render, with model loading faked by tiny models ------------------------------------------------
MODELS = {}


@pytest.fixture
def fake_models(monkeypatch):
    """`load_model` of "small" / "large" gives tiny random models with a byte tokenizer (`tokenizers` maps a name
    to another tokenizer); `Mapper.load` gives a noisy stand-in mapper. Returns the names loaded, in order."""
    import kvhandoff.mapper.mapper
    import kvhandoff.model.loading

    MODELS.setdefault("small", tiny_model("qwen2", seed=0, **BYTE_MODEL))
    MODELS.setdefault("large", tiny_model("qwen2", seed=1, **BYTE_MODEL))
    loaded = []

    def fake_load_model(spec, dtype=torch.float32, progress=True, device_map=None, gpus=None):
        loaded.append(spec)
        fake_models_placement.append((dtype, device_map))
        return MODELS[spec], fake_models_tokenizers.get(spec, ByteTokenizer())

    def fake_mapper_load(path, *args, **kwargs):
        return NoisyMapper(scale=0.2, seed=len(str(path)))

    fake_models_tokenizers.clear()
    fake_models_placement.clear()
    monkeypatch.setattr(kvhandoff.model.loading, "load_model", fake_load_model)
    monkeypatch.setattr(kvhandoff.mapper.mapper.Mapper, "load", staticmethod(fake_mapper_load))
    return loaded


fake_models_tokenizers: dict = {}
fake_models_placement: list = []


def test_eval_both_directions(fake_models, tmp_path):
    out = tmp_path / "out"
    result = invoke([
        "eval", "--source", "small", "--target", "large", "--mapper", str(tmp_path / "m"),
        "--reverse-mapper", str(tmp_path / "rev"), "--tasks", "winogrande", "--limit", "2",
        "--n-resamples", "20", "--out", str(out), "--no-progress", "--dtype", "bfloat16", "--device-map", "auto",
    ])
    assert result.exit_code == 0, result.output
    assert fake_models == ["small", "large"]
    assert fake_models_placement == [("bfloat16", "auto")] * 2
    forward = json.loads((out / "forward.json").read_text())
    reverse = json.loads((out / "reverse.json").read_text())
    assert forward["direction"] == {"source": "small", "target": "large"}
    assert reverse["direction"] == {"source": "large", "target": "small"}
    assert forward["tasks"]["winogrande"]["n"] == 2
    for name in ("summary.md", "summary.png", "forward.md", "reverse.png"):
        assert (out / name).is_file()
    assert "### small → large" in result.output and "### large → small" in result.output
    # re-render from the result files alone
    rendered = invoke(["eval-render", str(out / "forward.json"), "--out", str(tmp_path / "r")])
    assert rendered.exit_code == 0 and (tmp_path / "r" / "summary.png").is_file()


def test_eval_with_a_recompute_policy(fake_models, tmp_path):
    """`--recompute RULE:BUDGET` reaches the transfer condition and is recorded in the results; recomputing every
    mapped position makes the transfer score the target's own."""
    out = tmp_path / "out"
    result = invoke([
        "eval", "--source", "small", "--target", "large", "--mapper", str(tmp_path / "m"), "--no-both-directions",
        "--tasks", "winogrande", "--limit", "2", "--n-resamples", "20", "--out", str(out), "--no-progress",
        "--recompute", "sinks:1.0",
    ])
    assert result.exit_code == 0, result.output
    forward = json.loads((out / "forward.json").read_text())
    assert forward["recompute"] == "sinks:100%"
    accuracy = forward["tasks"]["winogrande"]["accuracy"]
    assert accuracy["transfer"]["value"] == accuracy["target"]["value"]


def test_eval_with_statistics_and_k_sweep(fake_models, tmp_path):
    from kvhandoff.config import FitConfig
    from kvhandoff.fit.pipeline import collect_statistics

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 48), generator=gen) for _ in range(3)]
    stats = collect_statistics(MODELS["small"], MODELS["large"], batches, FitConfig(token_stride=1), False)
    stats.save(tmp_path / "stats")
    out = tmp_path / "out"
    result = invoke([
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
    result = invoke([
        "eval", "--source", "small", "--target", "large", "--statistics", str(tmp_path / "stats"),
        "--sweep-k", "--sweep-ks", "1", "--sweep-limit", "2", "--tasks", "winogrande", "--limit", "2",
        "--n-resamples", "10", "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "sweep.json").read_text())["candidates"] == ["1"]


def test_eval_argument_errors_exit_2_naming_the_option(fake_models, tmp_path):
    base = ["eval", "--source", "small", "--target", "large", "--out", str(tmp_path), "--no-progress"]
    for extra, named in ((["--mapper", "m", "--statistics", "s"], "--mapper"),
                         (["--mapper", "m", "--sweep-k"], "--sweep-k"), (["--sweep-k"], "statistics"),
                         (["--mapper", "m", "--dtype", "int8"], "--dtype"),
                         (["--mapper", "m", "--tasks", "nope"], "--tasks"),
                         (["--mapper", "m", "--sweep-ks", "1,zero"], "zero"),
                         (["--mapper", "m", "--mapped", "question"], "history"),
                         (["--mapper", "m", "--limit", "0"], "--limit"),
                         (["--mapper", "m", "--exact-prefix", "-1"], "--exact-prefix")):
        result = invoke([*base, *extra])
        assert result.exit_code == 2 and named in result.output, (extra, result.output)
        assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert fake_models == []  # refused before any model loads


SWITCH_BASE = ["eval-switch", "--source", "small", "--target", "large", "--mapper", "m", "--reverse-mapper", "r",
               "--tasks", "winogrande", "--limit", "2", "--histories", "1", "--history-tokens", "100",
               "--exact-prefix", "0", "--no-progress"]


def test_eval_switch_benchmark_and_recompute_sweep(fake_models, tmp_path):
    out = tmp_path / "out"
    result = invoke([*SWITCH_BASE, "--out", str(out), "--recompute", "recent:10%"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "switch.json").read_text())
    assert saved["settings"]["pool"] == "report" and saved["settings"]["policies"] == ["recent:10%"]
    assert set(saved["directions"]) == {"forward", "reverse"}
    assert "### small → large" in result.output and "### large → small" in result.output
    result = invoke([*SWITCH_BASE, "--out", str(out), "--sweep-recompute", "recent,mix",
                                      "--budgets", "0,20", "--ttft-lengths", "64", "--record-recompute",
                                      "--min-retention", "0"])
    sweep = json.loads((out / "sweep_recompute.json").read_text())
    assert sweep["settings"]["pool"] == "dev" and sweep["policies"] == ["none", "recent:20%", "mix:20%"]
    assert sweep["complete"] and (out / "sweep_recompute.png").is_file()
    # the stand-in mappers cannot hold a record: refused before any is written, naming the fix
    assert result.exit_code == 1 and "not a saved kvhandoff mapper" in result.output


def test_a_sweeps_choice_is_recorded_with_each_directions_mapper(pair, tmp_path):
    from kvhandoff_lab.cli import switch as switch_cli
    from kvhandoff_lab.evaluation.switchbench import Direction

    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"), "--top-k", "1",
                     "--sequences", "3", "--seq-len", "48"])
    assert result.exit_code == 0, result.output
    mapper = Mapper.load(tmp_path / "m")
    point = {"retention": {"forward": {"mean_retention": 0.99}}, "speedup": {"64": {"forward": 3.0}}}
    sweep = {"ttft_lengths": ["64"], "group": "core", "items_per_task": 4, "directions": {"forward": {}},
             "settings": {"tasks": ["arc_challenge"], "pool": "dev"},
             "points": [{**point, "policy": "recent:20%"}, {**point, "policy": "none", "speedup": {"64": {
                 "forward": 5.0}}, "retention": {"forward": {"mean_retention": 0.5}}}]}
    switch_cli._record_choices(sweep, [Direction("forward", None, None, mapper, "small", "large")], 0.97)
    assert Mapper.load(tmp_path / "m").manifest.recompute.spec == "recent:20%"  # "none" is faster but loses
    switch_cli._record_choices(sweep, [Direction("forward", None, None, mapper, "small", "large")], 0.97, 4.0)
    recorded = Mapper.load(tmp_path / "m").manifest.recompute  # none at 4x keeps 0.97: the most retentive there
    assert (recorded.spec, recorded.min_speedup, [p.spec for p in recorded.tradeoff]) == (
        "none", 4.0, ["recent:20%", "none"])


def test_eval_switch_argument_errors_exit_2_naming_the_option(fake_models, tmp_path):
    for extra, named in ((["--tasks", "gsm8k"], "--tasks"), (["--sweep-recompute", "loudest"], "loudest"),
                         (["--sweep-recompute", "none"], "none"),
                         (["--budgets", "5,200"], "--budgets"), (["--pool", "train"], "--pool"),
                         (["--ttft-lengths", "1"], "--ttft-lengths"), (["--record-recompute"], "--sweep-recompute"),
                         (["--sweep-recompute", "recent", "--min-retention", "x"], "--min-retention"),
                         (["--sweep-recompute", "recent", "--min-speedup", "-2"], "--min-speedup")):
        result = invoke([*SWITCH_BASE, "--out", str(tmp_path), *extra])
        assert result.exit_code == 2 and named in result.output, (extra, result.output)
    assert fake_models == []


def test_eval_switch_generative_tasks_with_several_policies(fake_models, tmp_path):
    out = tmp_path / "out"
    tasks = SWITCH_BASE.index("--tasks")
    base = [*SWITCH_BASE[:tasks], "--tasks", "nq_open", *SWITCH_BASE[tasks + 2:]]
    result = invoke([*base, "--out", str(out), "--recompute", "none,recent:10%", "--generative-histories", "2",
                     "--max-new-tokens", "answer=3", "--no-both-directions"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "switch.json").read_text())
    assert saved["settings"]["policies"] == ["none", "recent:10%"] and saved["histories_done"] == 2
    assert saved["settings"]["max_new_tokens"] == {"answer": 3, "cot": 256}
    assert set(saved["directions"]["forward"]["tasks"]["nq_open"]["transfers"]) == {"switch", "switch:recent:10%"}
    assert "| NQ-open (recent:10%) | exact_match | 2 | 2 |" in result.output
    for extra, named in ((["--max-new-tokens", "essay=5"], "essay"), (["--recompute", "none,loud:5%"], "loud"),
                         (["--tasks", "nq_open,winogrande", "--sweep-recompute", "recent"], "apart from winogrande")):
        result = invoke([*base, "--out", str(tmp_path), *extra])
        assert result.exit_code == 2 and named in result.output, (extra, result.output)


def test_tokenizers_must_agree(fake_models, tmp_path):
    from kvhandoff.model.loading import load_pair

    class Other(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [b ^ 1 for b in super().encode(text)]

    class Renamed(ByteTokenizer):
        pass

    class OtherVocab(ByteTokenizer):
        def get_vocab(self):
            return {**super().get_vocab(), "<extra>": 258}

    fake_models_tokenizers["large"] = Renamed()
    assert load_pair("small", "large").target_tokenizer is fake_models_tokenizers["large"]
    for tokenizer in (Other(), OtherVocab()):
        fake_models_tokenizers["large"] = tokenizer
        result = invoke(["eval", "--source", "small", "--target", "large", "--mapper", "m",
                                          "--tasks", "winogrande", "--out", str(tmp_path), "--no-progress"])
        assert result.exit_code == 1 and result.output.startswith("error: ") and "tokenizers" in result.output


# -- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ["fit"], ["fit", "--texts", "TEXTS"], ["refine", "--mapper", "M", "--out", "R"], ["demo"], ["tune"],
    ["eval", "--mapper", "M"], ["bench", "--synthetic"], ["analyze", "--mapper", "M"],
])
def test_every_entry_point_refuses_a_pair_whose_tokenizers_differ(command, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    small, large = save_tiny_pair(tmp_path)
    chat_tokenizer().save_pretrained(large)  # same vocabulary, another end-of-sequence token
    texts = tmp_path / "texts.txt"
    texts.write_text("some text")
    paths = {"TEXTS": str(texts), "M": str(tmp_path / "m"), "R": str(tmp_path / "r")}
    result = invoke([*(paths.get(a, a) for a in command), "--source", small, "--target", large])
    assert result.exit_code == 1, result.output
    last = result.output.rstrip("\n").split("\n")[-1]  # after the loading progress bars
    assert last.startswith("error: ") and "tokenizers differ" in last
    assert result.output.count("error: ") == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(("arguments", "option"), [
    (["fit", "--top-k", "x"], "--top-k"),
    (["fit", "--top-k", "0"], "--top-k"),
    (["fit", "--lambda", "abc"], "--lambda"),
    (["fit", "--lambda", "-1"], "--lambda"),
    (["fit", "--sequences", "0"], "--sequences"),
    (["fit", "--seq-len", "-5"], "--seq-len"),
    (["fit", "--stride", "x"], "--stride"),
    (["fit", "--exact-prefix", "-1"], "--exact-prefix"),
    (["fit", "--inputs", "both"], "--inputs"),
    (["fit", "--epochs", "0"], "--epochs"),
    (["fit", "--sequences", "1", "--mix", "prose,exams"], "--sequences"),
    (["refine", "--mapper", "m", "--out", "r", "--steps", "-2"], "--steps"),
    (["refine", "--mapper", "m", "--out", "r", "--lr", "0"], "--lr"),
    (["refine", "--mapper", "m", "--out", "r", "--min-context", "9", "--max-context", "8"], "--min-context"),
    (["demo", "--top-k", "heldout"], "--top-k"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["tune", "--ks", "1,x"], "--ks"),
    (["tune", "--lambdas", "0.1,abc"], "--lambdas"),
    (["tune", "--exact-prefixes", "0,-1"], "--exact-prefixes"),
    (["tune", "--inputs", "own,both"], "--inputs"),
    (["tune", "--docs", "0"], "--docs"),
    (["tune", "--dev", "poems"], "--dev"),
    (["bench", "--lengths", "5,x"], "--lengths"),
    (["bench", "--lengths", ""], "--lengths"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--top-k", "-3"], "--top-k"),
    (["bench", "--budget", "0"], "--budget"),
    (["analyze", "--ks", "all,0"], "--ks"),
    (["analyze", "--windows", "0"], "--windows"),
    (["eval", "--n-resamples", "x"], "--n-resamples"),
    (["eval", "--recompute", "recent:200%"], "--recompute"),
    (["demo", "--recompute", "deviation"], "--recompute"),
    (["bench", "--recompute", "fast:10%"], "--recompute"),
    (["fit", "--no-such-option"], "--no-such-option"),
    (["fit", "--dtype", "bf17"], "--dtype"),
    (["fit", "--device-map", "gpu7"], "--device-map"),
    (["fit", "--layer-block", "0"], "--layer-block"),
    (["fit", "--stats-memory", "lots"], "--stats-memory"),
    (["fit", "--layer-block", "2", "--stats-memory", "1GiB"], "--layer-block"),
    (["fit", "--texts", "/nonexistent/corpus.txt"], "--texts"),
    (["fit", "--texts", "README.md", "--top-k", "heldout"], "--texts"),
    (["fit", "--rank", "64", "--layer-block", "2"], "--layer-block"),
    (["fit", "--method", "mlp", "--heads", "aligned"], "--method"),
    (["fit", "--layer-block", "2", "--method", "mlp"], "--layer-block"),
    (["fit", "--both-directions", "--layer-block", "2"], "--both-directions"),
    (["fit", "--both-directions", "--texts", "README.md"], "--both-directions"),
    (["fit", "--row-weights", "loss"], "--row-weights"),
    (["fit", "--row-weights", "attention", "--both-directions"], "--row-weights"),
    (["fit", "--row-weights", "attention", "--method", "mlp"], "--row-weights"),
    (["fit", "--row-weights", "attention", "--top-k", "heldout"], "--row-weights"),
    (["bench-fit", "--windows", "0"], "--windows"),
    (["bench-fit", "--top-k", "heldout"], "--top-k"),
    (["demo", "--dtype", "int4"], "--dtype"),
    (["bench", "--device-map", "everywhere"], "--device-map"),
    (["eval", "--device-map", "cuda:x"], "--device-map"),
    (["guard-calibrate", "--target-rate", "2"], "--target-rate"),
    (["guard-calibrate", "--signal", "vibes"], "--signal"),
    (["guard-calibrate", "--label", "vibes"], "--label"),
    (["guard-calibrate", "--turns", "1"], "--turns"),
    (["serve", "--engine", "vllm"], "--engine"),
    (["serve", "--engine", "llama.cpp", "--llama-context", "100"], "--llama-context"),
])
def test_bad_command_line_values_exit_2_with_one_line(arguments, option):
    result = invoke(arguments)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and option in result.output
    assert result.output.count("\n") == 1  # one line, no traceback


def test_no_arguments_show_the_help():
    result = CliRunner().invoke(app, [])
    assert "Commands" in result.output and "serve" in result.output and "eval-render" not in result.output
    result = CliRunner().invoke(lab_app, [])
    assert "Commands" in result.output and "eval-render" in result.output and "demo" not in result.output


def test_serve_builds_the_config_and_family_from_its_options(monkeypatch, tmp_path):
    import kvhandoff.cli.serve as serve_cli

    calls = {}

    def fake_load_family(specs, mapper_dirs, dtype, progress, device_map, llama_cpp=None, ggufs=None):
        calls["family"] = (specs, mapper_dirs)
        calls["placement"] = (dtype, device_map)
        calls["progress"] = progress
        calls["llama_cpp"] = (llama_cpp, ggufs)
        return {"models": 1}, {"mappers": 2}

    monkeypatch.setattr(serve_cli, "load_family", fake_load_family)
    monkeypatch.setattr(serve_cli, "run_server", lambda models, mappers, config: calls.update(run=(models, mappers,
                                                                                                   config)))
    result = invoke(["serve", "--models", "small=/m/s,large=/m/l", "--mapper",
                                      f"small:large={tmp_path}", "--port", "0", "--guard", "off",
                                      "--max-context", "300", "--cache-memory", "1000", "--recompute", "sinks:10%",
                                      "--dtype", "bf16", "--device-map", "auto", "--guard-action",
                                      "escalate:recent:35%"])
    assert result.exit_code == 0, result.output
    assert calls["family"] == ({"small": "/m/s", "large": "/m/l"}, {("small", "large"): tmp_path})
    assert calls["placement"] == ("bfloat16", "auto") and calls["progress"] is True  # bars at the command line
    models, mappers, config = calls["run"]
    assert (models, mappers) == ({"models": 1}, {"mappers": 2})
    assert (config.port, config.switch.guard, config.max_context, config.cache_memory_bytes) == (0, False, 300, 1000)
    assert config.switch.guard_action == Escalate(Recent(0.35))
    assert (config.read_timeout_s, config.open_probes) == (30.0, False)  # the probes need the key by default
    invoke(["serve", "--models", "small=/m/s,large=/m/l", "--read-timeout", "2.5", "--open-probes"])
    assert (calls["run"][2].read_timeout_s, calls["run"][2].open_probes) == (2.5, True)
    invoke(["serve", "--models", "small=/m/s,large=/m/l"])
    assert calls["run"][2].switch.guard_action is None  # each pair's recorded action
    assert (calls["run"][2].switch.min_speedup, calls["run"][2].switch.min_retention) == (None, None)  # the records
    invoke(["serve", "--models", "small=/m/s,large=/m/l", "--min-speedup", "3", "--min-retention", "0.9"])
    assert (calls["run"][2].switch.min_speedup, calls["run"][2].switch.min_retention) == (3.0, 0.9)
    assert config.switch.recompute == Sinks(0.1)  # parsed by the option, once
    assert config.switch.recompute.spec == "sinks:10%"
    assert calls["llama_cpp"] == (None, None)

    result = invoke(["serve", "--models", "small=/m/s,large=/m/l", "--engine", "llama.cpp", "--gguf",
                     f"small={tmp_path}/s.gguf", "--llama-context", "4096", "--llama-threads", "1"])
    assert result.exit_code == 0, result.output
    settings, ggufs = calls["llama_cpp"]
    assert (settings.context, settings.threads, settings.sequences) == (4096, 1, 256)
    assert ggufs == {"small": tmp_path / "s.gguf"}
    result = invoke(["serve", "--gguf", f"small={tmp_path}/s.gguf"])
    assert result.exit_code == 2 and "--engine llama.cpp" in result.output


@pytest.mark.parametrize("args, option", [
    (["--port", "-1"], "--port"),
    (["--guard", "maybe"], "--guard"),
    (["--guard-signal", "vibes"], "--guard-signal"),
    (["--guard-action", "escalate"], "--guard-action"),
    (["--guard-action", "escalate:recent:300%"], "--guard-action"),
    (["--max-sessions", "0"], "--max-sessions"),
    (["--max-context", "1"], "--max-context"),
    (["--session-ttl", "x"], "--session-ttl"),
    (["--recompute", "sinks:300%"], "--recompute"),
    (["--min-speedup", "-1"], "--min-speedup"),
    (["--min-retention", "high"], "--min-retention"),
    (["--recompute", "recent:5%", "--min-speedup", "3"], "--min-speedup) choose each pair's"),
    (["--models", "a=x,a=y"], "--models"),
    (["--models", "a=x,b=y", "--mapper", "a:c=/tmp"], "--mapper"),
    (["--dtype", "fp8"], "--dtype"),
])
def test_serve_refuses_bad_values_before_loading_models(monkeypatch, args, option):
    import kvhandoff.cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "load_family", lambda *a: pytest.fail("models loaded despite a bad option"))
    result = invoke(["serve", *args])
    assert result.exit_code == 2, result.output
    assert option in result.output and len(result.output.strip().splitlines()) == 1


def test_fit_compact_options_write_a_compact_mapper_and_say_its_size(pair, tmp_path):
    small, large = pair
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "m"),
                                      "--sequences", "3", "--seq-len", "48", "--rank", "4", "--storage", "float16"])
    assert result.exit_code == 0, result.output
    mapper = Mapper.load(tmp_path / "m")
    assert mapper.manifest.method == "lowrank" and mapper.manifest.config.rank == 4
    storage = mapper.manifest.storage
    assert storage["weight_dtype"] == "float16"
    assert f"{storage['parameters']:,} parameters, {storage['file_bytes'] / 1e6:.1f} MB on disk" in result.output
    assert "MFLOP per token" in result.output
    result = invoke(["fit", "--source", small, "--target", large, "--out", str(tmp_path / "h"),
                                      "--sequences", "3", "--seq-len", "48", "--heads", "aligned",
                                      "--k-tolerance", "0.05"])
    assert result.exit_code == 0, result.output
    assert Mapper.load(tmp_path / "h").manifest.method == "blocks" and "k per target layer" in result.output
    for options, message in ((["--rank", "4", "--top-k", "2"], "needs top_k='all'"),
                             (["--heads", "some"], "unknown heads"), (["--k-tolerance", "-1"], "number >= 0"),
                             (["--method", "mlp", "--rank", "4"], "full ridge map")):
        bad = invoke(["fit", "--source", small, "--target", large, *options])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_guard_calibrate_records_each_directions_guard_in_its_mapper_folder(pair, tmp_path):
    """`kvhandoff guard-calibrate` on a tiny family saved to disk: each direction's guard, measured on its dev
    switches, lands in that direction's --mapper folder (the tensors untouched), where the server reads it."""
    from kvhandoff.runtime.switch.pair import SwitchSettings

    small, large = pair
    folders = {("small", "large"): tmp_path / "forward", ("large", "small"): tmp_path / "backward"}
    paths = {"small": small, "large": large}
    for (source, target), folder in folders.items():
        result = invoke(["fit", "--source", paths[source], "--target", paths[target], "--out", str(folder),
                         "--sequences", "3", "--seq-len", "48", "--top-k", "1"])
        assert result.exit_code == 0, result.output
    tensors = {pair: (folder / "mapper.safetensors").read_bytes() for pair, folder in folders.items()}
    mapper_options = [item for (a, b), folder in folders.items() for item in ("--mapper", f"{a}:{b}={folder}")]
    result = invoke(["guard-calibrate", "--models", f"small={small},large={large}", *mapper_options,
                     "--conversations", "2", "--turns", "2", "--time-limit", "600"])
    assert result.exit_code == 0, result.output
    loaded = {}
    for (source, target), folder in folders.items():
        loaded[source, target] = mapper = Mapper.load(folder)
        guard = mapper.manifest.guard
        assert guard is not None, result.output
        # 2 conversations of 2 turns, one per direction: one switch each
        assert (guard.signal, guard.label, guard.dev_switches, guard.dev_conversations) == (
            "entropy", "answer_changed", 1, 1)
        assert guard.recompute == SwitchSettings().served_recompute.spec
        assert guard.window == 64 and guard.target_rate is None
        assert (folder / "mapper.safetensors").read_bytes() == tensors[source, target]
        assert f"{source} → {target}: re-prefill when entropy > " in result.output and str(folder) in result.output
    policies = pair_guards(SwitchSettings(), loaded)
    assert {pair: (p.source, p.threshold) for pair, p in policies.items()} == {
        pair: ("recorded", mapper.manifest.guard.threshold) for pair, mapper in loaded.items()}
