"""Where and in which dtype the models run: `ModelPlacement`, parsed once from the command line or the API."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.errors import ConfigError

#: special tokens that end a document or a turn. Generation stops at every one the tokenizer has as a special
#: token: GGUF conversions of chat models list only the turn end in their generation config (Qwen:
#: <|im_end|>), and in a few-shot completion the model ends the document with <|endoftext|> instead.
END_OF_TEXT_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|end|>", "</s>",
)

#: the dtypes models may be loaded in (`ModelPlacement.dtype`): each accepted name → its torch name
MODEL_DTYPES: dict[str, str] = {
    "fp32": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16",
}
#: device maps accelerate plans itself (`ModelPlacement.device_map`); a device name ("cpu", "cuda", "cuda:1")
#: puts the whole model there
PLANNED_DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "balanced_low_0", "sequential")


def _is_device_name(value: str) -> bool:
    kind, _, index = value.partition(":")
    return kind in ("cpu", "cuda", "mps", "xpu") and (not index or index.isdigit())


@dataclass(frozen=True)
class ModelPlacement:
    """How the models are loaded for their forwards: dtype (`MODEL_DTYPES`; stored as the torch name) and
    device_map (None: every weight on the CPU, as transformers loads it; one of `PLANNED_DEVICE_MAPS`: accelerate
    spreads the layers over the visible GPUs, then the CPU; or a device name). Calibration statistics are summed in
    float64 whatever the dtype."""

    dtype: str = "float32"
    device_map: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", MODEL_DTYPES[self.dtype])
        if self.device_map is not None and not (self.device_map in PLANNED_DEVICE_MAPS
                                                or _is_device_name(self.device_map)):
            raise ConfigError(f"device_map must be one of {', '.join(PLANNED_DEVICE_MAPS)} or a device such as "
                              f"'cpu' or 'cuda:0', got {self.device_map!r}")

    @property
    def planned(self) -> bool:
        """Whether accelerate plans where each layer goes (the map is one of `PLANNED_DEVICE_MAPS`)."""
        return self.device_map in PLANNED_DEVICE_MAPS
