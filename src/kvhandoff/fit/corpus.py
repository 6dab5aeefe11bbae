"""Calibration windows and held-out documents: the texts of `text_sources` (or a caller's own) tokenized, packed and
cut into fixed-length windows (`calibration_batches`, `pack_texts`: a `CalibrationCorpus`), or into long documents
(`heldout_documents`), each described for the mapper manifest (sources, versions, counts, seed, a hash of the token
ids).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence

import torch

from kvhandoff.config import CALIBRATION_GROUPS, DEFAULT_CALIBRATION_MIX, CalibrationSpec, require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.files import sha256_bytes
from kvhandoff.fit.text_sources import (
    DEFAULT_HELDOUT_SOURCE,
    HELDOUT_SOURCES,
    SOURCES,
    calibration_texts,
    heldout_texts,
    qasper_papers,
)


# -- tokenizing ------------------------------------------------------------------------------------------------
def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ConfigError("the tokenizer has no eos_token_id; it is needed to separate packed texts")
    return int(eos)


def _encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (a HF tokenizer, or anything with ``encode``)."""
    if callable(tokenizer):
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _ids_hash(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


class CalibrationCorpus:
    """Fixed-length calibration windows; iterating yields ``LongTensor [batch, seq_len]`` batches."""

    def __init__(self, input_ids: torch.Tensor, batch_size: int, info: dict):
        self.input_ids = input_ids
        self.batch_size = batch_size
        self._info = info

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def __len__(self) -> int:
        return -(-self.num_sequences // self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for start in range(0, self.num_sequences, self.batch_size):
            yield self.input_ids[start : start + self.batch_size]

    def describe(self) -> dict:
        """What went in (for the mapper manifest): sources, versions, counts, seed, hash of the token ids."""
        return {
            **self._info,
            "num_sequences": self.num_sequences,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_tokens": self.num_tokens,
            "token_ids_sha256": _ids_hash([self.input_ids]),
        }

    def __repr__(self) -> str:
        return f"CalibrationCorpus(num_sequences={self.num_sequences}, seq_len={self.seq_len})"


def calibration_batches(
    tokenizer,
    num_sequences: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int = 4,
    sources: Sequence[str] | None = None,
    mix: Sequence[str] = DEFAULT_CALIBRATION_MIX,
) -> CalibrationCorpus:
    """Pack the built-in calibration texts into ``num_sequences`` windows of ``seq_len`` tokens.

    The texts are shuffled with ``seed``, tokenized without special tokens, joined with the tokenizer's EOS
    after each text and cut into consecutive windows; only as many texts as needed are tokenized.
    mix: calibration groups (``config.CALIBRATION_GROUPS``) sharing the windows equally (the first groups take
    the remainder), each packed on its own and stacked in order; sources: pack exactly these sources together
    instead (one group).
    """
    if sources is not None:
        texts = calibration_texts(sources)
        return _pack(tokenizer, texts, num_sequences, seq_len, seed, batch_size,
                     [SOURCES[n].describe() for n in sources])
    # the spec validates the mix and owns the window split, as for the workflow's cached passes
    spec = CalibrationSpec(num_sequences=num_sequences, seq_len=seq_len, seed=seed, batch_size=batch_size,
                           mix=tuple(mix))
    parts = [calibration_batches(tokenizer, windows, seq_len, seed, batch_size, CALIBRATION_GROUPS[group])
             for group, windows in spec.windows_per_group().items()]
    if len(parts) == 1:
        return parts[0]
    described = [p.describe() for p in parts]  # each hashes its token ids: once per part
    info = {**described[0], "sources": [s for d in described for s in d["sources"]],
            "num_texts": sum(d["num_texts"] for d in described),
            "num_texts_available": sum(d["num_texts_available"] for d in described),
            "mix": spec.windows_per_group(),
            "packing": "per group of the mix: shuffled texts, each followed by EOS, cut into consecutive windows; "
                       "the groups' windows stacked in mix order"}
    for key in ("num_sequences", "seq_len", "batch_size", "num_tokens", "token_ids_sha256"):
        info.pop(key)
    return CalibrationCorpus(torch.cat([p.input_ids for p in parts]), batch_size, info)


def pack_texts(
    tokenizer,
    texts: Sequence[str],
    num_sequences: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int = 4,
    name: str = "user texts",
) -> CalibrationCorpus:
    """Like :func:`calibration_batches`, for caller-supplied texts (``name`` labels them in ``describe()``)."""
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise ConfigError(f"no text to calibrate on in {name}")
    digest = sha256_bytes("\x00".join(texts).encode("utf-8"))
    return _pack(tokenizer, texts, num_sequences, seq_len, seed, batch_size, [{"name": name, "texts_sha256": digest}])


def _pack(tokenizer, texts, num_sequences, seq_len, seed, batch_size, sources_info) -> CalibrationCorpus:
    for label, value in (("num_sequences", num_sequences), ("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}")
    eos = _eos_id(tokenizer)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    needed = num_sequences * seq_len
    stream: list[int] = []
    used = 0
    chunk = 64
    while len(stream) < needed and used < len(order):
        batch = [texts[i] for i in order[used : used + chunk]]
        for ids in _encode(tokenizer, batch):
            stream.extend(ids)
            stream.append(eos)
            used += 1
            if len(stream) >= needed:
                break
        chunk = min(chunk * 2, 1024)
    if len(stream) < needed:
        names = [s["name"] for s in sources_info]
        raise ConfigError(
            f"the calibration texts ({', '.join(names)}) hold only {len(stream)} tokens with this tokenizer; "
            f"{num_sequences} x {seq_len} = {needed} were requested"
        )
    input_ids = torch.tensor(stream[:needed], dtype=torch.long).view(num_sequences, seq_len)
    info = {
        "kind": "calibration",
        "sources": sources_info,
        "num_texts": used,
        "num_texts_available": len(texts),
        "seed": seed,
        "packing": "shuffled texts, each followed by EOS, cut into consecutive windows",
        "eos_token_id": eos,
        "tokenizer": _tokenizer_name(tokenizer),
    }
    return CalibrationCorpus(input_ids, batch_size, info)


class HeldoutDocuments(list):
    """A list of 1-D ``LongTensor`` documents, with :meth:`describe` and the ``titles`` of the documents."""

    def __init__(self, documents: list[torch.Tensor], titles: list[str], info: dict):
        super().__init__(documents)
        self.titles = titles
        self._info = info

    def describe(self) -> dict:
        return {
            **self._info,
            "num_docs": len(self),
            "titles": list(self.titles),
            "doc_tokens": [int(d.numel()) for d in self],
            "num_tokens": int(sum(d.numel() for d in self)),
            "token_ids_sha256": _ids_hash(list(self)),
        }


def heldout_documents(
    tokenizer,
    num_docs: int,
    min_tokens: int = 2048,
    source: str = DEFAULT_HELDOUT_SOURCE,
    max_tokens: int | None = None,
) -> HeldoutDocuments:
    """``num_docs`` held-out documents of at least ``min_tokens`` tokens each (1-D LongTensors), in a fixed
    order. ``max_tokens`` truncates each document. Qasper: one paper per document (shorter papers are
    skipped); lambada-heldout: consecutive held-out passages joined by blank lines."""
    require_positive("num_docs", num_docs)
    require_positive("min_tokens", min_tokens)
    if max_tokens is not None and max_tokens < min_tokens:
        raise ConfigError(f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens})")
    if source not in HELDOUT_SOURCES:
        raise ConfigError(f"held-out source must be one of {HELDOUT_SOURCES}, got {source!r}")
    if source == "qasper":
        docs, titles = _qasper_documents(tokenizer, num_docs, min_tokens, max_tokens)
        available = "the Qasper papers"
    else:
        docs, titles = _passage_documents(tokenizer, source, num_docs, min_tokens, max_tokens)
        available = "the held-out LAMBADA passages"
    if len(docs) < num_docs:
        raise ConfigError(
            f"{available} yield only {len(docs)} documents of >= {min_tokens} tokens; {num_docs} requested"
        )
    info = {
        "kind": "heldout",
        "source": SOURCES[source].describe(),
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "tokenizer": _tokenizer_name(tokenizer),
    }
    return HeldoutDocuments(docs, titles, info)


def _qasper_documents(tokenizer, num_docs: int, min_tokens: int, max_tokens: int | None):
    """(documents, titles): one Qasper paper per document, papers shorter than min_tokens skipped."""
    docs: list[torch.Tensor] = []
    titles: list[str] = []
    papers = qasper_papers()
    for start in range(0, len(papers), 16):
        batch = papers[start : start + 16]
        for (paper_id, text), ids in zip(batch, _encode(tokenizer, [t for _, t in batch]), strict=True):
            if len(ids) >= min_tokens:
                docs.append(torch.tensor(ids[:max_tokens], dtype=torch.long))
                titles.append(f"qasper:{paper_id}:{text.split(chr(10), 1)[0][:80]}")
            if len(docs) == num_docs:
                return docs, titles
    return docs, titles


def _passage_documents(tokenizer, source: str, num_docs: int, min_tokens: int, max_tokens: int | None):
    """(documents, titles): consecutive held-out passages of `source` joined by blank lines until each document
    has min_tokens."""
    docs: list[torch.Tensor] = []
    titles: list[str] = []
    pending: list[str] = []
    estimate = 0
    for passage in heldout_texts(source):
        pending.append(passage)
        estimate += len(_encode(tokenizer, [passage])[0]) + 1
        if estimate < min_tokens:
            continue
        ids = _encode(tokenizer, ["\n\n".join(pending)])[0]
        if len(ids) < min_tokens:
            continue
        docs.append(torch.tensor(ids[:max_tokens], dtype=torch.long))
        titles.append(f"lambada-heldout:{len(docs) - 1}:{len(pending)} passages")
        pending, estimate = [], 0
        if len(docs) == num_docs:
            break
    return docs, titles
