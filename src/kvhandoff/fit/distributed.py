"""Distributed calibration: one statistics pass shared by the processes `torchrun` starts.

Every rank runs both models over its share of the calibration windows — window i of the windows still to do
goes to rank i mod world_size — and adds its rows into its own float64 sums. The ranks work in rounds of
`Ranks.checkpoint_every` windows each; after every round the sums are added up on rank 0 with
`torch.distributed.reduce` (gloo for CPU tensors, NCCL for CUDA ones) and rank 0 saves the running total with the
list of windows it covers (one file, written atomically). A re-run skips those windows, with any number of
ranks: sums over disjoint windows add exactly, so N processes give the one-process statistics up to float64
round-off (only the order of the additions differs).
Under torchrun's c10d rendezvous (`--rdzv-backend c10d --max-restarts R`) a restart after a dead rank resumes by
itself; with the static rendezvous (`--master-addr/--master-port`) restarted ranks cannot reconnect to each other
(gloo: connection refused), so there run the command again, which resumes from the checkpoint.

Rank 0 leads: it runs the ordinary fit-or-reuse workflow and, when a pass is needed, sends the windows to the
other ranks (`lead_collection`), which wait for work in `follow` until rank 0 dismisses them. A collective that
fails — a rank died, or did not answer within the timeout — raises `DistributedError` naming the rank and the
step. Without torchrun's environment (`WORLD_SIZE` unset or 1) `Ranks()` is a single process and every
collective is a no-op, so the same code runs (and resumes from a checkpoint) in one process.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvhandoff.config import FitConfig, require_positive
from kvhandoff.errors import ConfigError, DistributedError, KVHandoffError
from kvhandoff.files import sha256_bytes
from kvhandoff.fit.pipeline import add_batch, empty_statistics
from kvhandoff.fit.statistics import CalibrationStats, as_count
from kvhandoff.progress import Progress, as_progress

logger = logging.getLogger(__name__)

#: seconds a collective waits for the other ranks (env KVHANDOFF_DIST_TIMEOUT overrides)
DEFAULT_TIMEOUT_S = 1800.0
#: windows each rank reads between two reductions (each reduction is checkpointed)
DEFAULT_CHECKPOINT_EVERY = 8
#: the kind of file a checkpoint is (its info records it)
CHECKPOINT_KIND = "kvhandoff-partial-statistics"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass
class Ranks:
    """This process's place in a distributed run: rank, world size, the collective timeout and the round size.

    `Ranks()` is a single process (no process group; every collective returns its input)."""

    rank: int = 0
    world_size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    _dismissed: bool = field(default=False, repr=False)
    _broken: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        require_positive("checkpoint_every", self.checkpoint_every)
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _collective(self, step: str, call: Callable[[], Any]) -> Any:
        """Run one collective; a failure (a dead peer, a timeout) → DistributedError naming this rank and step."""
        try:
            return call()
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError, DistNetworkError) are RuntimeErrors
            self._broken = True
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {step} failed: another rank died or did not answer "
                f"within the {self.timeout_s:g} s collective timeout ({_one_line(exc)[:300]})"
            ) from exc

    def barrier(self, step: str) -> None:
        if self.distributed:
            self._collective(step, dist.barrier)

    def broadcast(self, value: Any, step: str) -> Any:
        """Rank 0's `value` (any picklable object), on every rank."""
        if not self.distributed:
            return value
        box = [value if self.is_root else None]
        self._collective(step, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def gather(self, value: Any, step: str) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        values: list = [None] * self.world_size
        self._collective(step, lambda: dist.all_gather_object(values, value))
        return values

    def require_same(self, value: Any, what: str) -> None:
        """DistributedError on every rank unless all ranks hold the same `value` (e.g. the models' identities)."""
        values = self.gather(value, f"comparing {what}")
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            raise DistributedError(
                f"rank(s) {differing} hold other {what} than rank 0 ({values[differing[0]]!r} vs {values[0]!r}): "
                "every rank must load the same models (same files on every node)"
            )

    def reduce_statistics(self, stats: CalibrationStats, step: str) -> None:
        """Add every rank's sums (and token count) into rank 0's `stats`, in place."""
        if not self.distributed:
            return
        count = torch.tensor([stats.count], dtype=torch.float64)  # weighted rows count fractionally

        def reduce_all() -> None:
            for tensor in (count, *stats.sums()):
                dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)

        self._collective(step, reduce_all)
        if self.is_root:
            stats.count = as_count(count.item())


