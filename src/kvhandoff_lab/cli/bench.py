"""`bench`: latency of handoff vs the target's re-prefill, per context length; `bench-fit`: the fit's time and memory
next to the models' own forwards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_MIX,
    DEFAULT_SEQ_LEN,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DEFAULT_TOP_K,
    DeviceMap,
    Dtype,
    Mix,
    Progress,
    Recompute,
    SavedMapper,
    SeqLen,
    Source,
    Target,
    TopK,
    non_negative_int,
    one_of,
    option_errors,
    positive_float,
    positive_int,
    positive_ints,
)
from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.fit.corpus import calibration_batches
from kvhandoff.runtime.offset import DEFAULT_OFFSET_RECOMPUTE
from kvhandoff.workflow import load_named_pair, obtain_mapper
from kvhandoff.workflow.pair_mappers import on_source_device
from kvhandoff_lab.bench import DEFAULT_LENGTHS, bench_mapper, bench_table, run_bench
from kvhandoff_lab.engine_bench import DEFAULT_ENGINE_LENGTHS
from kvhandoff_lab.fitbench import describe_fit_cost, run_fit_bench
from kvhandoff_lab.vllm_bench import DEFAULT_VLLM_LENGTHS


def bench(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    mapper: SavedMapper = None,
    lengths: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help="comma-separated context "
                                                                                      "lengths")]
    = ",".join(map(str, DEFAULT_LENGTHS)),
    repeats: Annotated[int, typer.Option(parser=positive_int, help="timed repeats per path and length")] = 5,
    warmup: Annotated[int, typer.Option(parser=non_negative_int, help="untimed warm-up runs per path and length")]
    = 1,
    out: Annotated[Path, typer.Option(help="folder for bench.json and bench.png")] = Path("runs/bench"),
    synthetic: Annotated[bool, typer.Option(help="time a random mapper of the pair's shape (no fit needed; "
                                                 "latency does not depend on the weights)")] = False,
    k: TopK = "all",
    threads: Annotated[int | None, typer.Option(parser=positive_int, help="torch CPU threads (default: torch's "
                                                                          "choice)")] = None,
    budget: Annotated[float | None, typer.Option(parser=positive_float, help="stop starting new lengths after "
                                                                             "this many seconds")] = None,
    memory: Annotated[bool, typer.Option(help="measure peak tensor memory of each path")] = True,
    new_turn: Annotated[int, typer.Option(parser=positive_int, help=(
        "tokens at the end of each context the target reads itself (1: all mapped; more: a switch at a turn "
        "boundary)"))] = 1,
    recompute: Recompute = None,
    two_step: Annotated[bool, typer.Option(help="also time the handoff whose target recomputes the exact prefix in "
                                                "a forward of its own before it reads the new turn")] = True,
    prefix_store: Annotated[bool, typer.Option(help="also time the handoff whose exact prefix is copied from a "
                                                    "store of conversation openings (as `serve` keeps)")] = True,
    resident: Annotated[bool, typer.Option(help="copy the models' weights out of their file-backed memory maps "
                                                "first, so that memory pressure cannot send a timed forward to the "
                                                "disk")] = True,
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
) -> None:
    """Latency of handoff (transfer + one target forward: the exact prefix and the new turn) vs the target's
    re-prefill, per context length, with peak tensor memory and the FLOP bound."""
    if threads is not None:
        torch.set_num_threads(threads)
    pair = load_named_pair(source, target, dtype, progress=True, device_map=device_map)
    the_mapper, note = bench_mapper(pair, mapper, synthetic, k, progress=True)
    on_source_device(the_mapper, pair.source)
    typer.echo(note)
    result = run_bench(pair.source, pair.target, the_mapper, lengths, repeats=repeats, warmup=warmup, out_dir=out,
                       time_budget_s=budget, measure_memory=memory, source_name=source, target_name=target,
                       new_turn=new_turn, recompute=recompute, two_step=two_step, resident=resident,
                       prefix_store=prefix_store, progress=True)
    Console().print(bench_table(result))
    typer.echo(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    if result["failed"] or result["skipped"]:
        typer.echo(f"not measured: skipped {result['skipped']}, failed {[f['tokens'] for f in result['failed']]}")


def bench_fit(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    windows: Annotated[int, typer.Option(parser=positive_int, help=(
        f"calibration windows measured (the default fit reads {CalibrationSpec().num_sequences}); the ratios "
        "are also projected to that many"))] = 8,
    seq_len: SeqLen = DEFAULT_SEQ_LEN,
    groups: Mix = DEFAULT_MIX,
    k: TopK = DEFAULT_TOP_K,
    inputs: Annotated[str, typer.Option(parser=one_of(("own", "kv")), help=(
        "what each map reads of the selected source layers: 'own' or 'kv' (as `fit --inputs`)"))] = "own",
    both_directions: Annotated[bool, typer.Option("--both-directions", help=(
        "the pass sums the target's whole Gram too, as `fit --both-directions` does"))] = False,
    threads: Annotated[int | None, typer.Option(parser=positive_int, help="torch CPU threads (default: torch's "
                                                                          "choice)")] = None,
    out: Annotated[Path, typer.Option(help="folder for bench-fit.json")] = Path("runs/bench-fit"),
    dtype: Dtype = DEFAULT_DTYPE,
    progress: Progress = True,
) -> None:
    """The fit's wall time and peak memory next to a forward-only pass of both models over the same calibration
    windows, in one process, interleaved window by window (the statistics pass, then the solve; on the CPU)."""
    if threads is not None:
        torch.set_num_threads(threads)
    with option_errors("--windows", "--mix", "--top-k", "--inputs"):
        calibration = CalibrationSpec(num_sequences=windows, seq_len=seq_len, mix=groups)
        config = FitConfig(top_k=k, source_inputs=inputs)
    pair = load_named_pair(source, target, dtype, progress=progress)
    corpus = calibration_batches(pair.tokenizer, calibration.num_sequences, calibration.seq_len,
                                 seed=calibration.seed, batch_size=calibration.batch_size, mix=calibration.mix)
    description = {"source": source, "target": target, "calibration": corpus.describe()}
    result = run_fit_bench(pair.source, pair.target, list(corpus), out, config, both_directions, description,
                           progress)
    for line in describe_fit_cost(result):
        typer.echo(line)
    typer.echo(f"wrote {out / 'bench-fit.json'}")


#: the switch directions of the engine commands
Directions = Annotated[str, typer.Option(parser=one_of(("both", "up", "down")), help=(
    "both, up (source → target) or down (target → source)"))]
#: the CPU threads of both engines
EngineThreads = Annotated[int | None, typer.Option(parser=positive_int, help=(
    "CPU threads of torch and llama.cpp (default: each library's choice)"))]


#: the engine comparisons' items (`eval-llama-cpp`, `eval-vllm`)
GenerativeTask = Annotated[str, typer.Option(help="a generative task of the switch benchmark (coqa_gen, nq_open, "
                                                  "gsm8k_cot)")]
ItemLimit = Annotated[int, typer.Option(parser=positive_int, help="items per direction (report pool)")]
Histories = Annotated[int, typer.Option(parser=positive_int, help="histories the items share")]
ItemBudget = Annotated[float | None, typer.Option(parser=positive_float, help="start no new item after this many "
                                                                              "seconds (rerun to continue)")]


def _pair_directions(source: str, target: str, directions: str):
    """(the pair in transformers, the directions asked for as (source, target) names, each one's default mapper)."""
    pair = load_named_pair(source, target, progress=True)
    wanted = {"both": [(source, target), (target, source)], "up": [(source, target)],
              "down": [(target, source)]}[directions]
    mappers = {names: obtain_mapper(pair if names == (source, target) else pair.reversed(), progress=True,
                                    both_directions=True)[0] for names in wanted}
    return pair, wanted, mappers


def bench_llama_cpp(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    lengths: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help="comma-separated context "
                                                                                      "lengths")]
    = ",".join(map(str, DEFAULT_ENGINE_LENGTHS)),
    directions: Directions = "both",
    new_turn: Annotated[int, typer.Option(parser=positive_int, help="tokens at the end of each context the target "
                                                                    "reads itself")] = 1,
    recompute: Recompute = None,
    repeats: Annotated[int, typer.Option(parser=positive_int, help="timed repeats per length and direction")] = 1,
    decode_steps: Annotated[int, typer.Option(parser=positive_int, help="greedy decode steps timed after the "
                                                                        "switch")] = 16,
    transformers: Annotated[bool, typer.Option(help="also time the transformers engine on the same contexts")]
    = True,
    threads: EngineThreads = None,
    cache_type: Annotated[str, typer.Option(parser=one_of(("f16", "f32", "bf16")), help="llama.cpp's K/V cache "
                                                                                         "type")] = "f16",
    flash_attn: Annotated[bool, typer.Option(help="llama.cpp's flash attention")] = False,
    budget: Annotated[float | None, typer.Option(parser=positive_float, help="start no new row after this many "
                                                                             "seconds")] = None,
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every row)")]
    = Path("runs/bench_llama_cpp.json"),
) -> None:
    """A switch in llama.cpp on the registry pair's GGUFs: the handoff's time to first logits against llama.cpp's own
    re-prefill, where the time goes, decode speed after it, and the KL against the target's own cache — with the
    transformers engine beside it."""
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings
    from kvhandoff_lab.engine_bench import engine_table, run_engine_bench

    if threads is not None:
        torch.set_num_threads(threads)
    pair, wanted, mappers = _pair_directions(source, target, directions)
    settings = LlamaCppSettings(context=2 * max(lengths) + 64, sequences=8, threads=threads, cache_type=cache_type,
                                flash_attn=flash_attn)
    result = run_engine_bench({source: pair.source, target: pair.target}, mappers, pair.tokenizer, lengths,
                              wanted, new_turn, recompute, repeats, decode_steps, transformers, settings, out=out,
                              time_budget_s=budget)
    typer.echo("\n".join(engine_table(result)))
    typer.echo(f"wrote {out}")


