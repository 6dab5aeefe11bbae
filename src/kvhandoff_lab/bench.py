"""Handoff vs re-prefill: latency, memory and FLOPs of getting the target to its first logits after a context.

For each context length T a random-but-fixed token context `ids` [1, T] is drawn (seeded). Its last N tokens
(`new_turn`, default 1) are the new turn that no model has read yet; the source prefills the other T − N
(the history) once, untimed: a handoff starts from a cache the source already has. Then, in one process and
interleaved (handoff, two-step handoff, re-prefill, handoff, ...) so that the paths share the machine's noise, each
path is run `warmup` times untimed and `repeats` times timed:

- handoff   = `mapper.transfer(source_cache)` (strip source RoPE, map, apply target RoPE, build the target's
  DynamicCache; timed apart as "transfer") + choosing the positions the target recomputes (the mapper's
  `exact_prefix` leading ones and the picks of the `recompute` policy, `kvhandoff.runtime.recompute`; "select") + ONE
  target forward ("target_forward", `handoff.MappedCache.read`) that recomputes those positions in place and reads
  the N new tokens on top of the mapped cache, up to the logits of the last (`new_turn` = 1: the all-mapped
  handoff; N > 1: a switch at a turn boundary, as `kvhandoff-lab eval --mapped history` and `SwitchingSession` do);
- stored-prefix handoff ("stored_prefix", with `prefix_store` and an exact prefix) = the handoff with the target's
  own K/V of the exact prefix copied from a `handoff.PrefixStore` (primed untimed by a prefill of those tokens:
  a router's conversations open alike, so after the first switch of an opening this is every switch): the one
  target forward reads only the new tokens and the policy's picks ("stored_prefix_target_forward");
- two-step handoff ("two_step", with `two_step`) = the same, but the target recomputes the exact prefix by a
  prefill of it and the policy's picks by a sparse prefill before it reads the new tokens: two or three forwards,
  each reading all of the target's weights. The row's `fused_equals_two_step` is the largest difference between
  the two paths' logits;
- re-prefill = the target's own prefill of all T tokens up to the logits of the last position
  (`kvhandoff.model.cache.prefill`, logits_to_keep=1).

All end in the same thing: the target's next-token logits after the T-token context. Timings are wall clock
(`time.perf_counter`) under `torch.inference_mode`; reported as median, min/max and quartiles, and the
speed-up = median re-prefill ÷ median handoff.

Memory (`peak_memory_bytes`): the peak of live bytes allocated through torch's CPU allocator during the first
(warm-up; without warm-up, an extra untimed) run of each path, above what was allocated when it started (model
weights, the source cache and the mapper are not counted; what the path returns, e.g. the new cache, is). It is
read from the allocation/free events of `torch.profiler` (profile_memory=True), so it sees every tensor the path
creates but not BLAS/oneDNN scratch space nor Python objects. RSS is not used: the allocator keeps freed memory
mapped, so RSS deltas of repeated runs are mostly zero.

FLOPs (multiply-add = 2 FLOPs; norms, activations and softmax ignored):
- mapper per token = 2 · weight params (+ bias adds); the weight is [2, Lt, k·Fs, Ft], so k is accounted for;
- target prefill of T tokens = 2 · body params · T + attention 2·2·layers·q_width·T(T+1)/2
  (QKᵀ and AV over the causal prefix; q_width = heads · head_dim) + 2 · vocab · hidden once (logits_to_keep=1);
- handoff = mapper · (T−N) + the mapper's exact_prefix tokens read by the target (no LM head) + the recompute of n
  positions (counted as n tokens read at the end of the history: an upper bound) + the target reading the
  N new tokens at positions T−N … T−1 (2 · body params · N + attention over the keys before each + LM head).
`flop_bound` = prefill FLOPs ÷ handoff FLOPs is the speed-up the arithmetic alone would allow, printed next to
the measured one (`flop_bound_stored_prefix`: without the exact prefix's tokens); `flop_ratio_per_token` = target
prefill FLOPs per token ÷ mapper FLOPs per token.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvhandoff.config import MAPPER_FORMAT_VERSION, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.selection import resolve_k
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import prefill
from kvhandoff.model.capture import FeatureLayout
from kvhandoff.model.geometry import model_fingerprint, read_geometry
from kvhandoff.progress import Progress, as_progress
from kvhandoff.runtime.handoff import MappedCache
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy, SelectionInfo, budget_count
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.seam import Pending, as_kv_cache
from kvhandoff.workflow import NamedPair, load_pair_mapper, obtain_mapper
from kvhandoff_lab.figures import save_figure

logger = logging.getLogger(__name__)

#: the result's format (its rows hold the stored-prefix handoff, "stored_prefix")
BENCH_FORMAT = "kvhandoff-bench/4"
DEFAULT_LENGTHS = (64, 256, 1024, 2048, 4096, 8192)
MEMORY_NOTE = (
    "peak live bytes allocated through torch's CPU allocator during the first (warm-up) run of the path, above the "
    "level at its start (torch.profiler profile_memory allocation events); excludes model weights, the source "
    "cache and the mapper; excludes BLAS/oneDNN scratch and Python objects"
)
FLOPS_NOTE = (
    "2 FLOPs per multiply-add; mapper/token = 2·weight params + bias; prefill = 2·body params·T + "
    "2·2·layers·q_width·T(T+1)/2 + 2·vocab·hidden; handoff = mapper·(T−N) + exact prefix (no LM head) + the "
    "recompute + the target reading the N new-turn tokens at positions T−N…T−1"
)


# -- helpers ------------------------------------------------------------------------------------------------
def summarize(seconds: list[float]) -> dict:
    """Median, spread (min/max, quartiles) and mean of timings in seconds, with the raw samples."""
    ordered = sorted(seconds)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": quartiles[0],
        "q3": quartiles[2],
        "mean": statistics.fmean(ordered),
        "samples": seconds,
    }


def peak_tensor_memory(fn):
    """Run `fn()` once; return (its result, peak live bytes of torch CPU allocations made during it).

    Allocation and free events come from `torch.profiler` with profile_memory=True (see MEMORY_NOTE).
    Returns None for the peak if this torch build does not expose the raw events.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:
        return result, None
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, int(peak)


