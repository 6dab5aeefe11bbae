"""Run one `kvhandoff` command in this process and record its wall time and peak resident memory.

Usage: python experiments/fit_process_record.py RECORD_DIR kvhandoff-args...
Under torchrun every rank writes RECORD_DIR/rank{RANK}.json: {rank, world_size, wall_s, peak_rss_bytes,
exit_code, threads, argv}. Peak RSS is the process's own high-water mark (getrusage RUSAGE_SELF), so the ranks of
one torchrun are measured each on its own (a `/usr/bin/time` around torchrun reports only the largest child).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    record_dir, args = Path(sys.argv[1]), sys.argv[2:]
    started = time.perf_counter()
    code: int | str | None = 0
    from kvhandoff.cli import main as kvhandoff

    sys.argv = ["kvhandoff", *args]
    try:
        kvhandoff()
    except SystemExit as exit_:
        code = exit_.code
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kilobytes
        "exit_code": code or 0,
        "threads": torch.get_num_threads(),
        "argv": args,
    }
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