def eval_llama_cpp(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    task: GenerativeTask = "coqa_gen",
    limit: ItemLimit = 40,
    histories: Histories = 8,
    directions: Directions = "both",
    recompute: Recompute = None,
    threads: EngineThreads = None,
    budget: ItemBudget = None,
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every item; a rerun continues)")]
    = Path("runs/eval_llama_cpp.json"),
) -> None:
    """A switch's answers in llama.cpp against the same switch in transformers, on the switch benchmark's generative
    items: target alone and switch, per engine and direction, with paired intervals."""
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings
    from kvhandoff.serving.decoding import end_ids
    from kvhandoff_lab.engine_bench import llama_twins
    from kvhandoff_lab.engine_quality import run_engine_quality

    if threads is not None:
        torch.set_num_threads(threads)
    pair, wanted, mappers = _pair_directions(source, target, directions)
    models = {source: pair.source, target: pair.target}
    twins = llama_twins(models, LlamaCppSettings(context=16384, sequences=16, threads=threads))
    try:
        result = run_engine_quality({"llama.cpp": twins, "transformers": models}, mappers, pair.tokenizer,
                                    end_ids(pair.target, pair.tokenizer), task, limit, histories, wanted, recompute,
                                    out, budget)
    finally:
        for model in twins.values():
            model.close()
    typer.echo(json.dumps(result["summary"], indent=2))
    typer.echo(f"wrote {out}")


