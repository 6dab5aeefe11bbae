"""The model family a server hosts: name → (model, tokenizer), and a mapper for every ordered pair of names.

By default the embedded pair (`loading.DEFAULT_SOURCE`, `loading.DEFAULT_TARGET`: qwen2.5-coder:0.5b and :1.5b) with
the cached default mapper of each direction (`workflow.obtain_mapper`: fitted on first use); otherwise models given
as name → spec (registry name, local folder or hub id) and saved mappers as (from, to) → folder, the missing
directions obtained like the default's.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.geometry import check_pair
from kvhandoff.model.loading import (
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    ModelPair,
    load_model,
    load_pair,
    model_gguf,
    registry_names,
)
from kvhandoff.progress import Progress
from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings, llama_cpp_twin
from kvhandoff.workflow import NamedPair, obtain_mapper
from kvhandoff.workflow.pair_mappers import on_source_device


def parse_model_specs(items: Iterable[str]) -> dict[str, str]:
    """``NAME=SPEC`` items → {name: spec}; a bare ``SPEC`` is its own name (e.g. ``qwen2.5-coder:0.5b``), except a
    local path, named by its last part (a client never learns where the server keeps its models)."""
    specs: dict[str, str] = {}
    for item in items:
        name, _, spec = item.partition("=") if "=" in item else (item, "", item)
        name, spec = name.strip(), spec.strip()
        if name == spec and (spec.startswith(("/", ".", "~")) or Path(spec).expanduser().is_dir()):
            name = Path(spec).expanduser().resolve().name
        if not name or not spec:
            raise ConfigError(f"models: expected NAME=SPEC or SPEC, got {item!r}")
        if name in specs:
            raise ConfigError(f"models: the name {name!r} is given twice")
        specs[name] = spec
    return specs


def served_names(specs: dict[str, str], names: Iterable[str]) -> dict[str, str]:
    """``specs`` under the served ``names`` (vLLM's ``--served-model-name``: one per hosted model, in order)."""
    names = [name.strip() for name in names]
    if len(names) != len(specs) or not all(names) or len(set(names)) != len(names):
        raise ConfigError(f"served model names: give {len(specs)} distinct non-empty names, one per hosted model "
                          f"in the order of --models ({', '.join(specs)}), got {names}")
    return dict(zip(names, specs.values(), strict=True))


def parse_mapper_dirs(items: Iterable[str], names: Iterable[str]) -> dict[tuple[str, str], Path]:
    """``FROM:TO=DIR`` items → {(from, to): folder}. Names may contain ':' (``qwen2.5-coder:0.5b``): the pair is
    split where both sides are hosted ``names``."""
    names = list(names)
    dirs: dict[tuple[str, str], Path] = {}
    for item in items:
        pair, _, folder = item.partition("=")
        splits = [(pair[:i], pair[i + 1:]) for i, c in enumerate(pair) if c == ":"
                  and pair[:i] in names and pair[i + 1:] in names]
        if not folder or len(splits) != 1 or splits[0][0] == splits[0][1]:
            raise ConfigError(f"mappers: expected FROM:TO=DIR with FROM and TO two of {', '.join(names)}, "
                              f"got {item!r}")
        if splits[0] in dirs:
            raise ConfigError(f"mappers: {splits[0][0]} → {splits[0][1]} is given twice")
        dirs[splits[0]] = Path(folder).expanduser()
    return dirs


def parse_gguf_paths(items: Iterable[str], names: Iterable[str]) -> dict[str, Path]:
    """``NAME=PATH`` items → {name: GGUF file} for hosted ``names``."""
    names = list(names)
    paths: dict[str, Path] = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path or name not in names:
            raise ConfigError(f"gguf: expected NAME=PATH with NAME one of {', '.join(names)}, got {item!r}")
        if name in paths:
            raise ConfigError(f"gguf: {name} is given twice")
        paths[name] = Path(path).expanduser()
    return paths


def gguf_of(name: str, spec: str, given: Path | None = None) -> Path:
    """The GGUF file llama.cpp runs for hosted model ``name`` (``spec``): the one given, a registry model's own
    (`loading.model_gguf`), or the only ``.gguf`` in a local model folder; ConfigError naming the fix otherwise."""
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"gguf: no file at {given} for {name}")
        return given
    if spec in registry_names():
        return model_gguf(spec)
    folder = Path(spec).expanduser()
    found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise ConfigError(f"no GGUF file for {name} ({spec}): give --gguf {name}=PATH (the GGUF of the same weights)")


