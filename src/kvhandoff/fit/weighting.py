"""Row weights of the calibration statistics (`FitConfig.row_weights`).

A mapped cache is read by the target's attention, so an error in a row the target attends to costs more than one
in a row it ignores. `AttentionRows` fits the maps hardest where the target reads (CacheBridge, arXiv 2609.00891,
weights rows by the attention they receive), from the same pass: the target's queries are captured beside its K/V.

Each calibration window stands in for a switch: its last `READER_SHARE` is the turn the target reads, the rest the
history handed over. A history row weighs the attention the reader's queries pay it (summed over the target's
layers and heads), scaled to mean 1 over the window's history rows and capped at `WEIGHT_CAP` — attention sinks
take most of every head's weight, and the runtime recomputes them anyway (`FitConfig.exact_prefix`) — then scaled
to mean 1 again; the reader's own rows weigh 1. The weighted ridge solves min Σ w‖y − Wx‖² + λ‖W‖², so a window
still counts about as many rows as it keeps.
"""

from __future__ import annotations

import torch

from kvhandoff.errors import StatisticsError
from kvhandoff.model.attention import layers_received_attention
from kvhandoff.model.capture import ContentKV

#: the share of each calibration window read as the turn after a switch
READER_SHARE = 0.25
#: the largest weight of a history row, in multiples of the window's mean
WEIGHT_CAP = 4.0


class RowWeighting:
    """How the rows of a calibration window count in the statistics."""

    name = ""
    #: whether the target's queries must be captured with its K/V
    needs_queries = False

    def position_weights(self, target_model, target: ContentKV) -> torch.Tensor | None:
        """[batch, tokens] weights of every position of the captured window (None: every row counts 1)."""
        return None


class UniformRows(RowWeighting):
    """Every kept row counts 1 (the paper)."""

    name = "uniform"


class AttentionRows(RowWeighting):
    """Each history row weighted by the attention the target's reader queries pay it (module docstring)."""

    name = "attention"
    needs_queries = True

    def position_weights(self, target_model, target: ContentKV) -> torch.Tensor:
        start = reader_start(target.num_tokens)
        return history_weights(reader_attention(target_model, target, start), start)


ROW_WEIGHTINGS: dict[str, type[RowWeighting]] = {kind.name: kind for kind in (UniformRows, AttentionRows)}


def row_weighting(name: str) -> RowWeighting:
    """The weighting `FitConfig.row_weights` names (validated there)."""
    return ROW_WEIGHTINGS[name]()


def reader_start(tokens: int) -> int:
    """The first position of a window's reader turn (at least one history and one reader position)."""
    return min(max(1, round(tokens * (1 - READER_SHARE))), tokens - 1) if tokens > 1 else tokens


@torch.inference_mode()
def reader_attention(model, content: ContentKV, start: int) -> torch.Tensor:
    """[batch, tokens]: the attention the queries at positions ≥ ``start`` pay each position, summed over the
    model's layers and heads; ``content`` holds the model's content K/V and pre-RoPE queries of the window."""
    if content.queries is None:
        raise StatisticsError("the target's queries were not captured: capture_content_kv(..., with_queries=True)")
    reader = torch.arange(start, content.num_tokens, device=content.keys.device)
    return layers_received_attention(model, content.queries[:, :, :, start:], content.keys, reader, rotate_keys=True)


def history_weights(received: torch.Tensor, start: int) -> torch.Tensor:
    """[batch, tokens] float64 weights from the attention each position received: the history's (positions before
    ``start``) scaled to mean 1, capped at `WEIGHT_CAP`, scaled to mean 1 again; the reader's positions 1."""
    weights = torch.ones(received.shape, dtype=torch.float64)
    history = received[:, :start].double().cpu()
    for row, scores in zip(weights, history, strict=True):
        mean = scores.mean()
        if start == 0 or not mean > 0:
            continue
        capped = (scores / mean).clamp(max=WEIGHT_CAP)
        row[:start] = capped / capped.mean()
    return weights