ScatteredRecompute = Annotated[bool, typer.Option(
    help="the connectors hold copies of the models and recompute the positions the policy picks anywhere in "
         "the history in their load step (the recorded turn_attention); without, the history's latest positions only "
         "(recent)")]


def bench_vllm(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    lengths: Annotated[tuple, typer.Option(parser=positive_ints, metavar="LIST", help="comma-separated history "
                                                                                      "lengths (multiples of 128)")]
    = ",".join(map(str, DEFAULT_VLLM_LENGTHS)),
    directions: Directions = "both",
    new_turn: Annotated[int, typer.Option(parser=positive_int, help="tokens of the new turn the target reads after "
                                                                    "the history")] = 32,
    decode_tokens: Annotated[int, typer.Option(parser=positive_int, help="greedy tokens streamed after the first, "
                                                                         "timed as decode")] = 32,
    work: Annotated[Path, typer.Option(help="folder for the vLLM servers' and the store's files")]
    = Path("runs/bench_vllm"),
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every row)")]
    = Path("runs/bench_vllm.json"),
    scattered_recompute: ScatteredRecompute = True,
) -> None:
    """A switch between two vLLM instances (each model its own server process, the kvhandoff connector in both, the
    K/V through a Valkey/Redis store): time to first token against the target instance's own prefill of the same
    prompt, for the whole history mapped and for the pair's policy in vLLM, where the time goes, decode after."""
    import gc

    from kvhandoff.runtime.switch.pair import SwitchSettings, served_recompute
    from kvhandoff.vllm.launch import model_folder, vllm_python
    from kvhandoff.vllm.load_step import vllm_capabilities
    from kvhandoff_lab.bench import model_flops
    from kvhandoff_lab.engine_bench import context_ids
    from kvhandoff_lab.vllm_bench import Direction, run_vllm_bench, vllm_table

    vllm_python()  # refused before the models load when the vLLM environment is missing
    pair = load_named_pair(source, target, progress=True)
    wanted = {"both": [(source, target), (target, source)], "up": [(source, target)],
              "down": [(target, source)]}[directions]
    flops = {source: model_flops(pair.source), target: model_flops(pair.target)}
    folders = {spec: model_folder(spec) for spec in (source, target)}
    mapper_folders, plan = {}, []
    for names in wanted:
        mapper, folder, _ = obtain_mapper(pair if names == (source, target) else pair.reversed(), progress=True,
                                          both_directions=True)
        mapper_folders[names] = folder
        served = served_recompute(SwitchSettings(), mapper.manifest.recompute, " → ".join(names),
                                  vllm_capabilities(scattered_recompute))
        plan.append(Direction(names[0], names[1], flops[names[1]], mapper.flops_per_token(), served.policy.spec,
                              flops[names[0]]))
    ids = context_ids(pair.tokenizer, max(lengths) + new_turn)[0].tolist()
    history, turn = ids[: max(lengths)], ids[max(lengths):]
    del pair, mapper
    gc.collect()
    result = run_vllm_bench(folders, mapper_folders, plan, history, turn, lengths, work, out, decode_tokens,
                            scattered_recompute=scattered_recompute)
    typer.echo("\n".join(vllm_table(result)))
    typer.echo(f"wrote {out}")