@torch.no_grad()
def keep_resident(*models) -> None:
    """Copy every parameter and buffer of ``models`` into memory of the process's own. Weights loaded from
    safetensors are file-backed memory maps that the kernel may drop under memory pressure and read from disk
    again at the next forward: a timing would then measure the disk. A machine without swap cannot drop the copies.
    """
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def mapper_footprint(mapper: Mapper) -> dict:
    """Parameter count, size on disk (saved to a temporary folder) and bytes held in memory."""
    storages: dict[int, int] = {}
    for value in vars(mapper).values():
        if isinstance(value, torch.Tensor):
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as tmp:
        saved = mapper.save(Path(tmp) / "mapper")
        disk = sum(p.stat().st_size for p in saved.iterdir())
    return {
        "parameters": mapper.num_parameters(),
        "parameter_bytes": mapper.nbytes(),
        "memory_bytes": sum(storages.values()),
        "disk_bytes": disk,
        "top_k": mapper.top_k,
    }


def _body_parameters(model) -> int:
    """Parameters used per token: everything but the token embedding and the LM head."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def model_flops(model) -> dict:
    """The constants of the FLOP model of one causal LM (see the module docstring)."""
    geometry = read_geometry(model)
    return {
        "body_parameters": _body_parameters(model),
        "layers": geometry.num_layers,
        "q_width": geometry.num_attention_heads * geometry.head_dim,
        "lm_head": geometry.vocab_size * geometry.hidden_size,
    }


def prefill_flops(constants: dict, tokens: int) -> float:
    """FLOPs of a T-token prefill up to the last position's logits."""
    attention = 2 * 2 * constants["layers"] * constants["q_width"] * tokens * (tokens + 1) / 2
    return 2 * constants["body_parameters"] * tokens + attention + 2 * constants["lm_head"]


def continuation_flops(constants: dict, start: int, tokens: int) -> float:
    """FLOPs of reading `tokens` tokens at positions start … start + tokens − 1 on top of a cache of `start`
    positions (each attends every key up to its own) up to the last one's logits."""
    keys = tokens * start + tokens * (tokens + 1) / 2
    return 2 * constants["body_parameters"] * tokens + 2 * 2 * constants["layers"] * constants["q_width"] * keys + \
        2 * constants["lm_head"]


