import pytest

from kvhandoff.config import FitConfig, kvhandoff_home
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.model.placement import ModelPlacement


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_k", 0, "top_k"),
        ("top_k", "most", "top_k"),
        ("top_k", True, "top_k"),
        ("ridge_lambda", 0.0, "ridge_lambda"),
        ("token_stride", 0, "token_stride"),
        ("skip_first_tokens", -1, "skip_first_tokens"),
        ("row_weights", "loss", "row_weights must be one of uniform, attention"),
    ],
)
def test_invalid_settings_are_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        FitConfig(**{field: value})


def test_defaults_follow_the_paper_and_errors_share_a_base():
    config = FitConfig()
    assert (config.ridge_lambda, config.token_stride, config.top_k) == (0.01, 4, "all")
    assert issubclass(ConfigError, KVHandoffError)


def test_row_weights_key_the_pass_and_the_mapper_only_when_weighted():
    uniform, weighted = FitConfig(), FitConfig(row_weights="attention")
    assert uniform.pass_key() == (4, 0) and weighted.pass_key() == (4, 0, "attention")
    assert "row_weights" not in uniform.key_dict() and "row_weights" not in uniform.to_dict()
    assert weighted.key_dict()["row_weights"] == weighted.to_dict()["row_weights"] == "attention"
    assert not uniform.weighted and weighted.weighted
    with pytest.raises(ConfigError, match="held-out calibration rows unweighted"):
        FitConfig(top_k="heldout", ridge_lambda="heldout", row_weights="attention")


def test_home_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path))
    assert kvhandoff_home() == tmp_path


def test_gcv_lambda_is_accepted_and_probes_use_a_fixed_lambda():
    assert FitConfig(ridge_lambda="gcv").probe_lambda == 0.01
    assert FitConfig(ridge_lambda=0.3).probe_lambda == 0.3
    with pytest.raises(ConfigError, match="'gcv'"):
        FitConfig(ridge_lambda="auto")


def test_calibration_mix_is_validated_and_keeps_default_cache_keys():
    from kvhandoff.config import CalibrationSpec

    # the prose-only mix is left out of the key dict: statistics cached before `mix` existed stay valid
    prose = CalibrationSpec(num_sequences=40, mix=("prose",))
    assert prose.to_dict() == {"num_sequences": 40, "seq_len": 512, "seed": 0, "batch_size": 1}
    assert CalibrationSpec().mix == ("prose", "exams", "math") and CalibrationSpec().num_sequences == 120
    assert CalibrationSpec().to_dict()["mix"] == ["prose", "exams", "math"]
    mixed = CalibrationSpec(num_sequences=81, mix=("prose", "exams"))
    assert mixed.to_dict()["mix"] == ["prose", "exams"]
    assert mixed.windows_per_group() == {"prose": 41, "exams": 40}
    assert CalibrationSpec(num_sequences=122, mix=("prose", "exams", "math")).windows_per_group() == \
        {"prose": 41, "exams": 41, "math": 40}
    for bad, message in (((), "mix"), ("prose", "mix"), (("prose", "prose"), "twice"), (("poetry",), "mix")):
        with pytest.raises(ConfigError, match=message):
            CalibrationSpec(mix=bad)
    with pytest.raises(ConfigError, match="window"):
        CalibrationSpec(num_sequences=1, mix=("prose", "exams"))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"steps": 0}, "steps"),
        ({"batch_size": True}, "batch_size"),
        ({"continuation": -1}, "continuation"),
        ({"min_context": 1}, "min_context"),
        ({"min_context": 64, "max_context": 32}, "min_context"),
        ({"learning_rate": 0.0}, "learning_rate"),
    ],
)
def test_invalid_refine_settings_are_refused(settings, message):
    from kvhandoff.config import RefineConfig

    with pytest.raises(ConfigError, match=message):
        RefineConfig(**settings)


def test_one_positive_validator_names_the_setting():
    from kvhandoff.config import CalibrationSpec, MLPConfig, require_positive

    require_positive("n", 3)
    require_positive("rate", 0.5, float)
    require_positive("count", 0, minimum=0)
    for value, kind in ((0, int), (-2, int), (True, int), (2.0, int), ("3", int), (0.0, float),
                        (float("nan"), float), (float("inf"), float), (False, float)):
        with pytest.raises(ConfigError, match="my_setting must be"):
            require_positive("my_setting", value, kind)
    with pytest.raises(ConfigError, match="count must be an integer >= 0, got -1"):
        require_positive("count", -1, minimum=0)
    # every config dataclass goes through it
    with pytest.raises(ConfigError, match="seq_len must be a positive integer"):
        CalibrationSpec(seq_len=0)
    with pytest.raises(ConfigError, match="mlp learning_rate must be a number > 0"):
        MLPConfig(learning_rate=float("nan"))
    with pytest.raises(ConfigError, match="mlp weight_decay must be a number >= 0"):
        MLPConfig(weight_decay=-1e-3)
    with pytest.raises(ConfigError, match="ridge_lambda must be a number > 0"):
        FitConfig(ridge_lambda=float("inf"))
    with pytest.raises(ConfigError, match="exact_prefix must be an integer >= 0"):
        FitConfig(exact_prefix=1.5)


@pytest.mark.parametrize(("name", "canonical"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                                 ("bfloat16", "bfloat16")])
def test_model_dtypes_have_short_and_torch_names(name, canonical):
    assert ModelPlacement(dtype=name).dtype == canonical


@pytest.mark.parametrize("device_map", [None, "auto", "balanced", "sequential", "cpu", "cuda", "cuda:3"])
def test_device_maps_accelerate_plans_or_one_device(device_map):
    placement = ModelPlacement(device_map=device_map)
    assert placement.planned == (device_map in ("auto", "balanced", "sequential"))


@pytest.mark.parametrize(("settings", "message"), [({"dtype": "int8"}, "dtype must be one of"),
                                                   ({"device_map": "gpu"}, "device_map must be one of"),
                                                   ({"device_map": "cuda:one"}, "device_map must be one of")])
def test_bad_placements_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        ModelPlacement(**settings)
