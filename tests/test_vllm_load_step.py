"""The vLLM connector's load step (`kvhandoff.vllm.load_step`), without vLLM: a tiny Qwen2 ("small") and an exactly
related copy ("large"); the "mapped" rows are the large model's own rows with noise (a poor map), so what the load
step recomputes is told apart from what it leaves mapped."""

from __future__ import annotations

import copy

import pytest
import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import prefill
from kvhandoff.runtime.policy import SelectionInfo, budget_count, parse
from kvhandoff.runtime.seam import TransformersCache
from kvhandoff.vllm.family import FamilyConfig, mapped_load_end
from kvhandoff.vllm.layout import as_cache, as_rows
from kvhandoff.vllm.load_step import (
    LOAD_STEP_RULES,
    VLLM_CAPABILITIES,
    VLLM_LOAD_STEP_CAPABILITIES,
    LoadStep,
    LoadStepRecompute,
    recomputed_in_load_step,
)

from conftest import exactly_related, tiny_model

TOKENS = 48  # the loaded prefix
PROMPT = tuple((11 * i + 5) % 60 for i in range(TOKENS + 6))  # the prefix, then a new turn of 6 tokens


@pytest.fixture(scope="module")
def family():
    small = tiny_model("qwen2", layers=2, seed=3)
    large = exactly_related(small)
    ids = torch.tensor([PROMPT[:TOKENS]])
    own = {name: as_rows(prefill(model, ids)[0]) for name, model in (("small", small), ("large", large))}
    generator = torch.Generator().manual_seed(0)
    mapped = own["large"] + 0.5 * torch.randn(own["large"].shape, generator=generator)
    return LoadStepRecompute({"small": small, "large": large}), own, mapped


def _changed(rows: torch.Tensor, mapped: torch.Tensor) -> torch.Tensor:
    """The positions whose rows differ from the mapped ones (any layer, K or V)."""
    return ((rows - mapped).abs().amax(dim=(0, 1, 3, 4)) > 0).nonzero().flatten()


def test_every_position_recomputed_gives_the_targets_own_rows(family):
    step_models, own, mapped = family
    step = LoadStep(PROMPT, TOKENS, 0, 4, parse("turn_attention:100%"))
    rows, count = step_models.recompute(step, "large", "small", mapped, own["small"])
    assert count == TOKENS
    torch.testing.assert_close(rows, own["large"], atol=1e-4, rtol=1e-4)


def test_the_picks_are_the_sources_read_of_the_new_turn_and_only_they_change(family):
    step_models, own, mapped = family
    recompute = parse("turn_attention:25%")
    rows, count = step_models.recompute(LoadStep(PROMPT, TOKENS, 0, 4, recompute), "large", "small", mapped,
                                        own["small"])
    assert count == 4 + budget_count(0.25, TOKENS - 4)
    source_cache = TransformersCache(as_cache(own["small"]))
    picked = recompute.positions(step_models.models["large"], as_cache(mapped), torch.tensor([PROMPT[:TOKENS]]),
                                 SelectionInfo(start=4, new_turn=PROMPT[TOKENS:]), step_models.models["small"],
                                 source_cache)
    expected = torch.cat([torch.arange(4), picked[0]])
    assert torch.equal(_changed(rows, mapped), expected)
    # the first layer's rows of a recomputed position depend on its token and position only: the target's own
    torch.testing.assert_close(rows[0][:, expected], own["large"][0][:, expected], atol=1e-4, rtol=1e-4)


def test_the_load_step_runs_in_its_copies_dtype(family):
    step_models, own, mapped = family
    half = LoadStepRecompute({name: copy.deepcopy(model).to(torch.bfloat16)
                              for name, model in step_models.models.items()})
    rows, count = half.recompute(LoadStep(PROMPT, TOKENS, 0, 4, parse("turn_attention:100%")), "large", "small",
                                 mapped.bfloat16(), own["small"].bfloat16())
    assert rows.dtype == torch.bfloat16 and count == TOKENS
    torch.testing.assert_close(rows.float(), own["large"], atol=0.1, rtol=0.05)