def mapper_flops_per_token(mapper: Mapper) -> int:
    return mapper.flops_per_token()


def synthetic_mapper(source_model, target_model, top_k: int | str = "all", seed: int = 0) -> DenseMapper:
    """A mapper of the right shape for this pair with random weights: for timing only (a transfer's cost does
    not depend on the weights' values). Its manifest says `method: synthetic`."""
    source = read_geometry(source_model)
    target = read_geometry(target_model)
    src = FeatureLayout(source.num_layers, source.num_kv_heads, source.head_dim)
    tgt = FeatureLayout(target.num_layers, target.num_kv_heads, target.head_dim)
    k = resolve_k(top_k, src.num_layers)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(2, tgt.num_layers, k * src.layer_width, tgt.layer_width, generator=gen)
    weight /= (k * src.layer_width) ** 0.5
    bias = torch.zeros(2, tgt.num_layers, tgt.layer_width)
    # k evenly spread source layers per target layer (k = all: every layer, the dense path)
    selected = torch.linspace(0, src.num_layers - 1, k).round().long().expand(tgt.num_layers, k).clone()
    manifest = {
        "format_version": MAPPER_FORMAT_VERSION,
        "method": "synthetic",
        "config": FitConfig(top_k=top_k).to_dict(),
        "source_fingerprint": model_fingerprint(source_model),
        "target_fingerprint": model_fingerprint(target_model),
        "source_max_position_embeddings": source_model.config.max_position_embeddings,
        "target_max_position_embeddings": target_model.config.max_position_embeddings,
        "source_layout": src.__dict__,
        "target_layout": tgt.__dict__,
        "selected_layers": selected.tolist(),
    }
    return DenseMapper(weight, bias, selected, manifest)


