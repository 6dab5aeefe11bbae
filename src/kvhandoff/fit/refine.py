"""End-to-end refinement of a fitted linear mapper: the target's next-token distribution as the objective.

The ridge solve minimises the K/V error of each map on its own; what a handoff needs is that the target, reading
the mapped cache, predicts what it would have predicted from its own (the paper: attention-output agreement
predicts retention, K/V R² does not). Refinement starts from the ridge solution and takes Adam steps on
KL(target on its own cache ‖ target on the mapped cache) over a few tokens read after the mapped context. Each
window runs once through both models (`teacher_window`), and every prefix of it is a sample; only the read tokens
run through the target with gradients, so a step costs the map and a forward and backward pass of the target over
`continuation` tokens. The mapper keeps its form (one linear map per target layer and K|V), size and speed.
Settings: `config.RefineConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from kvhandoff.config import RefineConfig
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.dense import DenseMapper
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import cache_copy, cache_of, cache_view, kl_divergence
from kvhandoff.model.capture import cache_positions, capture_content_kv
from kvhandoff.model.rope import apply_rope, rope_frequencies
from kvhandoff.progress import Progress, as_progress


def check_refinable(mapper: Mapper) -> None:
    if type(mapper) is not DenseMapper:
        raise ConfigError(
            f"only linear (ridge) mappers can be refined, this one is {mapper.manifest.method!r}; "
            "refine the ridge mapper it was built on"
        )


@dataclass
class TeacherWindow:
    """What a window's refinement samples need, computed once (causal attention makes every prefix of a window a
    prefix of these): the source's content-space K/V rows [2, 1, T, Ls, Hs, Ds] (float32), the target's final
    hidden states on its own cache [T, hidden] (its next-token distributions, through the LM head), the target's
    own K/V of the exact-prefix positions, and the token ids [1, T]."""

    input_ids: torch.Tensor
    source_rows: torch.Tensor
    target_hidden: torch.Tensor
    own_prefix: DynamicCache | None


@torch.no_grad()
def teacher_window(source, target, input_ids: torch.Tensor, exact_prefix: int) -> TeacherWindow:
    """Run both models once over one window `input_ids` [1, T]."""
    content = capture_content_kv(source, input_ids)  # [Ls, 1, Hs, T, Ds]
    rows = torch.stack([content.keys, content.values]).permute(0, 2, 4, 1, 3, 5).float().contiguous()
    own = getattr(target, "model", target)(input_ids=input_ids, use_cache=True)
    prefix = None
    if exact_prefix:  # copies, so the window does not keep the whole own cache alive
        prefix = cache_copy(cache_view(own.cache, 0, exact_prefix))
    return TeacherWindow(input_ids, rows, own.last_hidden_state[0].clone(), prefix)


def mapped_cache(mapper: DenseMapper, target_config, source_rows: torch.Tensor, own_prefix=None) -> DynamicCache:
    """The target cache for the source's content-space rows [2, B, T, Ls, Hs, Ds] (positions 0..T−1), mapped
    and rotated by the target's RoPE, differentiable in the mapper's tensors (`DenseMapper.map_tensors`).
    `own_prefix`: the target's own cache of the first positions (exact prefix), which replaces the mapped ones.

    The same arithmetic as `Mapper.transfer` + `handoff.patch_exact_prefix` (tested to agree), written with
    out-of-place ops so gradients flow.
    """
    y = mapper.map_rows(source_rows)  # [2, B, T, Lt, Ht, Dt]
    keys, values = y[0].permute(2, 0, 3, 1, 4), y[1].permute(2, 0, 3, 1, 4)  # [Lt, B, Ht, T, Dt]
    batch, tokens = source_rows.shape[1:3]
    inv_freq, scaling = rope_frequencies(target_config, seq_len=tokens)
    keys = apply_rope(keys, cache_positions(tokens, batch), inv_freq, scaling)
    layers = list(zip(keys.unbind(0), values.unbind(0), strict=True))
    if own_prefix is not None:
        n = min(own_prefix.get_seq_length(), tokens)
        layers = [
            (torch.cat([own.keys[:, :, :n], k[:, :, n:]], dim=2), torch.cat([own.values[:, :, :n], v[:, :, n:]], dim=2))
            for own, (k, v) in zip(own_prefix.layers, layers, strict=True)
        ]
    return cache_of(layers)


def handoff_kl(mapper: DenseMapper, target, window: TeacherWindow, context: int, continuation: int) -> torch.Tensor:
    """Mean KL(target on its own cache ‖ target on the mapped cache) over the `continuation` tokens that follow
    the first `context` tokens of `window`; differentiable in the map.

    The context is mapped and the target reads the continuation on it: the evaluation's transfer condition,
    where the last context token and the answer are read by the target itself.
    """
    end = context + continuation
    if end > window.input_ids.shape[1]:
        raise ConfigError(f"context {context} + continuation {continuation} exceed the window's "
                          f"{window.input_ids.shape[1]} tokens")
    with torch.no_grad():
        teacher = torch.log_softmax(target.lm_head(window.target_hidden[context:end]).float(), dim=-1)
    cache = mapped_cache(mapper, target.config, window.source_rows[:, :, :context], window.own_prefix)
    out = target(input_ids=window.input_ids[:, context:end], cache=cache, use_cache=True)
    student = torch.log_softmax(out.logits[0].float(), dim=-1)
    return kl_divergence(teacher, student).mean()


def _context_lengths(config: RefineConfig, count: int, generator: torch.Generator) -> list[int]:
    """`count` context lengths, log-uniform in [min_context, max_context]."""
    low, high = math.log(config.min_context), math.log(config.max_context)
    draws = torch.rand(count, generator=generator) * (high - low) + low
    return [round(math.exp(float(d))) for d in draws]


def _validation_plan(config: RefineConfig) -> list[int]:
    """Fixed context lengths of the held-out windows, spread over the training range (geometric)."""
    count = config.validation_windows
    if count == 1:
        return [config.min_context]
    ratio = (config.max_context / config.min_context) ** (1 / (count - 1))
    return [round(config.min_context * ratio**i) for i in range(count)]


def refine_mapper(
    mapper: Mapper,
    source,
    target,
    windows: torch.Tensor,
    config: RefineConfig = RefineConfig(),  # noqa: B008 - frozen
    progress: Progress | bool = False,
    description: dict | None = None,
) -> DenseMapper:
    """A copy of `mapper` refined on `windows` [n, ≥ config.window_length()] of token ids (the last
    `validation_windows` are held out); the input mapper is left unchanged. The manifest gains a `refinement`
    record: config, corpus description, validation KL before and after, the step kept, time. progress: bars over
    the teacher windows and the steps (`kvhandoff.progress`)."""
    check_refinable(mapper)
    _check_windows(windows, config)
    started = time.perf_counter()
    windows = windows[:, : config.window_length()]
    prepared = [teacher_window(source, target, windows[i : i + 1], mapper.exact_prefix)
                for i in as_progress(progress)(range(windows.shape[0]), desc="teacher", unit="window")]
    train, held_out = prepared[: -config.validation_windows], prepared[-config.validation_windows :]
    prepare_seconds = time.perf_counter() - started

    refined = DenseMapper(mapper.weight.detach().clone(), mapper.bias.detach().clone(), mapper.selected,
                     dataclasses.replace(mapper.manifest, tensor_sha256=None))
    target_flags = [p.requires_grad for p in target.parameters()]
    target.requires_grad_(False)
    try:
        record = _optimise(refined, target, train, held_out, config, progress)
    finally:
        for parameter, flag in zip(target.parameters(), target_flags, strict=True):
            parameter.requires_grad_(flag)
    record = {
        "config": config.to_dict(), "corpus": description or {"windows": int(windows.shape[0])}, **record,
        "prepare_seconds": round(prepare_seconds, 1), "seconds": round(time.perf_counter() - started, 1),
    }
    manifest = dataclasses.replace(refined.manifest, refinement=record)
    return DenseMapper(refined.weight.detach().clone(), refined.bias.detach().clone(), refined.selected, manifest)


def _check_windows(windows: torch.Tensor, config: RefineConfig) -> None:
    if windows.dim() != 2 or windows.shape[1] < config.window_length():
        raise ConfigError(
            f"refinement windows must be [n, >= {config.window_length()}] token ids (max_context + continuation), "
            f"got {tuple(windows.shape)}: pass longer windows or lower --max-context"
        )
    if windows.shape[0] <= config.validation_windows:
        raise ConfigError(
            f"{windows.shape[0]} windows leave none to train on after {config.validation_windows} validation "
            "windows: pass more windows"
        )


def _validation_kl(mapper: DenseMapper, target, held_out: list[TeacherWindow], contexts: list[int],
                   continuation: int) -> float:
    with torch.no_grad():
        return sum(float(handoff_kl(mapper, target, window, context, continuation))
                   for window, context in zip(held_out, contexts, strict=True)) / len(contexts)


def _optimise(refined: DenseMapper, target, train: list[TeacherWindow], held_out: list[TeacherWindow],
              config: RefineConfig, progress: Progress | bool) -> dict:
    """Adam steps on ``refined``'s map tensors (in place); they end at the step with the lowest validation KL
    (step 0, the unrefined map, included). Returns the record's validation entries and history."""
    contexts = _validation_plan(config)
    parameters = [tensor.requires_grad_(True) for tensor in refined.map_tensors()]
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.Adam(parameters, lr=config.learning_rate)
    history = [{"step": 0, "validation_kl": _validation_kl(refined, target, held_out, contexts, config.continuation)}]
    best_kl, best_step = history[0]["validation_kl"], 0
    best = [p.detach().clone() for p in parameters]
    train_kl = 0.0
    with as_progress(progress)(total=config.steps, desc="refine", unit="step") as bar:
        for step in range(1, config.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            for context in _context_lengths(config, config.batch_size, generator):
                window = train[int(torch.randint(0, len(train), (1,), generator=generator))]
                loss = handoff_kl(refined, target, window, context, config.continuation) / config.batch_size
                loss.backward()
                train_kl += float(loss.detach())
            optimizer.step()
            bar.update()
            if step % config.validate_every == 0 or step == config.steps:
                kl = _validation_kl(refined, target, held_out, contexts, config.continuation)
                steps_since = step - history[-1]["step"]
                history.append({"step": step, "validation_kl": kl, "train_kl": train_kl / steps_since})
                train_kl = 0.0
                bar.set_postfix(val=f"{kl:.4f}", start=f"{history[0]['validation_kl']:.4f}")
                if kl < best_kl:
                    best_kl, best_step = kl, step
                    best = [p.detach().clone() for p in parameters]
    with torch.no_grad():
        for parameter, kept in zip(parameters, best, strict=True):
            parameter.requires_grad_(False).copy_(kept)
    return {"validation_contexts": contexts, "validation_kl_before": history[0]["validation_kl"],
            "validation_kl_after": best_kl, "kept_step": best_step, "history": history}
