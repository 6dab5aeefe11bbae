"""Shared helpers of the evaluation tests: a byte-level tokenizer and tiny random Qwen2 models."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

EOS = 256
VOCAB = 260


class ByteTokenizer:
    """UTF-8 bytes as token ids (0–255), EOS = 256; no download, exactly invertible."""

    eos_token_id = EOS
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {**{f"<0x{i:02X}>": i for i in range(256)}, "<eos>": EOS}


class BosByteTokenizer(ByteTokenizer):
    """Like ByteTokenizer, but prepends a BOS (id 257) when asked for special tokens."""

    bos_token_id = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + super().encode(text)


def tiny_qwen2(seed: int = 0, layers: int = 2) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


class IdentityMapper:
    """A stand-in mapper for source == target: hands the cache over unchanged."""

    def __init__(self) -> None:
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls

    def transfer(self, source_cache, position_ids=None, dtype=None):
        self._calls += 1
        return source_cache


class NoisyMapper:
    """A stand-in mapper that perturbs the values (transfer then differs from target)."""

    def __init__(self, scale: float = 0.5, seed: int = 0) -> None:
        self.scale, self.seed = scale, seed

    def transfer(self, source_cache, position_ids=None, dtype=None):
        from transformers import DynamicCache

        gen = torch.Generator().manual_seed(self.seed)
        out = DynamicCache()
        for i, layer in enumerate(source_cache.layers):
            noise = torch.randn(layer.values.shape, generator=gen) * self.scale
            out.update(layer.keys.clone(), layer.values + noise, i)
        return out


def short_items(task: str, n: int = 1, among: int = 40):
    """The ``n`` items with the shortest contexts among the first ``among`` (keeps byte-level tests fast)."""
    from kvhandoff.evaluation.tasks import MCItem, load_items

    def length(item):
        return max(len(c.context) for c in item.choices) if isinstance(item, MCItem) else len(item.context)

    return sorted(load_items(task)[:among], key=length)[:n]


def full_sequence_logprob(model, context_ids: list[int], continuation_ids: list[int]) -> float:
    """Reference: one forward pass over context + continuation from scratch, no cache reuse."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(context_ids)
    positions = torch.arange(n - 1, n - 1 + len(continuation_ids))
    return float(logprobs[positions, torch.tensor(continuation_ids)].double().sum())
