import json

import pytest
import torch

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.policy import NoRecompute, Recent
from kvhandoff_lab.bench import (
    bench_table,
    continuation_flops,
    mapper_flops_per_token,
    mapper_footprint,
    parse_lengths,
    peak_tensor_memory,
    prefill_flops,
    run_bench,
    summarize,
    synthetic_mapper,
)

from conftest import exactly_related, random_batches, tiny_model


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen2", layers=2)
    target = exactly_related(source)
    mapper = fit_mapper(source, target, random_batches(4), FitConfig(ridge_lambda=1e-6), progress=False)
    return source, target, mapper


def test_bench_writes_documented_fields_json_and_png(pair, tmp_path):
    source, target, mapper = pair
    result = run_bench(source, target, mapper, lengths=(12, 24), repeats=2, warmup=1, out_dir=tmp_path,
                       progress=False)
    assert [r["tokens"] for r in result["results"]] == [12, 24]
    for row in result["results"]:
        for path in ("handoff", "transfer", "select", "target_forward", "stored_prefix",
                     "stored_prefix_target_forward", "two_step", "reprefill"):
            stats = row[path]
            assert len(stats["samples"]) == 2 and stats["min"] <= stats["median"] <= stats["max"]
            assert stats["min"] <= stats["q1"] <= stats["q3"] <= stats["max"]
        assert row["speedup"] == pytest.approx(row["reprefill"]["median"] / row["handoff"]["median"])
        assert row["flop_bound"] > 0 and row["flops"]["mapper_per_token"] == mapper_flops_per_token(mapper)
        assert set(row["peak_memory_bytes"]) == {"handoff", "stored_prefix", "two_step", "reprefill"}
        assert all(isinstance(v, int) and v > 0 for v in row["peak_memory_bytes"].values())
        assert row["top1_agree"]  # exactly related pair: the handoff reproduces the target's own next token
        assert row["fused_equals_two_step"] <= 1e-5  # one target forward, the same logits as two
        assert row["speedup_two_step"] == pytest.approx(row["reprefill"]["median"] / row["two_step"]["median"])
        # the exact prefix copied from the store, not recomputed: the same logits, fewer tokens in the bound
        assert row["stored_prefix_equals_handoff"] <= 1e-5
        assert row["flop_bound_stored_prefix"] > row["flop_bound"]
        assert row["speedup_stored_prefix"] == pytest.approx(row["reprefill"]["median"]
                                                             / row["stored_prefix"]["median"])
    assert result["mapper"]["parameters"] == mapper.num_parameters()
    assert result["mapper"]["disk_bytes"] > mapper.nbytes() and result["mapper"]["memory_bytes"] >= mapper.nbytes()
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["format"] == "kvhandoff-bench/4" and len(saved["results"]) == 2
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert bench_table(result).row_count == 2


def test_flop_model_counts_k_and_attention(pair):
    source, target, _ = pair
    dense, sparse = synthetic_mapper(source, target), synthetic_mapper(source, target, top_k=1)
    assert mapper_flops_per_token(dense) == 2 * dense.weight.numel() + dense.bias.numel()
    assert mapper_flops_per_token(sparse) < mapper_flops_per_token(dense) / 1.5  # k=1 of 2 source layers
    constants = {"body_parameters": 100, "layers": 2, "q_width": 8, "lm_head": 50}
    assert prefill_flops(constants, 1) == 2 * 100 + 2 * 2 * 2 * 8 + 2 * 50
    assert prefill_flops(constants, 4) == 2 * 100 * 4 + 2 * 2 * 2 * 8 * 10 + 2 * 50
    # reading 3 tokens after 4 cached positions attends 5 + 6 + 7 keys; after none, it is a prefill
    assert continuation_flops(constants, 4, 3) == 2 * 100 * 3 + 2 * 2 * 2 * 8 * 18 + 2 * 50
    assert continuation_flops(constants, 0, 4) == prefill_flops(constants, 4)


def test_synthetic_mapper_transfers_and_footprint(pair):
    source, target, _ = pair
    mapper = synthetic_mapper(source, target, top_k=1)
    cache = mapper.transfer(source(input_ids=torch.randint(0, 128, (1, 7)), use_cache=True).cache)
    assert cache.layers[0].keys.shape == (1, 2, 7, 16) and len(cache.layers) == 2
    footprint = mapper_footprint(mapper)
    assert footprint["top_k"] == 1 and footprint["parameters"] == mapper.num_parameters()


