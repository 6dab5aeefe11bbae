"""A switch in llama.cpp: time to the target's first logits by the handoff against llama.cpp's own re-prefill, decode
speed after it, where the handoff's time goes, and what the GGUF's quantisation costs — with the transformers
engine's figures for the same contexts in the same run.

For each context length T and direction, the context is held-out text (`heldout_texts`, tokenized, cut to T); its
last ``new_turn`` tokens are the new turn. The source reads the history in its own llama.cpp context (untimed: a
handoff starts from a cache the source has). Then, interleaved, per repeat:

- handoff (llama.cpp): the source's sequence state read out of its context ("state_read", `state_bytes`) and parsed
  ("parse"); the mapper's transfer ("map"); the rows written into a fresh sequence of the target's context
  ("import"); the positions the plan has the target recompute chosen ("select": for `turn_attention`, the source's
  read of the new turn) and recomputed, with the new turn read on top, to its logits ("target_forward");
- re-prefill (llama.cpp): the target's own read of all T tokens in a fresh sequence;
- with ``transformers``: the same handoff and re-prefill in the transformers engine (float32).

After the last repeat, each engine decodes ``decode_steps`` greedy tokens on the handed-over cache and on the
re-prefilled one (tokens/s). Quality: the KL of the target's next-token distribution after the handoff against its
own (re-prefilled) one, in each engine, and between the two engines' handoffs; and the KL between the engines'
own caches (what the GGUF's quantisation and llama.cpp's kernels change). The FLOP bound is `bench.row_flops`'s.
The first length runs every path once untimed first (llama.cpp sizes its compute buffers then).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.text_sources import heldout_texts
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import kl_divergence
from kvhandoff.model.loading import model_gguf
from kvhandoff.runtime.handoff import MappedCache, map_for_target
from kvhandoff.runtime.llama_cpp import LLAMA_CPP_PYTHON_VERSION
from kvhandoff.runtime.llama_cpp.backend import LlamaCppModel, LlamaCppSettings, llama_cpp_twin
from kvhandoff.runtime.llama_cpp.state import parse, to_rows
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy, SelectionInfo
from kvhandoff.runtime.seam import TransformersCache, rows_of
from kvhandoff_lab.bench import mapper_flops_per_token, model_flops, recomputed_tokens, row_flops, summarize

logger = logging.getLogger(__name__)

ENGINE_BENCH_FORMAT = "kvhandoff-engine-bench/1"
DEFAULT_ENGINE_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def context_ids(tokenizer, tokens: int) -> torch.Tensor:
    """[1, tokens] ids of held-out text (the report pool's papers, joined)."""
    ids: list[int] = []
    for text in heldout_texts():
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            return torch.tensor([ids[:tokens]])
    raise ConfigError(f"the held-out texts hold {len(ids)} tokens, fewer than the {tokens} asked for")


def _kl(own: torch.Tensor, other: torch.Tensor) -> float:
    return float(kl_divergence(own.float().log_softmax(-1), other.float().log_softmax(-1)))


def _llama_handoff(source: LlamaCppModel, target: LlamaCppModel, mapper: Mapper, source_cache, ids: torch.Tensor,
                   new_turn: int, plan: HandoffPlan):
    """The llama.cpp handoff, timed by part; (target cache, logits [vocab], {part: seconds})."""
    history, turn = ids[:, :-new_turn], ids[:, -new_turn:]
    t0 = time.perf_counter()
    blob = source.state_bytes(source_cache.seq)
    t1 = time.perf_counter()
    rows = parse(blob, source.layout)
    t2 = time.perf_counter()
    mapped_rows = mapper.transfer(rows_of(to_rows(rows, source.layout)), dtype=torch.float32)
    t3 = time.perf_counter()
    cache = target.new_cache()
    cache.append(mapped_rows)
    t4 = time.perf_counter()
    mapped = MappedCache.from_mapped(cache, target, history, mapper, plan, _turn_info(turn), source, source_cache)
    t5 = time.perf_counter()
    logits = mapped.read(target, turn)[0, -1]
    t6 = time.perf_counter()
    return cache, logits, {"state_read": t1 - t0, "parse": t2 - t1, "map": t3 - t2, "import": t4 - t3,
                           "select": t5 - t4, "target_forward": t6 - t5}


def _turn_info(turn: torch.Tensor) -> SelectionInfo:
    """What a recompute policy that reads the new turn (`turn_attention`) is given: the turn's ids."""
    return SelectionInfo(new_turn=tuple(turn[0].tolist()))


def _decode_rate(cache, model, first_logits: torch.Tensor, steps: int) -> float:
    """Tokens per second of greedy decoding on ``cache`` (a `KVCache`) after ``first_logits``: one over the median
    time of ``steps`` steps (a step that waits on another process does not decide it)."""
    token = int(first_logits.argmax())
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        token = int(cache.read(model, torch.tensor([[token]]))[0, -1].argmax())
        seconds.append(time.perf_counter() - started)
    return 1 / statistics.median(seconds)


def bench_direction(names: tuple[str, str], models: dict, llama: dict, mapper: Mapper, ids: torch.Tensor,
                    new_turn: int, plan: HandoffPlan, repeats: int, decode_steps: int, transformers: bool,
                    warmup: int = 0) -> dict:
    """One length and direction (``names``: source, target): the row; ``warmup`` untimed runs of every path
    first."""
    source_name, target_name = names
    source, target = llama[source_name], llama[target_name]
    history = ids[:, :-new_turn]
    started = time.perf_counter()
    source_cache = source.new_cache()
    source_cache.read(source, history)
    source_seconds = time.perf_counter() - started
    tf_source_cache = None
    if transformers:
        tf_source_cache = TransformersCache()
        tf_source_cache.read(models[source_name], history)
    timings: dict[str, list[float]] = {}
    cache = own = None
    for repeat in range(warmup + repeats):
        cache = own = None  # the last repeat's sequences go back to the context before this one's import
        if repeat == warmup:
            timings.clear()
        started = time.perf_counter()
        cache, logits, parts = _llama_handoff(source, target, mapper, source_cache, ids, new_turn, plan)
        timings.setdefault("handoff", []).append(time.perf_counter() - started)
        for part, seconds in parts.items():
            timings.setdefault(part, []).append(seconds)
        started = time.perf_counter()
        own = target.new_cache()
        own_logits = own.read(target, ids)[0, -1]
        timings.setdefault("reprefill", []).append(time.perf_counter() - started)
        if transformers:
            tf_target = models[target_name]
            started = time.perf_counter()
            tf_mapped = map_for_target(models[source_name], tf_target, mapper, history, plan, tf_source_cache,
                                       _turn_info(ids[:, -new_turn:]))
            tf_logits = tf_mapped.read(tf_target, ids[:, -new_turn:])[0, -1]
            timings.setdefault("transformers_handoff", []).append(time.perf_counter() - started)
            started = time.perf_counter()
            tf_own = TransformersCache()
            tf_own_logits = tf_own.read(tf_target, ids)[0, -1]
            timings.setdefault("transformers_reprefill", []).append(time.perf_counter() - started)
    stats = {name: summarize(samples) for name, samples in timings.items()}
    row = {
        "direction": f"{source_name} → {target_name}",
        "tokens": ids.shape[1],
        "new_turn_tokens": new_turn,
        "source_prefill_seconds": source_seconds,
        **stats,
        "speedup": stats["reprefill"]["median"] / stats["handoff"]["median"],
        "recompute_tokens": recomputed_tokens(mapper, plan.recompute, history.shape[1]),
        "kl_handoff_vs_own": _kl(own_logits, logits),
        "top1_agree": int(own_logits.argmax()) == int(logits.argmax()),
        "decode_tokens_per_second": {"after_handoff": _decode_rate(cache, target, logits, decode_steps),
                                     "after_reprefill": _decode_rate(own, target, own_logits, decode_steps)},
    }
    if transformers:
        tf_target = models[target_name]
        row.update({
            "transformers_speedup": stats["transformers_reprefill"]["median"]
            / stats["transformers_handoff"]["median"],
            "llama_cpp_reprefill_vs_transformers": stats["transformers_reprefill"]["median"]
            / stats["reprefill"]["median"],
            "transformers_kl_handoff_vs_own": _kl(tf_own_logits, tf_logits),
            "kl_llama_cpp_vs_transformers_handoff": _kl(tf_logits, logits),
            "kl_llama_cpp_vs_transformers_own": _kl(tf_own_logits, own_logits),
        })
        row["decode_tokens_per_second"]["transformers_after_handoff"] = _decode_rate(
            tf_mapped.cache, tf_target, tf_logits, decode_steps)
    constants = model_flops(models[target_name])
    row.update(row_flops(constants, mapper_flops_per_token(mapper), ids.shape[1], new_turn, mapper.exact_prefix,
                         row["recompute_tokens"]))
    row["share_of_bound"] = row["speedup"] / row["flop_bound"]
    return row


def llama_twins(models: dict, settings: LlamaCppSettings, ggufs: dict | None = None) -> dict[str, LlamaCppModel]:
    """name → the llama.cpp model of each transformers model (its GGUF: ``ggufs``'s, else the registry model's)."""
    ggufs = ggufs or {name: model_gguf(name) for name in models}
    return {name: llama_cpp_twin(model, ggufs[name], settings, name=name) for name, model in models.items()}


def run_engine_bench(models: dict, mappers: dict, tokenizer, lengths=DEFAULT_ENGINE_LENGTHS,
                     directions: list[tuple[str, str]] | None = None, new_turn: int = 1,
                     recompute: RecomputePolicy | None = None, repeats: int = 1, decode_steps: int = 16,
                     transformers: bool = True, settings: LlamaCppSettings | None = None,
                     ggufs: dict | None = None, out: Path | None = None, time_budget_s: float | None = None) -> dict:
    """The llama.cpp switch bench over ``lengths`` (see the module docstring). models: name → transformers model
    (their registry names give the GGUFs unless ``ggufs`` names them); mappers: (source, target) → `Mapper`.
    The result is written to ``out`` after every row."""
    lengths = sorted(lengths)
    directions = directions or list(mappers)
    plan = HandoffPlan.of(recompute=recompute)
    settings = settings or LlamaCppSettings(context=2 * lengths[-1] + 64, sequences=8)
    ggufs = ggufs or {name: model_gguf(name) for name in models}
    llama = llama_twins(models, settings, ggufs)
    result = {
        "format": ENGINE_BENCH_FORMAT,
        "settings": {"lengths": lengths, "new_turn": new_turn, "recompute": plan.recompute.spec,
                     "repeats": repeats, "decode_steps": decode_steps, "transformers": transformers,
                     "llama_cpp": {**settings.__dict__, "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION},
                     "ggufs": {name: Path(path).name for name, path in ggufs.items()},
                     "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                     "platform": platform.platform()},
        "results": [],
        "skipped": [],
    }
    started = time.perf_counter()
    try:
        context = context_ids(tokenizer, lengths[-1])
        for tokens in lengths:
            for names in directions:
                if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                    result["skipped"].append({"tokens": tokens, "direction": " → ".join(names)})
                    continue
                row = bench_direction(names, models, llama, mappers[names], context[:, :tokens], new_turn, plan,
                                      repeats, decode_steps, transformers, warmup=int(tokens == lengths[0]))
                result["results"].append(row)
                logger.info("%s", engine_line(row))
                if out is not None:
                    atomic_write_json(out, result)
    finally:
        for model in llama.values():
            model.close()
    result["wall_seconds"] = time.perf_counter() - started
    if out is not None:
        atomic_write_json(out, result)
    return result


def engine_line(row: dict) -> str:
    parts = " ".join(f"{part} {row[part]['median']:.3f}s" for part in
                     ("state_read", "parse", "map", "import", "select", "target_forward"))
    line = (f"{row['tokens']:>6} {row['direction']}: handoff {row['handoff']['median']:.2f}s vs re-prefill "
            f"{row['reprefill']['median']:.2f}s (×{row['speedup']:.1f}, {row['share_of_bound']:.2f} of the bound "
            f"×{row['flop_bound']:.1f}); {parts}; KL {row['kl_handoff_vs_own']:.4f}")
    if "transformers_speedup" in row:
        line += (f"; transformers {row['transformers_handoff']['median']:.2f}s vs "
                 f"{row['transformers_reprefill']['median']:.2f}s (×{row['transformers_speedup']:.1f})")
    return line


def engine_table(result: dict) -> list[str]:
    """The result as markdown table lines."""
    lines = ["| context | switch | handoff (llama.cpp) | re-prefill (llama.cpp) | speed-up | share of FLOP bound | "
             "state read + parse / map / import / target forward | KL vs own | decode tok/s after handoff / "
             "re-prefill | transformers handoff / re-prefill (speed-up) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for row in result["results"]:
        parts = (f"{row['state_read']['median'] + row['parse']['median']:.2f} / {row['map']['median']:.2f} / "
                 f"{row['import']['median']:.2f} / {row['target_forward']['median']:.2f} s")
        decode = row["decode_tokens_per_second"]
        tf = (f"{row['transformers_handoff']['median']:.2f} s / {row['transformers_reprefill']['median']:.2f} s "
              f"(×{row['transformers_speedup']:.1f})" if "transformers_speedup" in row else "—")
        lines.append(f"| {row['tokens']} | {row['direction']} | {row['handoff']['median']:.2f} s | "
                     f"{row['reprefill']['median']:.2f} s | ×{row['speedup']:.1f} | {row['share_of_bound']:.2f} | "
                     f"{parts} | {row['kl_handoff_vs_own']:.4f} | {decode['after_handoff']:.1f} / "
                     f"{decode['after_reprefill']:.1f} | {tf} |")
    return lines
