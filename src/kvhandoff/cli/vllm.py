"""`vllm-config`: the commands that serve a family as vLLM instances, one OpenAI server per model, the kvhandoff
connector in each (`kvhandoff.vllm`), the K/V through a Valkey/Redis store."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from kvhandoff.cli.options import DEFAULT_SOURCE, DEFAULT_TARGET, RecomputeOption, non_negative_int, option_errors
from kvhandoff.cli.serve import Mappers, Models, family_specs
from kvhandoff.errors import ConfigError
from kvhandoff.serving.family import load_family
from kvhandoff.vllm.family import FamilyConfig
from kvhandoff.vllm.launch import CPU_ENV, model_folder, server_command, vllm_python
from kvhandoff.vllm.load_step import vllm_capabilities


def vllm_config(
    models: Models = "",
    mapper: Mappers = None,
    store_url: Annotated[str, typer.Option(help="the Valkey/Redis server every instance reaches")]
    = "redis://127.0.0.1:6379/0",
    recompute: RecomputeOption = None,
    host: Annotated[str, typer.Option(help="address the servers listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(parser=non_negative_int, help="the first model's port; the next ones follow")]
    = 8001,
    dtype: Annotated[str, typer.Option(help="vLLM's dtype (bfloat16 runs on AMX on CPU)")] = "bfloat16",
    scattered_recompute: Annotated[bool, typer.Option(
        help="each connector holds copies of the family's models and recomputes the positions the pair's "
             "policy picks anywhere in the history in its load step (the recorded turn_attention); without, a switch "
             "recomputes the history's latest positions only (recent)")] = True,
) -> None:
    """Print the commands that serve a family as vLLM instances with the kvhandoff connector: a switch between them
    is a cache hit in another model's format. The pair's mappers are found (or fitted) as `serve` finds them."""
    capabilities = vllm_capabilities(scattered_recompute)
    if recompute is not None and not capabilities.serves(recompute):
        raise typer.BadParameter(capabilities.refusal(recompute), param_hint="--recompute")
    specs, mapper_dirs = family_specs(models, mapper)
    specs = specs or {DEFAULT_SOURCE: DEFAULT_SOURCE, DEFAULT_TARGET: DEFAULT_TARGET}
    folders = {name: model_folder(spec) for name, spec in specs.items()}  # before the models load
    _, mappers = load_family(specs, mapper_dirs, progress=True)
    names = list(specs)
    connector = {"store_url": store_url, "mappers": {f"{a}->{b}": str(m.folder) for (a, b), m in mappers.items()}}
    if recompute is not None:
        connector["recompute"] = recompute.spec
    if scattered_recompute:
        connector["models"] = {name: str(folder) for name, folder in folders.items()}
    with option_errors("--store-url", "--recompute"):
        FamilyConfig.from_extra({**connector, "model": names[0]})  # the config every instance checks, checked here
    try:
        python = vllm_python()
    except ConfigError:
        python = Path("python")  # the vLLM environment is elsewhere: its python runs the printed commands
    typer.echo(f"# the store (Valkey or Redis; capacity and LRU bound it), reached at {store_url}:")
    typer.echo("valkey-server --port 6379 --save '' --appendonly no --maxmemory 4gb --maxmemory-policy allkeys-lru")
    environment = " ".join(f"{key}={value}" for key, value in CPU_ENV.items())
    for index, name in enumerate(names):
        command = server_command(python, name, folders[name], port + index, {**connector, "model": name}, host, dtype)
        typer.echo(f"# {name} (on CPU, with its own core: VLLM_CPU_OMP_THREADS_BIND={index}):")
        typer.echo(f"{environment} VLLM_CPU_OMP_THREADS_BIND={index} {shlex.join(command)}")