def test_peak_memory_sees_tensor_allocations():
    def work():
        a = torch.ones(1 << 20)  # 4 MiB
        b = a * 2  # another 4 MiB while a lives
        del a
        return b

    _, peak = peak_tensor_memory(work)
    assert 8 << 20 <= peak < 9 << 20


def test_summaries_and_argument_checks(pair):
    stats = summarize([3.0, 1.0, 2.0])
    assert (stats["median"], stats["min"], stats["max"], stats["samples"]) == (2.0, 1.0, 3.0, [3.0, 1.0, 2.0])
    assert summarize([5.0])["q1"] == 5.0
    assert parse_lengths("64, 128,256") == [64, 128, 256]
    with pytest.raises(ConfigError):
        parse_lengths("64,abc")
    source, target, mapper = pair
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        run_bench(source, target, mapper, lengths=(8, 100_000), progress=False)
    with pytest.raises(ConfigError, match="> new_turn"):
        run_bench(source, target, mapper, lengths=(1,), progress=False)
    with pytest.raises(ConfigError, match="> new_turn"):
        run_bench(source, target, mapper, lengths=(8, 16), new_turn=8, progress=False)
    with pytest.raises(ConfigError, match="new_turn must be a positive integer"):
        run_bench(source, target, mapper, lengths=(8,), new_turn=0, progress=False)


def test_a_new_turn_read_by_the_target(pair):
    source, target, mapper = pair
    result = run_bench(source, target, mapper, lengths=(24,), repeats=1, warmup=0, new_turn=8, progress=False,
                       measure_memory=False)
    row = result["results"][0]
    assert result["settings"]["new_turn"] == 8 and row["new_turn_tokens"] == 8
    assert row["top1_agree"]  # the history mapped exactly, the turn read by the target: its own next token
    # 16 positions mapped; the target reads 8 tokens on top of them
    assert row["flops"]["transfer"] == mapper_flops_per_token(mapper) * 16
    one = run_bench(source, target, mapper, lengths=(24,), repeats=1, warmup=0, progress=False,
                    measure_memory=False)["results"][0]
    assert row["flops"]["handoff"] > one["flops"]["handoff"] and row["flop_bound"] < one["flop_bound"]


def test_bench_times_the_recompute_as_part_of_the_handoff(pair):
    source, target, mapper = pair
    result = run_bench(source, target, mapper, lengths=(12, 24), repeats=1, warmup=0, progress=False,
                       recompute=Recent(0.5))
    assert result["settings"]["recompute"] == "recent:50%"
    # mapped: T − 1 positions, of which the exact prefix (4) is never counted; half of the rest, rounded half up
    assert [row["recompute_tokens"] for row in result["results"]] == [4, 10]
    for row in result["results"]:
        assert len(row["select"]["samples"]) == 1 and row["select"]["median"] > 0
        assert row["flops"]["recompute"] > 0 and row["top1_agree"]
        assert row["fused_equals_two_step"] <= 1e-5
        assert all(v > 0 for v in row["peak_memory_bytes"].values())  # no warm-up: an extra profiled run
        parts = row["transfer"]["median"] + row["select"]["median"] + row["target_forward"]["median"]
        assert parts <= row["handoff"]["median"]
    plain = run_bench(source, target, mapper, lengths=(12,), repeats=1, warmup=0, progress=False,
                      measure_memory=False, two_step=False, recompute=NoRecompute())
    assert "two_step" not in plain["results"][0] and not plain["settings"]["two_step"]
    assert plain["settings"]["recompute"] == "none" and plain["results"][0]["recompute_tokens"] == 0
    assert plain["results"][0]["flops"]["recompute"] == 0
    assert bench_table(result).row_count == 2


def test_resident_weights_are_copies_with_the_same_values():
    model = tiny_model("qwen2", layers=1)
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    from kvhandoff_lab.bench import keep_resident

    keep_resident(model)
    for name, parameter in model.named_parameters():
        pointer, values = before[name]
        assert parameter.data_ptr() != pointer and torch.equal(parameter, values)
