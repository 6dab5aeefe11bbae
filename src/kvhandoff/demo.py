"""The main job: fit (or reuse) the default pair's mapper, then hand a long real context from one model
to the other and compare, side by side in one run, with the target re-prefilling the same context."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.model.placement import ModelPlacement
from kvhandoff.errors import AssetError
from kvhandoff.model.cache import feed, kl_divergence, prefill, rollback
from kvhandoff.runtime.handoff import patch_mapped_cache, recompute_policy
from kvhandoff.workflow import NamedPair, load_named_pair, load_pair_mapper, obtain_mapper, on_source_device
from kvhandoff_lab.evaluation.multiturn import Conversation, load_coqa_conversations
from kvhandoff_lab.evaluation.scoring import OpenContext, check_mapped, greedy_from

MIN_CONTEXT_TOKENS = 1000


@dataclass(frozen=True)
class DemoContext:
    conversation_id: str
    history: str  # the story and the earlier questions with their answers
    new_turn: str  # the open question, "Q: …\n\nA:"
    gold_answers: tuple[str, ...]

    @property
    def text(self) -> str:
        return self.history + self.new_turn


def demo_context(tokenizer, min_tokens: int = MIN_CONTEXT_TOKENS) -> DemoContext:
    """A CoQA story with its earlier questions and gold answers, ending in an open question (≥ min_tokens).

    CoQA is held out from calibration (no calibration group draws on it).
    """
    conversations: list[Conversation] = load_coqa_conversations(min_turns=10, num_turns=None)

    def render(conv: Conversation, upto: int) -> DemoContext:
        turns = "".join(f"Q: {t.question}\n\nA: {t.answers[0]}\n\n" for t in conv.turns[:upto])
        return DemoContext(conv.id, f"{conv.story}\n\n{turns}", f"Q: {conv.turns[upto].question}\n\nA:",
                           conv.turns[upto].answers)

    best = None
    for conv in sorted(conversations, key=lambda c: c.id):
        context = render(conv, len(conv.turns) - 1)
        length = len(tokenizer(context.text)["input_ids"])
        if length >= min_tokens:
            return context
        if best is None or length > best[0]:
            best = (length, conv)
    raise AssetError(f"no CoQA conversation reaches {min_tokens} tokens (longest: {best and best[0]})")


def mapped_length(tokenizer, context: DemoContext, ids: list[int], mapped: str) -> int:
    """Leading tokens of ``ids`` (the whole context) whose cache is mapped (``mapped``: one of
    `evaluation.scoring.MAPPED_PARTS`): all but the last for "all" — the source prefilled the whole context,
    question included; for "history", the tokens the history shares with the whole context — the source read
    the conversation so far, the target prefills the new question itself."""
    if check_mapped(mapped) == "all":
        return len(ids) - 1
    history = tokenizer(context.history)["input_ids"]
    shared = 0
    for a, b in zip(history, ids, strict=False):
        if a != b:
            break
        shared += 1
    return min(shared, len(ids) - 1)


def _timed(fn, repeats: int):
    """Run fn `repeats` times; return (last result, median seconds, all seconds)."""
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return result, statistics.median(seconds), seconds


def _answer(model, cache, length: int, next_logprobs, tokenizer, max_new_tokens: int) -> tuple[str, list[int]]:
    state = OpenContext(model, cache, length, next_logprobs)
    text, ids = greedy_from(state, tokenizer, max_new_tokens, stop=("\n", "Q:"))
    rollback(cache, length)
    return text.strip(), ids


@torch.inference_mode()
def agreement(target, own_cache, mapped_cache, length: int, own_first, mapped_first, continuation: list[int]):
    """Top-1 agreement and mean KL(own ‖ handoff) of the target's next-token distributions along `continuation`
    (teacher-forced: both caches read the same tokens)."""
    own = [own_first[None]]
    mapped = [mapped_first[None]]
    if len(continuation) > 1:
        own.append(feed(target, own_cache, continuation[:-1]))
        mapped.append(feed(target, mapped_cache, continuation[:-1]))
        rollback(own_cache, length)
        rollback(mapped_cache, length)
    p_log, q_log = torch.cat(own), torch.cat(mapped)
    kl = kl_divergence(p_log, q_log)
    top1 = (p_log.argmax(-1) == q_log.argmax(-1)).float()
    return {"positions": int(p_log.shape[0]), "top1_agreement": float(top1.mean()), "mean_kl": float(kl.mean())}


def run_demo(
    source_spec: str,
    target_spec: str,
    config: FitConfig = FitConfig(),  # noqa: B008 - frozen
    calibration: CalibrationSpec = CalibrationSpec(),  # noqa: B008 - frozen
    max_new_tokens: int = 40,
    repeats: int = 1,
    min_context_tokens: int = MIN_CONTEXT_TOKENS,
    progress: bool = True,
    refit: bool = False,
    mapped: str = "all",
    mapper_path: str | Path | None = None,
    recompute=None,
    placement: ModelPlacement = ModelPlacement(),  # noqa: B008 - frozen
) -> dict:
    """Everything the demo prints, measured in this call.

    placement: the models' dtype and device map (`config.ModelPlacement`; default float32 on the CPU).

    mapper_path: a saved mapper to show (e.g. a refined one, `kvhandoff refine`) instead of fitting or reusing the
    pair's cached mapper of `config` and `calibration`; it must have been fitted for exactly this pair.

    mapped: "all" — the source prefilled the whole context, question included, and the target reads on from
    the mapped cache; "history" — the switch happens at the new question: the source's cache of the conversation
    so far is mapped and the target prefills the question itself (its time counts in the handoff's).

    recompute: the handoff's selective-recompute policy ("deviation:10%", a `RecomputePolicy`; None = the
    mapper's default), timed as part of the handoff.
    """
    check_mapped(mapped)  # before the models load
    pair = load_named_pair(source_spec, target_spec, placement.dtype, progress, device_map=placement.device_map)
    fit_started = time.perf_counter()
    if mapper_path is not None:
        mapper_dir, reused = Path(mapper_path), True
        mapper = load_pair_mapper(mapper_dir, pair)
    else:
        mapper, mapper_dir, reused = obtain_mapper(pair, config, calibration, progress, refit)
    fit_seconds = time.perf_counter() - fit_started
    on_source_device(mapper, pair.source)
    context = demo_context(pair.tokenizer, min_context_tokens)
    ids = pair.tokenizer(context.text, return_tensors="pt")["input_ids"]
    n_mapped = mapped_length(pair.tokenizer, context, ids[0].tolist(), mapped)
    measured = compare_paths(pair, mapper, ids, n_mapped, repeats, max_new_tokens, recompute)
    return {
        "source": source_spec,
        "target": target_spec,
        "mapper_dir": str(mapper_dir),
        "mapper_reused": reused,
        "mapper_fit_or_load_seconds": fit_seconds,
        "mapper_r2_k": mapper.manifest["fit_metrics"]["r2_k_mean"],
        "mapper_r2_v": mapper.manifest["fit_metrics"]["r2_v_mean"],
        "mapper_settings": ", ".join(f"{k}={v}" for k, v in mapper.manifest["config"].items()),
        "calibration_tokens": mapper.manifest["calibration"].get("num_tokens"),
        "context_id": context.conversation_id,
        "context_tokens": ids.shape[1],
        "mapped": mapped,
        "mapped_tokens": n_mapped,
        "recompute": recompute_policy(mapper, recompute).spec,
        "target_prefilled_tokens": ids.shape[1] - n_mapped,
        **measured,
        "gold_answers": list(context.gold_answers),
    }


@torch.inference_mode()
def compare_paths(pair: NamedPair, mapper, ids: torch.Tensor, n_mapped: int, repeats: int,
                  max_new_tokens: int, recompute=None) -> dict:
    """Time the handoff of the source's cache of ``ids[:, :n_mapped]`` (the target reads the rest) against the
    target's re-prefill of all of ``ids``, interleaved `repeats` times; then both answers and their agreement."""
    source, target, tokenizer = pair.source, pair.target, pair.tokenizer
    length = ids.shape[1]
    prefill(source, ids[:, :8])  # warm up both models' kernels before anything is timed
    prefill(target, ids[:, :8])
    (source_cache, _), source_seconds, _ = _timed(lambda: prefill(source, ids[:, :n_mapped]), 1)

    def handoff():
        cache = mapper.transfer(source_cache, dtype=target.dtype)
        patch_mapped_cache(cache, target, ids[:, :n_mapped], mapper, recompute=recompute, source_model=source,
                           source_cache=source_cache)
        return cache, feed(target, cache, ids[0, n_mapped:].tolist())[-1]

    def reprefill():
        cache, logits = prefill(target, ids)
        return cache, logits[0].float().log_softmax(-1)

    handoff_times, reprefill_times = [], []
    for _ in range(repeats):  # interleaved, so both paths see the same machine load
        (mapped_cache, mapped_first), seconds, _ = _timed(handoff, 1)
        handoff_times.append(seconds)
        (own_cache, own_first), seconds, _ = _timed(reprefill, 1)
        reprefill_times.append(seconds)
    own_text, own_ids = _answer(target, own_cache, length, own_first, tokenizer, max_new_tokens)
    handoff_text, _ = _answer(target, mapped_cache, length, mapped_first, tokenizer, max_new_tokens)
    continuation = own_ids or [int(own_first.argmax())]
    agree = agreement(target, own_cache, mapped_cache, length, own_first, mapped_first, continuation)
    handoff_s, reprefill_s = statistics.median(handoff_times), statistics.median(reprefill_times)
    return {
        "source_prefill_seconds": source_seconds,
        "handoff_ttft_seconds": handoff_s,
        "reprefill_ttft_seconds": reprefill_s,
        "speedup": reprefill_s / handoff_s,
        "repeats": repeats,
        "answer_reprefill": own_text,
        "answer_handoff": handoff_text,
        **{f"agreement_{k}": v for k, v in agree.items()},
    }


def render_demo(result: dict, console=None) -> None:
    from rich.console import Console  # rich is only needed to print, not to compute
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"kvhandoff demo: {result['source']} → {result['target']}")
    table.add_column("measure")
    table.add_column("value", overflow="fold")
    reuse = "reused from cache" if result["mapper_reused"] else "fitted now"
    rows = [
        ("mapper", f"{reuse} ({result['mapper_fit_or_load_seconds']:.1f} s): {result['mapper_dir']}"),
        ("mapper fit R² (K / V)", f"{result['mapper_r2_k']:.3f} / {result['mapper_r2_v']:.3f}"),
        ("mapper settings", result["mapper_settings"]),
        ("calibration tokens", str(result["calibration_tokens"])),
        ("context", f"CoQA {result['context_id']}, {result['context_tokens']} tokens"),
        ("handed over", f"{result['mapped_tokens']} tokens mapped, {result['target_prefilled_tokens']} "
                        f"prefilled by the target"
                        + (" (the new question)" if result.get("mapped") == "history" else "")
                        + (f"; recompute {result['recompute']}" if result.get("recompute", "none") != "none"
                           else "")),
        ("source prefill (done before the switch)", f"{result['source_prefill_seconds']:.3f} s"),
        ("time to first token: handoff", f"{result['handoff_ttft_seconds']:.3f} s"),
        ("time to first token: re-prefill", f"{result['reprefill_ttft_seconds']:.3f} s"),
        ("speed-up (re-prefill ÷ handoff)", f"{result['speedup']:.1f}×  (median of {result['repeats']})"),
        ("answer after re-prefill", result["answer_reprefill"]),
        ("answer after handoff", result["answer_handoff"]),
        ("gold answer", " | ".join(result["gold_answers"][:3])),
        (
            f"top-1 agreement over {result['agreement_positions']} positions",
            f"{result['agreement_top1_agreement']:.3f}",
        ),
        ("mean KL(target ‖ handoff), nats", f"{result['agreement_mean_kl']:.3f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
