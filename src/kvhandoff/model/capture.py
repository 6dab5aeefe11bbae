"""Content-space K/V: keys before RoPE (after k_norm where the model has one) and values, per layer."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvhandoff.errors import StatisticsError
from kvhandoff.model.cache import model_device
from kvhandoff.model.geometry import decoder_layers, read_geometry
from kvhandoff.model.rope import rope_frequencies, strip_rope

#: the two kinds of cached tensors, in the order of every feature layout
MODALITIES = ("K", "V")


@dataclass
class ContentKV:
    """Per-layer content-space keys and values, each [layers, batch, kv_heads, tokens, head_dim].

    `queries` (optional) are the pre-RoPE queries [layers, batch, heads, tokens, head_dim].
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[3]

    def layers(self, selected: range | None) -> ContentKV:
        """These K/V (and queries) of the `selected` layers only (views; None: all)."""
        if selected is None:
            return self
        pick = slice(selected.start, selected.stop, selected.step)
        return ContentKV(self.keys[pick], self.values[pick], None if self.queries is None else self.queries[pick])


@dataclass(frozen=True)
class FeatureLayout:
    """Where (modality, layer, head) lives in a flattened feature vector."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def layer_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def modality_width(self) -> int:
        return self.num_layers * self.layer_width

    @property
    def width(self) -> int:
        return len(MODALITIES) * self.modality_width

    def block(self, layers: range) -> FeatureLayout:
        """The layout of `layers` (consecutive layers of this one) alone."""
        if not (layers.step == 1 and 0 <= layers.start < layers.stop <= self.num_layers):
            raise StatisticsError(f"layers {layers.start}..{layers.stop - 1} are not a block of consecutive layers "
                                  f"of a model with {self.num_layers}")
        return FeatureLayout(len(layers), self.num_kv_heads, self.head_dim)

    def block_indices(self, layers: range) -> torch.Tensor:
        """The feature indices of `layers` (K of each, then V of each): the columns of `block(layers)`."""
        return torch.cat([self.layer_indices(modality, layers) for modality in range(len(MODALITIES))])

    def layer_slice(self, modality: int, layer: int) -> slice:
        start = modality * self.modality_width + layer * self.layer_width
        return slice(start, start + self.layer_width)

    def layer_indices(self, modality: int, layers) -> torch.Tensor:
        slices = [self.layer_slice(modality, int(layer)) for layer in layers]
        return torch.cat([torch.arange(s.start, s.stop) for s in slices])

    def flatten(self, content: ContentKV, positions: torch.Tensor) -> torch.Tensor:
        """[tokens kept, width] float64 rows on the CPU (where the sums are) from content K/V [layers, batch, heads,
        tokens, head_dim] of any dtype and device: the model's dtype (bfloat16, float16) is cast before any sum."""
        kept = positions.to(content.keys.device)  # before stacking: a copy of the kept positions only
        both = torch.stack([content.keys[..., kept, :], content.values[..., kept, :]])
        rows = both.permute(2, 4, 0, 1, 3, 5).reshape(-1, self.width)  # [2, L, B, H, t, D] → [B·t, width]
        return rows.to("cpu").to(torch.float64)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite. A NaN or ±Inf makes the float32 sum non-finite, so one summing
    pass settles the usual case (no temporary the size of the tensor); only a sum that is not finite (a NaN/Inf, or
    a finite total past float32's range) takes the elementwise check."""
    if not tensor.is_floating_point():
        return True
    return bool(tensor.sum(dtype=torch.float32).isfinite()) or bool(tensor.isfinite().all())


def nonfinite_layers(tensor: torch.Tensor, dim: int) -> list[int]:
    """Indices along ``dim`` (a layer axis) of the slices that hold NaN or ±Inf."""
    finite = tensor.isfinite().movedim(dim, 0).reshape(tensor.shape[dim], -1).all(dim=1)
    return (~finite).nonzero().flatten().tolist()


def _heads_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, tokens, heads*head_dim] or [batch, tokens, heads, head_dim] → [batch, heads, tokens, head_dim]."""
    if x.dim() == 3:
        x = x.unflatten(-1, (-1, head_dim))
    return x.transpose(1, 2)


#: the module whose output is each kind of pre-RoPE projection (after k_norm / q_norm where the family has them)
PROJECTIONS = {
    "k": lambda attn: getattr(attn, "k_norm", attn.k_proj),
    "v": lambda attn: attn.v_proj,
    "q": lambda attn: getattr(attn, "q_norm", attn.q_proj),
}


@contextmanager
def projection_hooks(model, kinds: str, record):
    """While active, every forward of ``model`` calls ``record(kind, layer index, x)`` for each layer's pre-RoPE
    projection of each of ``kinds`` ("k", "v", "q"), x [batch, heads, tokens, head_dim] (detached). Nothing stays
    hooked outside the block."""
    head_dim = read_geometry(model).head_dim
    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        for kind in kinds:
            def hook(_module, _inputs, output, kind=kind, index=index):
                record(kind, index, _heads_first(output.detach(), head_dim))

            handles.append(PROJECTIONS[kind](layer.self_attn).register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def run_body(model, input_ids: torch.Tensor) -> None:
    """The forward `capture_content_kv` runs, alone: the decoder body over `input_ids` [batch, tokens] (no LM head:
    the vocab projection would dominate memory and time; no cache), its output dropped."""
    body = getattr(model, "model", model)
    body(input_ids=input_ids.to(model_device(model)), use_cache=False)


@torch.inference_mode()
def capture_content_kv(model, input_ids: torch.Tensor, with_queries: bool = False) -> ContentKV:
    """Run the model once over `input_ids` [batch, tokens] (`run_body`) and return its content-space K/V."""
    device = model_device(model)
    records: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "q": []}
    # with a device map the layers sit on several devices: every record joins the embedding's device
    with projection_hooks(model, "kvq" if with_queries else "kv",
                          lambda kind, _, x: records[kind].append(x.to(device))):
        run_body(model, input_ids)
    return ContentKV(
        keys=torch.stack(records["k"]),
        values=torch.stack(records["v"]),
        queries=torch.stack(records["q"]) if with_queries else None,
    )


def cache_positions(num_tokens: int, batch: int = 1, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + num_tokens).expand(batch, num_tokens)


def cache_to_content(cache, model_config, position_ids: torch.Tensor | None = None) -> ContentKV:
    """Strip RoPE from a live transformers cache: content-space ContentKV of everything cached."""
    keys = torch.stack([layer.keys for layer in cache.layers])
    values = torch.stack([layer.values for layer in cache.layers])
    batch, tokens = keys.shape[1], keys.shape[3]
    if position_ids is None:
        position_ids = cache_positions(tokens, batch)
    inv_freq, scaling = rope_frequencies(model_config, seq_len=int(position_ids.max()) + 1)
    # strip_rope broadcasts over leading dims: positions [batch, tokens] → cos [batch, 1, tokens, dim]
    return ContentKV(keys=strip_rope(keys, position_ids, inv_freq, scaling), values=values)