def _model_summary(model, name: str | None) -> dict:
    geometry = read_geometry(model)
    return {
        "name": name or getattr(model.config, "_name_or_path", None) or type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": geometry.num_layers,
        "kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def _vocab_size(source_model, target_model) -> int:
    vocab = min(read_geometry(source_model).vocab_size, read_geometry(target_model).vocab_size)
    return min(vocab, source_model.get_input_embeddings().weight.shape[0],
               target_model.get_input_embeddings().weight.shape[0])


# -- the benchmark ------------------------------------------------------------------------------------------
def bench_length(source_model, target_model, mapper: Mapper, ids: torch.Tensor, repeats: int, warmup: int,
                 measure_memory: bool = True, new_turn: int = 1, recompute: RecomputePolicy | None = None,
                 two_step: bool = True, prefix_store: bool = True) -> dict:
    """Time handoff and re-prefill (and the two-step handoff, with ``two_step``; the stored-prefix handoff, with
    ``prefix_store`` and an exact prefix) for one context `ids` [1, T] whose last `new_turn` tokens are the new turn
    (see the module docstring; ``recompute``: the selective-recompute policy, None = `DEFAULT_RECOMPUTE`)."""
    tokens = ids.shape[1]
    if not 1 <= new_turn < tokens:
        raise ConfigError(f"new_turn must be at least 1 and shorter than the context ({tokens}), got {new_turn}")
    with torch.inference_mode():
        started = time.perf_counter()
        source_cache, _ = prefill(source_model, ids[:, :-new_turn])
        source_seconds = time.perf_counter() - started
        paths = _paths(target_model, mapper, source_cache, ids, new_turn, recompute, source_model, two_step,
                       prefix_store)
        timings, logits, memory = _time_interleaved(paths, repeats, warmup, measure_memory)
    stats = {name: summarize(samples) for name, samples in timings.items()}
    row = {
        "tokens": tokens,
        "new_turn_tokens": new_turn,
        "source_prefill_seconds": source_seconds,
        **stats,
        "recompute_tokens": recomputed_tokens(mapper, recompute, tokens - new_turn),
        "speedup": stats["reprefill"]["median"] / stats["handoff"]["median"],
        "speedup_transfer_only": stats["reprefill"]["median"] / stats["transfer"]["median"],
        "peak_memory_bytes": memory,
        # does the handoff's next token equal the re-prefill's? (meaningless for a synthetic mapper)
        "top1_agree": None if mapper.manifest.get("method") == "synthetic"
        else bool((logits["handoff"].argmax(-1) == logits["reprefill"].argmax(-1)).all()),
    }
    if two_step:
        row["speedup_two_step"] = stats["reprefill"]["median"] / stats["two_step"]["median"]
        row["fused_equals_two_step"] = float((logits["handoff"] - logits["two_step"]).abs().max())
    if "stored_prefix" in stats:
        row["speedup_stored_prefix"] = stats["reprefill"]["median"] / stats["stored_prefix"]["median"]
        row["stored_prefix_equals_handoff"] = float((logits["handoff"] - logits["stored_prefix"]).abs().max())
    return row


def _policy(recompute: RecomputePolicy | None) -> RecomputePolicy:
    return DEFAULT_RECOMPUTE if recompute is None else recompute


def recomputed_tokens(mapper, recompute: RecomputePolicy | None, mapped: int) -> int:
    """Positions the recompute policy has the target recompute in a handoff of ``mapped`` positions (for a policy
    with a ``coverage``, its budget: the most it recomputes)."""
    policy = _policy(recompute)
    candidates = max(mapped - min(mapper.exact_prefix, mapped), 0)
    return budget_count(policy.budget, candidates) if policy.active else 0


def _paths(target_model, mapper: Mapper, source_cache, ids: torch.Tensor, new_turn: int,
           recompute: RecomputePolicy | None = None,
           source_model=None, two_step: bool = True, prefix_store: bool = True) -> dict:
    """The timed paths to the target's next-token logits, each a function () → (logits, {part: seconds}):
    "handoff" (transfer, select, one target forward), "stored_prefix" (the same with the exact prefix copied from a
    primed `PrefixStore`; with ``prefix_store`` and an exact prefix), "two_step" (transfer, the exact prefix's
    prefill and the recompute, then the target's read: two or three forwards; with ``two_step``) and
    "reprefill"."""
    target_dtype = next(target_model.parameters()).dtype
    history, turn = ids[:, :-new_turn], ids[:, -new_turn:]
    policy = _policy(recompute)
    plan = HandoffPlan(None, policy)  # the mapper's exact prefix
    prefix = min(mapper.exact_prefix, history.shape[1])  # the exact prefix is never counted in the budget

    # every handoff path calls `Mapper.transfer` on the source's transformers cache itself rather than through
    # `map_for_target`, so that the raw transfer is timed apart ("transfer") from the selection and the forward
    def handoff():
        t0 = time.perf_counter()
        cache = mapper.transfer(source_cache, dtype=target_dtype)
        t1 = time.perf_counter()
        mapped = MappedCache.from_mapped(cache, target_model, history, mapper, plan, source_model=source_model,
                                         source_cache=source_cache)
        t2 = time.perf_counter()
        logits = mapped.read(target_model, turn)[:, -1]
        t3 = time.perf_counter()
        return logits, {"transfer": t1 - t0, "select": t2 - t1, "target_forward": t3 - t2}

    store = PrefixStore()
    stored_plan = HandoffPlan(None, policy, store)
    if prefix_store and prefix:
        store.prime(target_model, history[:, :prefix])

    def stored_prefix_handoff():
        t0 = time.perf_counter()
        cache = mapper.transfer(source_cache, dtype=target_dtype)
        mapped = MappedCache.from_mapped(cache, target_model, history, mapper, stored_plan,
                                         source_model=source_model, source_cache=source_cache)
        t1 = time.perf_counter()
        logits = mapped.read(target_model, turn)[:, -1]
        return logits, {"stored_prefix_target_forward": time.perf_counter() - t1, "stored_prefix_map": t1 - t0}

    def two_step_handoff():
        mapped = as_kv_cache(mapper.transfer(source_cache, dtype=target_dtype))  # the target's cache, behind the seam
        if prefix:  # the exact prefix by a prefill of its own, in a fresh cache of the target's kind
            own = mapped.empty()
            own.read(target_model, history[:, :prefix])
            mapped.write(0, own.export())
        if policy.active and prefix < history.shape[1]:  # the policy's picks by a sparse prefill
            picked = policy.positions(target_model, mapped.export(), history, SelectionInfo(start=prefix),
                                      source_model, source_cache)
            mapped.recompute(target_model, Pending(history, picked))
        return mapped.read(target_model, turn)[:, -1], {}  # the target's read, nothing left pending

    def reprefill():
        return prefill(target_model, ids)[1], {}

    paths = {"handoff": handoff, "stored_prefix": stored_prefix_handoff, "two_step": two_step_handoff,
             "reprefill": reprefill}
    if not (prefix_store and prefix):
        del paths["stored_prefix"]
    if not two_step:
        del paths["two_step"]
    return paths


def _time_interleaved(paths: dict, repeats: int, warmup: int, measure_memory: bool):
    """Run every path `warmup` + `repeats` times, alternating; ({path or part: seconds of the timed runs}, {path:
    its last logits}, {path: peak tensor bytes or None}). With ``measure_memory`` each path's first run is watched
    by the profiler (`peak_tensor_memory`): a warm-up run when there is one, else an extra untimed run."""
    timings: dict[str, list[float]] = {}
    logits: dict[str, torch.Tensor] = {}
    memory: dict[str, int | None] = dict.fromkeys(paths)
    if measure_memory and warmup == 0:
        for name, path in paths.items():
            _, memory[name] = peak_tensor_memory(path)
    for run in range(warmup + repeats):
        for name, path in paths.items():
            started = time.perf_counter()
            if measure_memory and run == 0 and warmup > 0:
                (logits[name], parts), memory[name] = peak_tensor_memory(path)
            else:
                logits[name], parts = path()
            elapsed = time.perf_counter() - started
            if run >= warmup:
                timings.setdefault(name, []).append(elapsed)
                for part, seconds in parts.items():
                    timings.setdefault(part, []).append(seconds)
    return timings, logits, memory


def run_bench(
    source_model,
    target_model,
    mapper: Mapper,
    lengths=DEFAULT_LENGTHS,
    repeats: int = 5,
    warmup: int = 1,
    out_dir: str | Path | None = None,
    progress: Progress | bool = False,
    seed: int = 0,
    measure_memory: bool = True,
    time_budget_s: float | None = None,
    source_name: str | None = None,
    target_name: str | None = None,
    new_turn: int = 1,
    recompute: RecomputePolicy | None = None,
    two_step: bool = True,
    resident: bool = False,
    prefix_store: bool = True,
) -> dict:
    """Handoff vs re-prefill latency for each context length; returns the result dict (and writes
    bench.json + bench.png into `out_dir` when given).

    lengths: context lengths T > new_turn (the caller picks how far memory and time allow);
    new_turn: tokens at the end of each context that the target reads itself (1: the all-mapped handoff);
    recompute: the selective-recompute policy of the handoff (a `RecomputePolicy`, e.g. `Deviation(0.1)`;
    None = `DEFAULT_RECOMPUTE`), run in the handoff's one target forward (its selection timed apart: "select");
    two_step: also time the handoff with the recompute in forwards of its own before the target's read
    ("two_step"); prefix_store: also time the handoff whose exact prefix comes from a primed `PrefixStore`
    ("stored_prefix"); resident: first copy both models' weights out of their file-backed memory maps
    (`keep_resident`);
    time_budget_s: stop before a new length once this much wall time has passed (remaining lengths are
    listed under "skipped"); a length that runs out of memory is recorded under "failed" and ends the run.
    progress: a bar over the lengths (`kvhandoff.progress`); each length's timings are logged, and `bench_table`
    shows the result.
    Result fields: format, source, target, mapper (parameters, parameter_bytes, memory_bytes, disk_bytes,
    top_k, method, flops_per_token), settings, notes, and per length (`results`): tokens, new_turn_tokens,
    handoff / transfer / select / target_forward / stored_prefix / stored_prefix_map /
    stored_prefix_target_forward / two_step / reprefill timing summaries (median, min, max, q1, q3, mean, samples;
    seconds), recompute_tokens, speedup, speedup_stored_prefix, speedup_two_step, speedup_transfer_only,
    fused_equals_two_step and stored_prefix_equals_handoff (max |logit difference|), peak_memory_bytes {path:
    bytes}, flops {...}, flop_bound, flop_bound_stored_prefix, top1_agree.
    """
    lengths = _checked_lengths(source_model, target_model, lengths, new_turn, repeats, warmup)
    policy = _policy(recompute)
    result = _bench_header(source_model, target_model, mapper, source_name, target_name,
                           {"repeats": repeats, "warmup": warmup, "new_turn": new_turn, "seed": seed,
                            "recompute": policy.spec, "two_step": two_step, "prefix_store": prefix_store,
                            "resident_weights": resident})
    if resident:
        keep_resident(source_model, target_model)
    vocab = _vocab_size(source_model, target_model)
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, lengths[-1]), generator=gen)  # every length is a prefix of it
    started = time.perf_counter()
    with as_progress(progress)(total=len(lengths), desc="context lengths", unit="length") as bar:
        _measure_lengths(result, source_model, target_model, mapper, context, lengths, repeats, warmup,
                         measure_memory, new_turn, time_budget_s, bar, policy, two_step, prefix_store)
    result["wall_seconds"] = time.perf_counter() - started
    if out_dir is not None:
        render_bench(result, out_dir)
    return result


