"""Run one `kvhandoff` command in this process and record its wall time and peak memory.

Usage: python experiments/fit_process_record.py RECORD_DIR kvhandoff-args...
Under torchrun every rank writes RECORD_DIR/rank{RANK}.json: {rank, world_size, wall_s, peak_rss_bytes,
peak_uss_bytes, peak_pss_bytes, exit_code, threads, argv}. Peak RSS is the process's own high-water mark
(getrusage RUSAGE_SELF), so the ranks of one torchrun are measured each on its own (a `/usr/bin/time` around
torchrun reports only the largest child). RSS counts the pages of memory-mapped weight files a process has read,
which several processes share; USS (memory of this process alone) and PSS (shared pages split between their
users) are sampled every 0.5 s from /proc (psutil), so their peaks may miss a spike shorter than that.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import psutil
import torch


def sample_memory(peaks: dict, stop: threading.Event, every_s: float = 0.5) -> None:
    """Keep the largest USS and PSS of this process in `peaks` until `stop` is set."""
    process = psutil.Process()
    while not stop.is_set():
        info = process.memory_full_info()
        peaks["uss"], peaks["pss"] = max(peaks["uss"], info.uss), max(peaks["pss"], info.pss)
        stop.wait(every_s)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    record_dir, args = Path(sys.argv[1]), sys.argv[2:]
    started = time.perf_counter()
    code: int | str | None = 0
    peaks, stop = {"uss": 0, "pss": 0}, threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(peaks, stop), daemon=True)
    sampler.start()
    from kvhandoff.cli import main as kvhandoff

    sys.argv = ["kvhandoff", *args]
    try:
        kvhandoff()
    except SystemExit as exit_:
        code = exit_.code
    stop.set()
    sampler.join()
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kilobytes
        "peak_uss_bytes": peaks["uss"],
        "peak_pss_bytes": peaks["pss"],
        "exit_code": code or 0,
        "threads": torch.get_num_threads(),
        "argv": args,
    }
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