def eval_vllm(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    task: GenerativeTask = "coqa_gen",
    limit: ItemLimit = 80,
    histories: Histories = 8,
    directions: Directions = "up",
    recompute: Recompute = None,
    budget: ItemBudget = None,
    work: Annotated[Path, typer.Option(help="folder for the vLLM servers' and the store's files")]
    = Path("runs/eval_vllm"),
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every item; a rerun continues)")]
    = Path("runs/eval_vllm.json"),
    scattered_recompute: ScatteredRecompute = True,
) -> None:
    """A switch's answers between two vLLM instances (the kvhandoff connector in both) against the same switch in
    transformers, on the switch benchmark's generative items: target alone and switch, per engine and direction,
    with paired intervals. Both engines recompute by --recompute, else by the policy the pair serves in vLLM."""
    from kvhandoff.runtime.switch.pair import SwitchSettings, served_recompute
    from kvhandoff.serving.decoding import end_ids
    from kvhandoff.vllm.launch import model_folder, vllm_python
    from kvhandoff.vllm.load_step import vllm_capabilities
    from kvhandoff.vllm.store import local_store
    from kvhandoff_lab.engine_quality import run_engine_quality
    from kvhandoff_lab.vllm_bench import VllmAnswers, vllm_servers

    vllm_python()  # refused before the models load when the vLLM environment is missing
    capabilities = vllm_capabilities(scattered_recompute)
    if recompute is not None and not capabilities.serves(recompute):
        raise typer.BadParameter(capabilities.refusal(recompute), param_hint="--recompute")
    pair, wanted, mappers = _pair_directions(source, target, directions)
    policies = {served_recompute(SwitchSettings(recompute=recompute), mapper.manifest.recompute, " → ".join(names),
                                 capabilities).policy for names, mapper in mappers.items()}
    if len(policies) != 1:
        specs = ", ".join(sorted(policy.spec for policy in policies))
        raise typer.BadParameter(f"the directions are served under different policies ({specs}); give one",
                                 param_hint="--recompute")
    (policy,) = policies
    folders = {spec: model_folder(spec) for spec in (source, target)}
    work.mkdir(parents=True, exist_ok=True)
    connector = {"mappers": {f"{a}->{b}": str(mapper.folder) for (a, b), mapper in mappers.items()},
                 "recompute": policy.spec}
    if scattered_recompute:
        connector["models"] = {name: str(folder) for name, folder in folders.items()}
    with local_store(work, max_memory="8gb") as store_url, \
            vllm_servers(folders, {**connector, "store_url": store_url}, work, max_model_len=8192) as servers:
        engines = {"vLLM": VllmAnswers(servers), "transformers": {source: pair.source, target: pair.target}}
        result = run_engine_quality(engines, mappers, pair.tokenizer, end_ids(pair.target, pair.tokenizer), task,
                                    limit, histories, wanted, policy, out, budget)
    typer.echo(json.dumps(result["summary"], indent=2))
    typer.echo(f"wrote {out}")