def _measure_lengths(result: dict, source_model, target_model, mapper: Mapper, context: torch.Tensor,
                     lengths: list[int], repeats: int, warmup: int, measure_memory: bool, new_turn: int,
                     time_budget_s: float | None, bar, recompute: RecomputePolicy | None = None,
                     two_step: bool = True,
                     prefix_store: bool = True) -> None:
    """Append a row per length to result["results"] (a prefix of `context` each), until the time budget is
    spent (the rest under "skipped") or a length runs out of memory ("failed"); `bar` counts the lengths."""
    started = time.perf_counter()
    for index, tokens in enumerate(lengths):
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            result["skipped"] = lengths[index:]
            return
        try:
            row = bench_length(source_model, target_model, mapper, context[:, :tokens], repeats, warmup,
                               measure_memory, new_turn, recompute, two_step, prefix_store)
        except (MemoryError, RuntimeError) as exc:  # allocator failures surface as RuntimeError in torch
            if isinstance(exc, RuntimeError) and "memory" not in str(exc).lower():
                raise
            result["failed"].append({"tokens": tokens, "error": str(exc)[:300]})
            result["skipped"] = lengths[index + 1:]
            return
        constants, per_token = result["target_flop_constants"], result["mapper"]["flops_per_token"]
        row.update(row_flops(constants, per_token, tokens, new_turn, mapper.exact_prefix, row["recompute_tokens"]))
        if "stored_prefix" in row:
            row["flop_bound_stored_prefix"] = row_flops(constants, per_token, tokens, new_turn, 0,
                                                        row["recompute_tokens"])["flop_bound"]
        result["results"].append(row)
        logger.info("%s", length_line(row))
        bar.update()


