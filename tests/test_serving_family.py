"""Loading the family a server hosts: NAME=SPEC models, FROM:TO=DIR mappers (names with ':' included)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from kvhandoff import FitConfig, fit_mapper
from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.model.loading import DEFAULT_SOURCE, DEFAULT_TARGET, load_model
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.family import load_family, parse_mapper_dirs, parse_model_specs, served_names
from kvhandoff.serving.server import serve_in_thread
from kvhandoff.serving.settings import ServeConfig

from conftest import random_batches, save_tiny_pair

pytestmark = pytest.mark.timeout(120)


def test_parse_model_specs():
    assert parse_model_specs(["small=/m/a", DEFAULT_SOURCE]) == {"small": "/m/a", DEFAULT_SOURCE: DEFAULT_SOURCE}
    with pytest.raises(ConfigError, match="twice"):
        parse_model_specs(["a=/x", "a=/y"])
    with pytest.raises(ConfigError, match="NAME=SPEC"):
        parse_model_specs(["a="])


def test_a_local_path_is_named_by_its_last_part_and_served_names_rename(tmp_path):
    (tmp_path / "models" / "coder-small").mkdir(parents=True)
    local = str(tmp_path / "models" / "coder-small")
    assert parse_model_specs([local, "hub/org-model"]) == {"coder-small": local, "hub/org-model": "hub/org-model"}
    specs = parse_model_specs([f"a={local}", DEFAULT_SOURCE])
    assert served_names(specs, ["small", " large "]) == {"small": local, "large": DEFAULT_SOURCE}
    for bad in (["only-one"], ["x", "x"], ["x", ""]):
        with pytest.raises(ConfigError, match="served model names"):
            served_names(specs, bad)


def test_parse_mapper_dirs_splits_names_that_contain_colons():
    names = [DEFAULT_SOURCE, DEFAULT_TARGET]
    dirs = parse_mapper_dirs([f"{DEFAULT_SOURCE}:{DEFAULT_TARGET}=/maps/up", f"{DEFAULT_TARGET}:{DEFAULT_SOURCE}=down"],
                             names)
    assert {pair: str(folder) for pair, folder in dirs.items()} == {(DEFAULT_SOURCE, DEFAULT_TARGET): "/maps/up",
                                                                    (DEFAULT_TARGET, DEFAULT_SOURCE): "down"}
    for bad in ("small:large=/x", f"{DEFAULT_SOURCE}:{DEFAULT_SOURCE}=/x", f"{DEFAULT_SOURCE}:{DEFAULT_TARGET}"):
        with pytest.raises(ConfigError, match="FROM:TO=DIR"):
            parse_mapper_dirs([bad], names)


def files_on_disk(folder):
    """Every file under ``folder``: its size, modification time and sha256."""
    return {path: (path.stat().st_size, path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_load_family_from_local_folders_and_saved_mappers(tmp_path):
    small_path, large_path = save_tiny_pair(tmp_path)
    small, tokenizer = load_model(small_path, progress=False)
    large, _ = load_model(large_path, progress=False)
    for source, target, name in ((small, large, "up"), (large, small, "down")):
        fit_mapper(source, target, random_batches(2), FitConfig(top_k=1), tokenizer, tokenizer,
                   progress=False).save(tmp_path / name)
    specs = parse_model_specs([f"small={small_path}", f"large={large_path}"])
    dirs = parse_mapper_dirs([f"small:large={tmp_path / 'up'}", f"large:small={tmp_path / 'down'}"], specs)
    models, mappers = load_family(specs, dirs, progress=False)
    assert set(models) == {"small", "large"} and set(mappers) == {("small", "large"), ("large", "small")}
    assert all(mapper.pending for mapper in mappers.values())  # tensors are read at each mapper's first handoff
    before = files_on_disk(tmp_path)
    engine = Engine(models, mappers, ServeConfig(switch=SwitchSettings(guard=False)))
    with serve_in_thread(engine) as server:  # switches, with no header
        messages = []
        for model in ("small", "large", "small"):
            messages.append({"role": "user", "content": "hello there"})
            response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                  json={"model": model, "messages": messages, "max_tokens": 3, "temperature": 0})
            assert response.status_code == 200, response.text
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        assert response.json()["kv_handoff"]["status"] == "applied"
    assert files_on_disk(tmp_path) == before  # serving never writes the model or mapper files
    swapped = {("small", "large"): tmp_path / "down", ("large", "small"): tmp_path / "up"}
    with pytest.raises(KVHandoffError):  # a mapper fitted for another pair is refused
        load_family(specs, swapped, progress=False)
    with pytest.raises(ConfigError, match="not hosted"):
        load_family(specs, {("small", "huge"): tmp_path / "up"}, progress=False)


def test_load_family_obtains_the_cached_default_mapper_of_each_missing_direction(tmp_path, monkeypatch):
    import kvhandoff.serving.family as family

    small_path, large_path = save_tiny_pair(tmp_path)
    small, tokenizer = load_model(small_path, progress=False)
    large, _ = load_model(large_path, progress=False)
    saved = tmp_path / "up"
    fit_mapper(small, large, random_batches(2), FitConfig(top_k=1), tokenizer, tokenizer, progress=False).save(saved)
    asked = []

    def fake_obtain_mapper(pair, progress=True, both_directions=False):  # workflow.obtain_mapper's: a NamedPair
        asked.append((pair.source_spec, pair.target_spec, pair.source_identity != pair.target_identity,
                      both_directions))
        return fit_mapper(pair.source, pair.target, random_batches(2), FitConfig(top_k=1), pair.tokenizer,
                          pair.models.target_tokenizer, progress=False), tmp_path / "cached", True

    monkeypatch.setattr(family, "obtain_mapper", fake_obtain_mapper)
    specs = parse_model_specs([f"small={small_path}", f"large={large_path}"])
    models, mappers = load_family(specs, {("small", "large"): saved}, progress=False)
    # only the direction without a folder; its pass need not serve the other, which has one
    assert asked == [(large_path, small_path, True, False)]
    assert set(mappers) == {("small", "large"), ("large", "small")}
    Engine(models, mappers, ServeConfig()).close()
    asked.clear()
    load_family(specs, {}, progress=False)  # both directions fitted: the first pass serves the second
    assert [entry[3] for entry in asked] == [True, True]


def test_the_gguf_of_each_model_is_named_found_or_asked_for(tmp_path):
    from kvhandoff.serving.family import gguf_of, parse_gguf_paths

    assert parse_gguf_paths(["small=~/a.gguf"], ["small", "large"]) == {"small": Path("~/a.gguf").expanduser()}
    for bad in (["tiny=a.gguf"], ["small"], ["small=a", "small=b"]):
        with pytest.raises(ConfigError, match="gguf"):
            parse_gguf_paths(bad, ["small", "large"])
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ConfigError, match="--gguf small=PATH"):
        gguf_of("small", str(folder))
    (folder / "weights.gguf").write_bytes(b"")
    assert gguf_of("small", str(folder)) == folder / "weights.gguf"
    with pytest.raises(ConfigError, match="no file"):
        gguf_of("small", str(folder), tmp_path / "missing.gguf")


def test_the_llama_cpp_engine_takes_no_device_map(tmp_path):
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings

    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="device map"):
        load_family({"a": str(tmp_path), "b": str(tmp_path)}, device_map="auto", llama_cpp=LlamaCppSettings())