def test_positions_before_start_are_vllms_own_and_never_recomputed(family):
    step_models, own, mapped = family
    start = 16
    rows, count = step_models.recompute(LoadStep(PROMPT, TOKENS, start, 4, parse("turn_attention:100%")), "large",
                                        "small", mapped, own["small"], own=own["large"])
    assert count == TOKENS - start  # the exact prefix lies inside vLLM's own positions
    torch.testing.assert_close(rows, own["large"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", ["sinks:10%", "deviation:10%", "blend:10%", "source_attention:10%",
                                  "target_turn_attention:10%", "mix(sinks=0.5,deviation=0.5):20%"])
def test_every_load_step_rule_recomputes_its_budget(family, spec):
    step_models, own, mapped = family
    recompute = parse(spec)
    assert recompute.rule in LOAD_STEP_RULES and recomputed_in_load_step(recompute)
    rows, count = step_models.recompute(LoadStep(PROMPT, TOKENS, 0, 0, recompute), "large", "small", mapped,
                                        own["small"])
    assert count == budget_count(recompute.budget, TOKENS) == len(_changed(rows, mapped))


def test_what_each_instance_can_recompute_and_where_a_load_ends():
    config = FamilyConfig.from_extra({"store_url": "redis://h:1/0", "model": "large",
                                      "mappers": {"small->large": "/m", "large->small": "/n"},
                                      "models": {"small": "/models/small"}})
    assert config.capabilities("small") is VLLM_LOAD_STEP_CAPABILITIES
    assert config.load_step_models == {"small": "/models/small"}
    other = FamilyConfig.from_extra({"store_url": "redis://h:1/0", "model": "small",
                                     "mappers": {"large->small": "/n"}, "models": {"small": "/models/small"}})
    assert other.capabilities("large") is VLLM_CAPABILITIES and other.load_step_models == {}
    assert VLLM_LOAD_STEP_CAPABILITIES.serves(parse("turn_attention:10%"))
    assert not VLLM_CAPABILITIES.serves(parse("turn_attention:10%"))
    assert not recomputed_in_load_step(parse("recent:10%")) and not recomputed_in_load_step(parse("none"))
    # the load step recomputes inside the loaded prefix: the whole prefix loads; vLLM's own tail for recent
    assert mapped_load_end(0, 256, parse("turn_attention:10%")) == 256
    assert mapped_load_end(0, 256, parse("recent:25%")) == 192
    assert FamilyConfig.from_extra({"store_url": "u", "model": "m", "load_step_dtype": "bfloat16"}).load_step_dtype \
        == torch.bfloat16
    with pytest.raises(ConfigError, match="load_step_dtype must be one of float32, bfloat16"):
        FamilyConfig.from_extra({"store_url": "u", "model": "m", "load_step_dtype": "half"})
    with pytest.raises(ConfigError, match="models must map family model names"):
        FamilyConfig.from_extra({"store_url": "u", "model": "m", "models": ["/models/small"]})


def test_a_load_step_outside_the_prompt_or_without_its_models_is_refused(family):
    step_models, own, mapped = family
    with pytest.raises(ConfigError, match=r"maps positions 0\.\.53 of a prompt of 54 tokens"):
        LoadStep(PROMPT, len(PROMPT), 0, 4, parse("turn_attention:10%"))  # vLLM computes the last token itself
    with pytest.raises(ConfigError, match="has no model 'tiny'"):
        step_models.recompute(LoadStep(PROMPT, TOKENS, 0, 4, parse("turn_attention:10%")), "large", "tiny", mapped,
                              own["small"])
    with pytest.raises(ConfigError, match=r"models\['small'\] = '/nowhere' could not be loaded"):
        LoadStepRecompute.load({"small": "/nowhere"})