def length_line(row: dict) -> str:
    """One length's timings in a line."""
    two = f", two-step {_ms(row['two_step']['median'])}" if "two_step" in row else ""
    if "stored_prefix" in row:
        two += f", prefix stored {_ms(row['stored_prefix']['median'])} (×{row['speedup_stored_prefix']:.1f})"
    return (f"T={row['tokens']:>6}: handoff {_ms(row['handoff']['median'])} (transfer "
            f"{_ms(row['transfer']['median'])}, target forward {_ms(row['target_forward']['median'])} with "
            f"{row['recompute_tokens']} recomputed tokens){two}, re-prefill {_ms(row['reprefill']['median'])}: "
            f"×{row['speedup']:.1f} (FLOP bound ×{row['flop_bound']:.1f})")


def _checked_lengths(source_model, target_model, lengths, new_turn: int, repeats: int, warmup: int) -> list[int]:
    lengths = sorted({int(t) for t in lengths})
    if isinstance(new_turn, bool) or not isinstance(new_turn, int) or new_turn < 1:
        raise ConfigError(f"new_turn must be a positive integer, got {new_turn!r}")
    if not lengths or lengths[0] <= new_turn:
        raise ConfigError(f"context lengths must be integers > new_turn ({new_turn}), got {lengths}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    limit = min(source_model.config.max_position_embeddings, target_model.config.max_position_embeddings)
    if lengths[-1] > limit:
        raise ConfigError(f"context length {lengths[-1]} exceeds the models' max_position_embeddings ({limit})")
    return lengths


def _bench_header(source_model, target_model, mapper: Mapper, source_name, target_name, settings: dict) -> dict:
    """A bench result before any length is measured: models, mapper, FLOP constants, settings, notes."""
    return {
        "format": BENCH_FORMAT,
        "source": _model_summary(source_model, source_name),
        "target": _model_summary(target_model, target_name),
        "mapper": {
            **mapper_footprint(mapper),
            "method": mapper.manifest.get("method", "ridge"),
            "flops_per_token": mapper_flops_per_token(mapper),
        },
        "target_flop_constants": model_flops(target_model),
        "settings": {
            **settings,
            "interleaved": True,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "notes": {"memory": MEMORY_NOTE, "flops": FLOPS_NOTE},
        "results": [],
        "skipped": [],
        "failed": [],
    }


def row_flops(target_constants: dict, mapper_per_token: int, tokens: int, new_turn: int, exact_prefix: int,
              recompute_tokens: int = 0) -> dict:
    """The FLOP entries of one length's row: flops {...}, flop_ratio_per_token, flop_bound."""
    prefill_total = prefill_flops(target_constants, tokens)
    mapped = tokens - new_turn
    exact_prefix = min(exact_prefix, mapped)
    prefix_total = 0.0  # read in the target's one forward: no logits for it
    if exact_prefix:
        prefix_total = prefill_flops(target_constants, exact_prefix) - 2 * target_constants["lm_head"]
    recompute_total = 0.0
    if recompute_tokens:  # n tokens read at the end of the history, without the LM head: an upper bound
        recompute_total = continuation_flops(target_constants, mapped - recompute_tokens, recompute_tokens) - \
            2 * target_constants["lm_head"]
    handoff_total = mapper_per_token * mapped + prefix_total + recompute_total + \
        continuation_flops(target_constants, mapped, new_turn)
    return {
        "flops": {
            "mapper_per_token": mapper_per_token,
            "prefill_per_token": prefill_total / tokens,
            "prefill": prefill_total,
            "handoff": handoff_total,
            "transfer": mapper_per_token * mapped,
            "exact_prefix": prefix_total,
            "recompute": recompute_total,
        },
        "flop_ratio_per_token": prefill_total / tokens / mapper_per_token,
        "flop_bound": prefill_total / handoff_total,
    }


def bench_mapper(pair: NamedPair, mapper_path: Path | None = None, synthetic: bool = False,
                 top_k: int | str = "all", progress: Progress | bool = False) -> tuple[Mapper, str]:
    """The mapper to time and a line saying which: a saved one, a random one of the pair's shape (`synthetic`),
    or the pair's default mapper of `top_k` (fitted or reused from the cache)."""
    if mapper_path is not None:
        return load_pair_mapper(mapper_path, pair), f"mapper: {mapper_path}"
    if synthetic:
        return synthetic_mapper(pair.source, pair.target, top_k=top_k), f"mapper: synthetic (k={top_k})"
    mapper, folder, reused = obtain_mapper(pair, FitConfig(top_k=top_k), progress=progress)
    return mapper, f"mapper: {folder} ({'reused' if reused else 'fitted'})"


# -- output -------------------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def bench_table(result: dict):
    """A rich table of one bench result: latencies (median, min–max), speed-up, FLOP bound, peak memory."""
    from rich.table import Table  # rich is only needed to print, not to measure

    mapper = result["mapper"]
    table = Table(
        title=(
            f"handoff vs re-prefill: {result['source']['name']} → {result['target']['name']}\n"
            f"mapper k={mapper['top_k']} ({mapper.get('method', 'ridge')}): {mapper['parameters']:,} params, "
            f"{_mib(mapper['disk_bytes'])} MiB on disk, {_mib(mapper['memory_bytes'])} MiB in memory, "
            f"{mapper['flops_per_token'] / 1e6:.0f} MFLOP/token; {result['settings']['repeats']} repeats, "
            f"{result['settings']['torch_threads']} threads; the target reads the last "
            f"{result['settings']['new_turn']} token(s) itself; recompute "
            f"{result['settings'].get('recompute', 'none')}"
        ),
        caption="latency: median (min–max); peak MiB: torch tensor allocations of each path",
    )
    for column in ("tokens", "handoff", "transfer", "target forward", "prefix stored", "two-step", "re-prefill",
                   "speed-up", "prefix-stored speed-up", "two-step speed-up", "FLOP bound", "peak MiB h / r",
                   "top-1"):
        table.add_column(column, justify="right")
    for row in result["results"]:
        def cell(stats):
            return f"{_ms(stats['median'])}\n({_ms(stats['min'])}–{_ms(stats['max'])})"

        memory = row["peak_memory_bytes"]
        agree = row.get("top1_agree")
        two_step, stored = row.get("two_step"), row.get("stored_prefix")
        table.add_row(
            str(row["tokens"]), cell(row["handoff"]), _ms(row["transfer"]["median"]),
            _ms(row["target_forward"]["median"]), "-" if stored is None else cell(stored),
            "-" if two_step is None else _ms(two_step["median"]),
            cell(row["reprefill"]), f"×{row['speedup']:.2f}",
            "-" if stored is None else f"×{row['speedup_stored_prefix']:.2f}",
            "-" if two_step is None else f"×{row['speedup_two_step']:.2f}",
            f"×{row['flop_bound']:.1f}", f"{_mib(memory['handoff'])} / {_mib(memory['reprefill'])}",
            "-" if agree is None else ("same" if agree else "differs"),
        )
    return table


def render_bench(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write `bench.json` and `bench.png` (log-log latencies and the speed-up vs context length) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    atomic_write_json(json_path, result)
    png_path = out / "bench.png"
    _plot(result, png_path)
    return {"json": json_path, "png": png_path}


def _plot(result: dict, path: Path) -> None:
    import matplotlib  # heavy, and only needed for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    tokens = [r["tokens"] for r in rows]
    if rows:
        _plot_latencies(left, rows, tokens)
        right.plot(tokens, [r["speedup"] for r in rows], "o-", label="measured: re-prefill ÷ handoff")
        if "two_step" in rows[0]:
            right.plot(tokens, [r["speedup_two_step"] for r in rows], "x--", label="measured, two-step handoff")
        if "stored_prefix" in rows[0]:
            right.plot(tokens, [r["speedup_stored_prefix"] for r in rows], "d-",
                       label="measured, exact prefix stored")
        right.plot(tokens, [r["flop_bound"] for r in rows], "k:", label="FLOP bound: prefill ÷ handoff FLOPs")
        right.axhline(1.0, color="grey", linewidth=0.8)
        for key, label, style in (("handoff", "handoff", "s-"), ("reprefill", "re-prefill", "o-")):
            measured = [(r["tokens"], r["peak_memory_bytes"][key]) for r in rows
                        if r["peak_memory_bytes"][key] is not None]
            if measured:
                middle.plot([t for t, _ in measured], [p / 2**20 for _, p in measured], style, label=label,
                            markersize=4)
    for axis in (left, middle, right):
        axis.set_xscale("log")
        axis.set_yscale("log")
        if rows:
            axis.set_xticks(tokens, [str(t) for t in tokens], fontsize=7)
            axis.minorticks_off()
        axis.set_xlabel("context length (tokens)")
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    left.set_ylabel("seconds to the target's next-token logits (median, min–max)")
    middle.set_ylabel("peak tensor MiB of the path (torch allocator)")
    right.set_ylabel("speed-up (×)")
    fig.suptitle(f"{result['source']['name']} → {result['target']['name']}: KV handoff vs re-prefill "
                 f"({result['settings']['torch_threads']} CPU threads)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _plot_latencies(axis, rows: list[dict], tokens: list[int]) -> None:
    for key, label, style in (
        ("reprefill", "target re-prefill", "o-"),
        ("handoff", "handoff (transfer + one target forward)", "s-"),
        ("stored_prefix", "handoff, exact prefix stored", "d-"),
        ("two_step", "two-step handoff (prefix, then the read)", "x--"),
        ("transfer", "mapper transfer alone", "^--"),
    ):
        if key not in rows[0]:
            continue
        median = [r[key]["median"] for r in rows]
        spread = [[m - r[key]["min"] for m, r in zip(median, rows, strict=True)],
                  [r[key]["max"] - m for m, r in zip(median, rows, strict=True)]]
        axis.errorbar(tokens, median, yerr=spread, fmt=style, capsize=3, label=label, markersize=4)


# -- command-line values ------------------------------------------------------------------------------------
def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise ConfigError(f"--lengths must be comma-separated integers, got {text!r}") from exc
    if not lengths:
        raise ConfigError("--lengths is empty")
    return lengths
