"""`serve`: an OpenAI-compatible server where a conversation switches models without re-prefill."""

from __future__ import annotations

from typing import Annotated

import typer

from kvhandoff.cli.options import (
    DEFAULT_DTYPE,
    DEFAULT_SOURCE,
    DEFAULT_TARGET,
    DeviceMap,
    Dtype,
    RecomputeOption,
    guard_action,
    non_negative_float,
    non_negative_int,
    one_of,
    option_errors,
    positive_float,
    positive_int,
    recompute_policy,
)
from kvhandoff.runtime.llama_cpp.backend import LlamaCppSettings
from kvhandoff.runtime.offset import DEFAULT_OFFSET_RECOMPUTE
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.switch.guard import GUARD_SIGNALS
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.family import (
    load_family,
    parse_gguf_paths,
    parse_mapper_dirs,
    parse_model_specs,
    served_names,
)
from kvhandoff.serving.server import run_server
from kvhandoff.serving.settings import GENERATION_CONFIG_SOURCES, HealSettings, ServeConfig
from kvhandoff.serving.tools import TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: what runs the hosted models
ENGINES = ("transformers", "llama.cpp")
#: the sequences of a served llama.cpp context (llama.cpp's most): the sessions at once follow from it
LLAMA_SEQUENCES = 256


#: the hosted models (`serve`, and the measurements that host a family)
Models = Annotated[str, typer.Option(help=(
    "hosted models, comma-separated NAME=SPEC (or SPEC, named by itself); SPEC: registry name, local model "
    "folder or hub id (default: qwen2.5-coder:0.5b and qwen2.5-coder:1.5b)"))]
#: saved mappers of the hosted models
Mappers = Annotated[list[str] | None, typer.Option("--mapper", help=(
    "FROM:TO=DIR: a saved mapper for one direction (repeatable); the other directions use the pair's cached "
    "default mapper, fitted on first use"))]
GuardSwitch = Annotated[str, typer.Option(parser=one_of(("on", "off")), help=(
    "score a mapped cache before it serves and re-prefill when it scores as degraded"))]
GuardSignal = Annotated[str | None, typer.Option(parser=one_of(GUARD_SIGNALS), help=(
    "the guard's score (default: each pair's recorded one; with --guard-threshold: entropy)"))]
GuardActionOption = Annotated[object, typer.Option(parser=guard_action, metavar="fallback|escalate:RULE:BUDGET",
                                                   help=(
    "what the guard does at a switch it flags, for every pair: re-prefill (fallback), or hand the conversation "
    "over again recomputing more of it (e.g. escalate:recent:35%); default: each pair's recorded action, else "
    "fallback"))]
GuardThreshold = Annotated[float | None, typer.Option(help=(
    "re-prefill when the guard's score exceeds this, for every pair (default: each pair's threshold recorded by "
    "`kvhandoff guard-calibrate`; a pair without one serves mapped)"))]


def family_specs(models: str, mapper: list[str] | None, served: str | None = None):
    """(specs, mapper folders) of the --models / --mapper / --served-model-name options, for `load_family` (the
    mappers' FROM:TO name the served names); bad values are reported against those options."""
    with option_errors("--models", "--mapper", "--served-model-name"):
        specs = parse_model_specs(item for item in models.split(",") if item.strip()) or None
        if served:
            specs = served_names(specs or {DEFAULT_SOURCE: DEFAULT_SOURCE, DEFAULT_TARGET: DEFAULT_TARGET},
                                 served.split(","))
        mapper_dirs = parse_mapper_dirs(mapper or [], list(specs) if specs else [DEFAULT_SOURCE, DEFAULT_TARGET])
    return specs, mapper_dirs