def eval_offset(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    task: GenerativeTask = "coqa_gen",
    limit: ItemLimit = 80,
    histories: Histories = 8,
    directions: Directions = "up",
    same_model: Annotated[bool, typer.Option(help="also each direction's target handing to itself (a changed "
                                                  "system prompt)")] = True,
    policies: Annotated[str, typer.Option(help="comma-separated recompute policies tried (each a condition)")]
    = f"none,{DEFAULT_OFFSET_RECOMPUTE.spec}",
    pool: Annotated[str, typer.Option(parser=one_of(("dev", "report")), help="the items' pool (choose on dev, "
                                                                            "report on report)")] = "report",
    threads: EngineThreads = None,
    budget: ItemBudget = None,
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every item; a rerun continues)")]
    = Path("runs/eval_offset.json"),
) -> None:
    """The switch benchmark with the history behind other instructions: the run reused at its new offset under each
    recompute policy against the target reading everything again, per direction, with paired intervals."""
    from kvhandoff.runtime import policy as recompute_policy
    from kvhandoff.serving.decoding import end_ids
    from kvhandoff_lab.offset_quality import run_offset_quality

    if threads is not None:
        torch.set_num_threads(threads)
    with option_errors("--policies"):
        tried = [recompute_policy.parse(spec) for spec in re.split(r",(?![^()]*\))", policies)]
    pair, wanted, mappers = _pair_directions(source, target, directions)
    if same_model:
        wanted += [(b, b) for _, b in wanted if (b, b) not in wanted]
    models = {source: pair.source, target: pair.target}
    result = run_offset_quality(models, mappers, pair.tokenizer, end_ids(pair.target, pair.tokenizer), tried,
                                wanted, task, limit, histories, pool, out, budget)
    typer.echo(json.dumps(result["summary"], indent=2))
    typer.echo(f"wrote {out}")


def eval_heal(
    source: Source = DEFAULT_SOURCE,
    target: Target = DEFAULT_TARGET,
    conversations: Annotated[int, typer.Option(parser=positive_int, help="CoQA conversations of the report pool")]
    = 40,
    turns: Annotated[int, typer.Option(parser=positive_int, help="turns of each conversation (those with fewer "
                                                                 "are skipped)")] = 10,
    every: Annotated[int, typer.Option(parser=positive_int, help="turns each model answers before the switch")]
    = 2,
    recompute: Recompute = None,
    threads: EngineThreads = None,
    budget: ItemBudget = None,
    out: Annotated[Path, typer.Option(help="the result (JSON, rewritten after every conversation; a rerun "
                                           "continues)")] = Path("runs/eval_heal.json"),
) -> None:
    """Multi-turn CoQA with a switch every --every turns, under each direction's served recompute policy: the
    answers with the history mapped, with it mapped and healed between the turns, and each model on its own cache,
    per turn, with paired intervals and the healing's time."""
    import random

    from kvhandoff.runtime.prefix_store import PrefixStore
    from kvhandoff.runtime.switch.pair import SwitchSettings, pair_policies
    from kvhandoff.serving.decoding import end_ids
    from kvhandoff_lab.evaluation.multiturn import load_coqa_conversations
    from kvhandoff_lab.evaluation.tasks import pool_of
    from kvhandoff_lab.heal_quality import run_heal_quality

    if threads is not None:
        torch.set_num_threads(threads)
    pair, _, mappers = _pair_directions(source, target, "both")
    policies = pair_policies(SwitchSettings(recompute=recompute), mappers, PrefixStore())
    chosen = [c for c in load_coqa_conversations(min_turns=turns, num_turns=turns)
              if pool_of("coqa", c.id) == "report"]
    random.Random("heal/coqa/report").shuffle(chosen)
    result = run_heal_quality({source: pair.source, target: pair.target}, mappers,
                              {names: policy.plan for names, policy in policies.items()}, pair.tokenizer,
                              end_ids(pair.target, pair.tokenizer), chosen[:conversations], every, out=out,
                              time_budget_s=budget,
                              settings={"recompute": {policy.name: policy.recompute.policy.spec
                                                      for policy in policies.values()}, "turns": turns})
    typer.echo(json.dumps(result["summary"], indent=2))
    typer.echo(f"wrote {out}")
