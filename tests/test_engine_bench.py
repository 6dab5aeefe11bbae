"""The llama.cpp switch bench on the tiny exactly related family: every part timed, the handoff's next-token
distribution the target's own in both engines, the result written as it goes."""

import json

import pytest

from _serving_support import tiny_family

pytest.importorskip("llama_cpp")

from _llama_support import write_gguf
from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings
from kvhandoff_lab.engine_bench import context_ids, engine_table, run_engine_bench


def test_the_bench_times_each_part_and_finds_the_exact_pair_exact(tmp_path):
    family, mappers = tiny_family()
    models = {name: model for name, (model, _) in family.items()}
    tokenizer = family["small"][1]
    ggufs = {name: write_gguf(model, tmp_path / f"{name}.gguf") for name, model in models.items()}
    settings = LlamaCppSettings(context=256, sequences=8, threads=1, batch=64, cache_type="f32")
    out = tmp_path / "bench.json"
    result = run_engine_bench(models, mappers, tokenizer, lengths=(48, 24), new_turn=4, recompute="recent:10%",
                              decode_steps=2, settings=settings, ggufs=ggufs, out=out)
    assert [(row["tokens"], row["direction"]) for row in result["results"]] == [
        (24, "small → large"), (24, "large → small"), (48, "small → large"), (48, "large → small")]
    for row in result["results"]:
        for part in ("handoff", "reprefill", "state_read", "parse", "map", "import", "select", "target_forward",
                     "transformers_handoff", "transformers_reprefill"):
            assert row[part]["median"] > 0, part
        assert 0 < row["recompute_tokens"] < row["tokens"] // 5
        assert row["kl_handoff_vs_own"] < 1e-4 and row["transformers_kl_handoff_vs_own"] < 1e-4
        assert row["kl_llama_cpp_vs_transformers_own"] < 1e-4 and row["top1_agree"]
        assert row["decode_tokens_per_second"]["after_handoff"] > 0 and row["flop_bound"] > 1
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(result["results"]))
    assert len(engine_table(result)) == 2 + 4


def test_contexts_are_held_out_text_cut_to_length():
    tokenizer = tiny_family()[0]["small"][1]
    ids = context_ids(tokenizer, 100)
    assert ids.shape == (1, 100)
    assert tokenizer.decode(ids[0]).strip()