def serve(
    models: Models = "",
    mapper: Mappers = None,
    served_model_name: Annotated[str | None, typer.Option(help=(
        "comma-separated names the models are served under, one per model in the order of --models (clients see "
        "only these; --mapper's FROM:TO use them)"))] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(parser=non_negative_int, help="port to listen on")] = 8000,
    guard: GuardSwitch = "on",
    guard_signal: GuardSignal = SwitchSettings.guard_signal,
    guard_threshold: GuardThreshold = SwitchSettings.guard_threshold,
    guard_action: GuardActionOption = None,
    max_sessions: Annotated[int, typer.Option(parser=positive_int, help="live sessions at once")] = 256,
    session_ttl: Annotated[float, typer.Option(parser=positive_float, help="seconds an idle session is kept")]
    = 1800.0,
    cache_memory: Annotated[int, typer.Option(parser=positive_int, help=(
        "bytes of KV cache of the sessions and the prefix cache together (least recently used evicted past "
        "it)"))] = 4 * 1024**3,
    max_batch: Annotated[int, typer.Option(parser=positive_int, help=(
        "requests a model serves at once; their decode steps share one forward"))] = ServeConfig.max_batch,
    prefill_chunk: Annotated[int, typer.Option(parser=positive_int, help=(
        "tokens a prompt is read in at a time (running answers step between chunks)"))] = ServeConfig.prefill_chunk,
    max_body_bytes: Annotated[int, typer.Option(parser=positive_int, help=(
        "the largest request body read (past it: 413, before it is read whole)"))] = ServeConfig.max_body_bytes,
    read_timeout: Annotated[float, typer.Option(parser=positive_float, help=(
        "seconds a request's body may take to arrive whole (past it: 408, the connection closed)"))]
    = ServeConfig.read_timeout_s,
    max_context: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "tokens a conversation may reach (default: the hosted models' smallest max_position_embeddings)"))] = None,
    recompute: RecomputeOption = None,
    min_speedup: Annotated[float | None, typer.Option(parser=non_negative_float, help=(
        "choose each pair's recompute policy again from the trade-off recorded with its mapper: the most "
        "retentive measured point at least this many times faster than re-prefill (the fastest one keeping "
        "--min-retention); default: the recorded policy"))] = None,
    min_retention: Annotated[float | None, typer.Option(parser=non_negative_float, help=(
        "with the recorded trade-off (as --min-speedup): the mean retention the chosen point should keep; default: "
        "the record's"))] = None,
    offset_reuse: Annotated[bool, typer.Option(help=(
        "serve a prompt whose history another conversation holds after other instructions (another agent's) from "
        "that history, moved to its new positions"))] = SwitchSettings.offset_reuse,
    offset_recompute: Annotated[RecomputePolicy | None, typer.Option(
        parser=recompute_policy, metavar="RULE:BUDGET", help=(
            f"what a model recomputes of history reused at another offset: a rule ranking by the target alone, or "
            f"turn_attention (by the read of the rest of the prompt by the model that held the history; default "
            f"{DEFAULT_OFFSET_RECOMPUTE.spec})"))] = None,
    heal_budget: Annotated[int, typer.Option(parser=non_negative_int, help=(
        "positions a model reads again on its own in idle time after each request, of that request's "
        "conversation: its rows mapped at a switch become its own (0: no healing)"))] = HealSettings.budget,
    heal_chunk: Annotated[int, typer.Option(parser=positive_int, help=(
        "positions healed in one forward (a new request waits for one chunk at most)"))] = HealSettings.chunk,
    api_key: Annotated[list[str] | None, typer.Option(envvar="KVHANDOFF_API_KEY", help=(
        "require 'Authorization: Bearer KEY' on every request; repeatable, each key a tenant whose caches no other "
        "key reaches (env KVHANDOFF_API_KEY: keys separated by spaces)"))] = None,
    open_probes: Annotated[bool, typer.Option(help=(
        "with --api-key: /health and /metrics answer without a key too (/health then shows liveness only); by "
        "default they need a key as every route does"))] = ServeConfig.open_probes,
    tool_call_parser: Annotated[str, typer.Option(parser=one_of(tuple(TOOL_PARSERS)), help=(
        "how tool calls are read out of the models' answers"))] = ServeConfig.tool_parser,
    generation_config: Annotated[str, typer.Option(parser=one_of(GENERATION_CONFIG_SOURCES), help=(
        "what a request that leaves sampling fields or max_tokens out gets, as vLLM's flag: auto, each model's "
        "generation_config.json, then the server's defaults; vllm, the server's defaults only"))]
    = ServeConfig.generation_config,
    log_level: Annotated[str, typer.Option(parser=one_of(LOG_LEVELS), help="uvicorn's log level")] = "info",
    dtype: Dtype = DEFAULT_DTYPE,
    device_map: DeviceMap = None,
    engine: Annotated[str, typer.Option(parser=one_of(ENGINES), help=(
        "what runs the models: transformers (float32), or llama.cpp on their GGUF files"))] = "transformers",
    gguf: Annotated[list[str] | None, typer.Option(help=(
        "NAME=PATH: the GGUF llama.cpp runs for a hosted model (repeatable; default: a registry model's own, or the "
        "only .gguf in a local model folder)"))] = None,
    llama_context: Annotated[int, typer.Option(parser=positive_int, help=(
        "llama.cpp: KV cells of each model's context, shared by its conversations"))] = LlamaCppSettings.context,
    llama_threads: Annotated[int | None, typer.Option(parser=positive_int, help=(
        "llama.cpp: CPU threads (default: llama.cpp's choice)"))] = None,
) -> None:
    """Serve a model family behind an OpenAI-compatible API; a conversation that switches models is handed over."""
    with option_errors("--host", "--port", "--guard-threshold", "--max-context", "--api-key", "--recompute",
                       "--min-speedup", "--min-retention", "--offset-recompute", "--heal-budget", "--heal-chunk"):
        switch = SwitchSettings(recompute=recompute, min_speedup=min_speedup, min_retention=min_retention,
                                guard=guard == "on", guard_signal=guard_signal, guard_threshold=guard_threshold,
                                guard_action=guard_action, offset_reuse=offset_reuse,
                                offset_recompute=offset_recompute)
        config = ServeConfig(host=host, port=port, switch=switch,
                             max_sessions=max_sessions, session_ttl_s=session_ttl,
                             cache_memory_bytes=cache_memory, max_context=max_context,
                             max_body_bytes=max_body_bytes, read_timeout_s=read_timeout, max_batch=max_batch,
                             prefill_chunk=prefill_chunk,
                             api_key=tuple(api_key) if api_key else None, open_probes=open_probes,
                             tool_parser=tool_call_parser, generation_config=generation_config,
                             heal=HealSettings(heal_budget, heal_chunk), log_level=log_level)
    specs, mapper_dirs = family_specs(models, mapper, served_model_name)
    llama_cpp, ggufs = None, None
    if engine == "llama.cpp":
        with option_errors("--llama-context", "--gguf"):
            llama_cpp = LlamaCppSettings(context=llama_context, sequences=LLAMA_SEQUENCES, threads=llama_threads)
            ggufs = parse_gguf_paths(gguf or [], list(specs) if specs else [DEFAULT_SOURCE, DEFAULT_TARGET])
    elif gguf:
        raise typer.BadParameter("--gguf names the files of --engine llama.cpp", param_hint="--gguf")
    family = load_family(specs, mapper_dirs, dtype=dtype, progress=True, device_map=device_map,
                         llama_cpp=llama_cpp, ggufs=ggufs)
    run_server(*family, config)