def timeout_from_environment() -> float:
    value = os.environ.get("KVHANDOFF_DIST_TIMEOUT")
    try:
        timeout = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise DistributedError(f"KVHANDOFF_DIST_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return timeout


def default_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA is available (env KVHANDOFF_DIST_BACKEND
    overrides). The statistics are CPU tensors, so their reductions run on gloo."""
    return os.environ.get("KVHANDOFF_DIST_BACKEND") or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


def requested_world_size() -> int:
    """The world size torchrun's environment asks for (1 without torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        raise DistributedError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


@contextmanager
def launched(timeout_s: float | None = None,
             checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> Iterator[Ranks]:
    """This process's `Ranks` from torchrun's environment (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT): the
    default process group is set up for the block (unless the caller set one up) and torn down after it.
    Without WORLD_SIZE > 1: a single process, nothing set up."""
    world = requested_world_size()
    if timeout_s is None:
        timeout_s = timeout_from_environment()
    if world <= 1:
        yield Ranks(timeout_s=timeout_s, checkpoint_every=checkpoint_every)
        return
    rank = int(os.environ.get("RANK", "-1"))
    if not 0 <= rank < world:
        raise DistributedError(f"WORLD_SIZE is {world} but RANK is {os.environ.get('RANK')!r}: start the ranks "
                               "with torchrun")
    owner = not dist.is_initialized()
    if owner:
        try:
            dist.init_process_group(default_backend(), init_method="env://", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(f"rank {rank} of {world}: cannot join the process group "
                                   f"({_one_line(exc)[:300]}); check MASTER_ADDR/MASTER_PORT") from exc
        gpus = local_gpus()
        if gpus:
            torch.cuda.set_device(gpus[0])
    try:
        yield Ranks(rank, world, timeout_s, checkpoint_every)
    finally:
        if owner and dist.is_initialized():
            dist.destroy_process_group()


def gpu_share(local_rank: int, local_world_size: int, device_count: int) -> list[int]:
    """The GPUs of a node that one of its `local_world_size` ranks uses: an equal run of consecutive GPUs each
    (a model too big for one GPU is spread over its run with a device map), or one shared GPU when there are
    more ranks than GPUs; none without GPUs."""
    if device_count <= 0:
        return []
    if local_world_size > device_count:
        return [local_rank % device_count]
    per_rank = device_count // local_world_size
    return list(range(local_rank * per_rank, (local_rank + 1) * per_rank))


def local_gpus() -> list[int]:
    """This process's share of the node's GPUs (`gpu_share`; torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE, all
    visible GPUs without them)."""
    if not torch.cuda.is_available():
        return []
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        raise DistributedError("LOCAL_RANK and LOCAL_WORLD_SIZE must be integers: start the ranks with torchrun") \
            from None
    return gpu_share(local_rank, max(1, local_world), torch.cuda.device_count())


# -- the windows ------------------------------------------------------------------------------------------------
def window_shares(todo: list[int], world_size: int) -> list[list[int]]:
    """The windows each rank reads: the i-th window still to do goes to rank i mod world_size."""
    return [todo[rank::world_size] for rank in range(world_size)]


def windows_hash(input_ids: torch.Tensor) -> str:
    return sha256_bytes(str(tuple(input_ids.shape)).encode() + input_ids.to(torch.int64).contiguous().numpy().tobytes())


def _ranges(windows: list[int]) -> str:
    """'0-3, 8, 10-11' for a message."""
    parts, run = [], []
    for w in sorted(windows):
        if run and w != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(w)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts) or "none"


# -- checkpoints ------------------------------------------------------------------------------------------------
def _checkpoint_info(ids_hash: str, config: FitConfig, windows: list[int], runs: list[dict]) -> dict:
    weighting = {"row_weights": config.row_weights} if config.weighted else {}
    return {"kind": CHECKPOINT_KIND, "token_ids_sha256": ids_hash, "token_stride": config.token_stride,
            "skip_first_tokens": config.skip_first_tokens, **weighting, "windows": sorted(windows), "runs": runs}


def load_checkpoint(path: Path, empty: CalibrationStats, ids_hash: str,
                    config: FitConfig) -> tuple[CalibrationStats, list[int], list[dict]] | None:
    """(statistics, windows they cover, the runs that reduced them) saved at `path` for exactly these windows,
    models and settings, or None (with a warning logged when one was there but does not fit). A checkpoint holding more
    moments than the pass sums resumes it (they are not read); one holding fewer cannot."""
    if not path.is_file():
        return None
    try:
        info = CalibrationStats.read_info(path) or {}
        stats = CalibrationStats.load(path, target_gram=empty.target_gram, kv_cross=empty.kv_cross)
    except KVHandoffError as exc:
        problem = f"not usable ({exc})"
    else:
        expected = _checkpoint_info(ids_hash, config, info.get("windows", []), info.get("runs", []))
        if info == expected and (stats.source, stats.target) == (empty.source, empty.target):
            return stats, list(info["windows"]), list(info["runs"])
        problem = "written for other windows, models or settings"
    logger.warning("checkpoint %s %s; starting the pass from the first window", path, problem)
    return None


# -- the pass ---------------------------------------------------------------------------------------------------
def resume_point(stats: CalibrationStats, checkpoint: Path | None, ids_hash: str, config: FitConfig,
                 ranks: Ranks) -> tuple[CalibrationStats, list[int], list[dict]]:
    """(the sums to go on from, the windows already reduced, the runs that reduced them): rank 0 reads them from
    ``checkpoint`` when it holds these windows' sums, and every rank learns which windows to skip."""
    done: list[int] = []
    runs: list[dict] = []
    if ranks.is_root and checkpoint is not None:
        loaded = load_checkpoint(checkpoint, stats, ids_hash, config)
        if loaded is not None:
            stats, done, runs = loaded
    done = ranks.broadcast(done, "sharing the windows already reduced")
    if ranks.is_root and done:
        logger.info("resuming from %s: %d window(s) already reduced (%s)", checkpoint, len(done), _ranges(done))
    return stats, done, runs


def collect_shared(source_model, target_model, input_ids: torch.Tensor, config: FitConfig, ranks: Ranks,
                   batch_size: int = 1, checkpoint: Path | None = None, progress: Progress | bool = False,
                   target_layers: range | None = None, source_sums: bool = True, target_gram: bool = False,
                   kv_cross: bool | None = None) -> tuple[CalibrationStats | None, dict]:
    """The statistics of windows `input_ids` [windows, tokens], shared out between the ranks (every rank calls
    this with the same windows). Returns (statistics, record) on rank 0 and (None, record) elsewhere.

    checkpoint: a file (read and written by rank 0 only) holding the sums of the windows reduced so far; they are
    skipped, and the file is rewritten after every round. record: world_size, the windows each rank read in
    this run (windows_per_rank), and what a checkpoint contributed (resumed_from_checkpoint).
    target_layers, source_sums: a pass for one block of target layers (`fit.collect_statistics`); such a pass
    keeps no checkpoint. target_gram: sum the target's Gram too (statistics for both directions); kv_cross: the
    K–V cross moments (None: when the config's maps read source K and V together). progress: rank 0's bar over its
    windows (`kvhandoff.progress`; the other ranks draw none).
    """
    if target_layers is not None and checkpoint is not None:
        raise DistributedError("a pass over a block of target layers keeps no checkpoint")
    ids_hash = windows_hash(input_ids)
    ranks.require_same(ids_hash, "calibration windows (hash of their token ids)")
    kv_cross = config.joint_inputs if kv_cross is None else kv_cross
    stats = empty_statistics(source_model, target_model, target_layers, source_sums, target_gram, kv_cross)
    stats, done, runs = resume_point(stats, checkpoint, ids_hash, config, ranks)
    resumed = {"windows": list(done), "runs": list(runs)} if done else None
    skip = set(done)
    shares = window_shares([w for w in range(int(input_ids.shape[0])) if w not in skip], ranks.world_size)
    every = ranks.checkpoint_every
    rounds = math.ceil(max(len(share) for share in shares) / every)
    mine = shares[ranks.rank]
    desc = "calibration" if not ranks.distributed else f"calibration (rank 0 of {ranks.world_size})"
    bar = as_progress(progress if ranks.is_root else False)(total=len(mine), desc=desc, unit="window")
    try:
        for round_index in range(rounds):
            chunk = slice(round_index * every, (round_index + 1) * every)
            own = mine[chunk]
            for start in range(0, len(own), batch_size):
                ids = input_ids[own[start : start + batch_size]]
                add_batch(stats, source_model, target_model, ids, config, target_layers)
                bar.update(ids.shape[0])
            reduced = [w for share in shares for w in share[chunk]]
            ranks.reduce_statistics(stats, f"reducing round {round_index + 1} of {rounds} (windows "
                                           f"{_ranges(reduced)})")
            done.extend(reduced)
            if not ranks.is_root:
                # rank 0 holds the total
                stats = CalibrationStats(stats.source, stats.target, source_sums, target_gram, kv_cross)
            elif checkpoint is not None:
                run = {"world_size": ranks.world_size, "windows_per_rank": [share[: chunk.stop] for share in shares]}
                stats.save(checkpoint, _checkpoint_info(ids_hash, config, done, [*runs, run]))
    except BaseException as exc:
        ranks._broken = True
        if isinstance(exc, DistributedError) and checkpoint is not None:
            raise DistributedError(f"{exc}. Re-run the same command to resume: rank 0 keeps the {len(done)} "
                                   f"window(s) reduced so far in {checkpoint}") from exc
        raise
    finally:
        bar.close()
    record: dict = {"world_size": ranks.world_size, "windows_per_rank": shares}
    if resumed is not None:
        record["resumed_from_checkpoint"] = resumed
    return (stats if ranks.is_root else None), record


# -- rank 0 leads, the others follow ----------------------------------------------------------------------------
def lead_collection(ranks: Ranks, source_model, target_model, input_ids: torch.Tensor, config: FitConfig,
                    batch_size: int = 1, checkpoint: Path | None = None, progress: Progress | bool = False,
                    target_layers: range | None = None, source_sums: bool = True, target_gram: bool = False,
                    kv_cross: bool | None = None) -> tuple[CalibrationStats, dict]:
    """Rank 0: send the windows to the ranks waiting in `follow`, then run the pass with them (target_layers,
    source_sums, target_gram, kv_cross: see `collect_shared`)."""
    if not ranks.is_root:
        raise DistributedError(f"rank {ranks.rank}: only rank 0 leads a calibration pass")
    job = {"input_ids": input_ids, "config": config, "batch_size": batch_size, "target_layers": target_layers,
           "source_sums": source_sums, "target_gram": target_gram, "kv_cross": kv_cross}
    ranks.broadcast(job, "sending the calibration windows to the other ranks")
    stats, record = collect_shared(source_model, target_model, input_ids, config, ranks, batch_size, checkpoint,
                                   progress, target_layers, source_sums, target_gram, kv_cross)
    assert stats is not None
    return stats, record


def follow(ranks: Ranks, source_model, target_model) -> list[dict]:
    """Ranks other than 0: take part in every pass rank 0 leads, until it dismisses them. Returns each pass's
    record."""
    records = []
    while True:
        job = ranks.broadcast(None, "waiting for rank 0's next calibration pass")
        if job is None:
            return records
        records.append(collect_shared(source_model, target_model, job["input_ids"], job["config"], ranks,
                                      job["batch_size"], target_layers=job["target_layers"],
                                      source_sums=job["source_sums"], target_gram=job["target_gram"],
                                      kv_cross=job["kv_cross"])[1])


def dismiss(ranks: Ranks) -> None:
    """Rank 0: release the ranks waiting in `follow` (once; not after a failed pass, where they are inside
    another collective and fail on their own when rank 0 exits)."""
    if ranks.distributed and ranks.is_root and not ranks._dismissed and not ranks._broken:
        ranks._dismissed = True
        ranks.broadcast(None, "dismissing the other ranks")