def load_family(specs: dict[str, str] | None = None, mapper_dirs: dict[tuple[str, str], Path] | None = None,
                dtype: torch.dtype | str = torch.float32, progress: Progress | bool = False,
                device_map: str | None = None, llama_cpp: LlamaCppSettings | None = None,
                ggufs: dict[str, Path] | None = None):
    """(models, mappers) to serve: models name → (model, tokenizer), mappers (from, to) → `Mapper` for every ordered
    pair. ``specs`` None: the embedded default pair under its registry names. A pair in ``mapper_dirs`` is loaded
    (and checked against its models); any other is the cached default mapper of that direction (fitted and cached
    on first use, which takes long: see README). dtype, device_map: the models' placement (`loading.load_model`);
    progress: bars over a first-use conversion or fit (`kvhandoff.progress`). With ``llama_cpp`` settings each model
    is served by llama.cpp from its GGUF (`gguf_of`; ``ggufs`` name → file), fingerprinted as its transformers
    model, which is not kept."""
    specs = dict(specs) if specs else {DEFAULT_SOURCE: DEFAULT_SOURCE, DEFAULT_TARGET: DEFAULT_TARGET}
    mapper_dirs = dict(mapper_dirs or {})
    names = list(specs)
    if llama_cpp is not None:  # before any model is loaded or mapper fitted: a missing file is said at once
        if device_map is not None:
            raise ConfigError("device_map places transformers models; llama.cpp runs the models on the CPU: give "
                              "no device map with the llama.cpp engine")
        ggufs = {name: gguf_of(name, specs[name], (ggufs or {}).get(name)) for name in names}
    for pair in mapper_dirs:
        if pair[0] not in specs or pair[1] not in specs:
            raise ConfigError(f"mappers: {pair[0]} → {pair[1]} names a model that is not hosted ({', '.join(names)})")
    if len(names) == 2:
        pair = load_pair(specs[names[0]], specs[names[1]], dtype, progress, device_map)
        models = {names[0]: (pair.source, pair.source_tokenizer), names[1]: (pair.target, pair.target_tokenizer)}
    else:
        models = {name: load_model(spec, dtype, progress, device_map) for name, spec in specs.items()}
        first_model, first_tokenizer = models[names[0]]
        for model, tokenizer in list(models.values())[1:]:
            check_pair(first_model, model, first_tokenizer, tokenizer)
    mappers = {}
    for source in names:
        for target in names:
            if source == target:
                continue
            (source_model, tokenizer), (target_model, target_tokenizer) = models[source], models[target]
            if (source, target) in mapper_dirs:
                # lazy: a mapper's tensors are read (and their checksum checked) at its first handoff
                mappers[source, target] = Mapper.load(mapper_dirs[source, target], source_model, target_model,
                                                      tokenizer, target_tokenizer, lazy=True)
            else:
                pair = NamedPair.of(specs[source], specs[target],
                                    ModelPair(source_model, target_model, tokenizer, target_tokenizer))
                # a pass run for this direction serves the opposite one too when that is fitted as well
                both = (target, source) not in mapper_dirs
                mappers[source, target] = obtain_mapper(pair, progress=progress, both_directions=both)[0]
    for (source, _), mapper in mappers.items():
        on_source_device(mapper, models[source][0])
    if llama_cpp is not None:
        models = {name: (llama_cpp_twin(model, ggufs[name], llama_cpp, name=name), tokenizer)
                  for name, (model, tokenizer) in models.items()}
    return models, mappers
