"""Helpers of the distributed tests: free loopback ports, the environment of a child process, and the function a
spawned rank runs (importable by the spawned interpreters)."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path

import kvhandoff

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout's kvhandoff first on the path, one thread, gloo on the
    loopback interface only."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvhandoff.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def run_rank(rank: int, world_size: int, port: int, input_ids, checkpoint: str, die_on_call: int | None,
             result_file: str) -> None:
    """One rank of `collect_shared` over tiny models; rank 1 exits hard (as a killed process would) on its
    `die_on_call`-th target forward. Rank 0 writes its error message (or 'ok') to `result_file`."""
    os.environ.update(loopback_env(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                                   RANK=str(rank), LOCAL_RANK=str(rank)))
    import torch

    torch.set_num_threads(1)
    from kvhandoff import FitConfig
    from kvhandoff.fit.distributed import collect_shared, launched

    from conftest import tiny_model

    source, target = tiny_model(layers=2, seed=0), tiny_model(layers=3, head_dim=32, seed=1)
    if rank == 1 and die_on_call is not None:
        calls = []

        def die(_module, _inputs):
            calls.append(1)
            if len(calls) == die_on_call:
                sys.stdout.flush()
                os._exit(3)

        target.model.register_forward_pre_hook(die)
    try:
        with launched(timeout_s=60, checkpoint_every=1) as ranks:
            collect_shared(source, target, input_ids, FitConfig(), ranks, checkpoint=Path(checkpoint) if rank == 0
                           else None, progress=False)
        outcome = "ok"
    except Exception as exc:  # the test reads what rank 0 saw
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    if rank == 0:
        Path(result_file).write_text(outcome)
