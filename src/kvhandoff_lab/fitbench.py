"""The fit's cost next to the models' own forwards: wall time and memory of a calibration pass and its solve.

In one process, over the same calibration windows and interleaved window by window (forward-only first on even
windows, the fit step first on odd ones, so that both share the machine's noise):

- forward-only: each model's decoder body over the window (`capture.run_body`: no LM head, no cache), the forward
  the fit's capture runs, without its hooks;
- the fit step: the same forwards with both models' content K/V captured (`fit.capture_batch`, "capture"), then the
  kept rows flattened to float64 and added to the sums (`CalibrationStats.update`, "sums").

Then, once, the solve (`fit.mapper_from_statistics`: layer selection and the ridge maps). A fit's statistics pass
is its steps, so `pass_ratio` = Σ fit steps ÷ Σ forward-only and `fit_ratio` = (Σ fit steps + solve) ÷ Σ
forward-only over the windows measured; `projected_fit_ratio` is the same for `project_windows` windows (the default
calibration's) from the means per window and the one solve, which does not grow with the windows.

Memory (Linux, /proc/self/status): the peak resident set (VmHWM, reset between the phases by writing 5 to
/proc/self/clear_refs) above the resident set once both models have run a warm-up window (their weights read): of a
forward-only window (what the forwards take themselves), of the statistics pass and of the solve (the sums still
held); the fit's peak is the larger of the last two. Resident memory counts every allocation (torch's tensors, BLAS
scratch, Python) but also file-backed pages: `file_backed_bytes` before and after says whether the kernel dropped
pages of memory-mapped weights meanwhile (which would make the peaks look smaller than they are). Beside them: the
bytes of the sums themselves and the shapes' estimate (`fit.estimate_memory`). The models run where they were loaded;
timings are only meaningful on the CPU (GPU kernels run asynchronously).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvhandoff.config import CalibrationSpec, FitConfig
from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.fit.pipeline import capture_batch, empty_statistics, estimate_memory, mapper_from_statistics
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.model.capture import run_body
from kvhandoff.progress import Progress, as_progress

FIT_BENCH_FORMAT = 1
#: the fields read from /proc/self/status (kB there, bytes here)
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def parse_status(text: str) -> dict[str, int]:
    """{field: bytes} of the memory fields of a /proc/<pid>/status text."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in _STATUS_FIELDS:
            values[name] = int(rest.split()[0]) * 1024
    return values


def read_memory() -> dict[str, int]:
    """This process's resident set now (VmRSS), its peak (VmHWM), and the anonymous and file-backed parts."""
    try:
        values = parse_status(Path("/proc/self/status").read_text())
    except OSError as exc:
        raise ConfigError(f"the fit bench reads memory from /proc/self/status (Linux): {exc}") from exc
    missing = [name for name in _STATUS_FIELDS if name not in values]
    if missing:
        raise ConfigError(f"/proc/self/status has no {', '.join(missing)}: the fit bench needs Linux 4.5 or later")
    return values


def reset_peak() -> bool:
    """Set the peak resident set (VmHWM) to the current one; False when the kernel does not allow it (the peaks
    read afterwards then include the earlier phases')."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_above(baseline: dict[str, int]) -> int:
    """The peak resident set since the last reset, above `baseline`'s resident set (0 when memory freed since the
    baseline was taken kept it below)."""
    return max(0, read_memory()["VmHWM"] - baseline["VmRSS"])


def time_forward_only(source_model, target_model, window: torch.Tensor) -> float:
    started = time.perf_counter()
    run_body(source_model, window)
    run_body(target_model, window)
    return time.perf_counter() - started


def time_fit_step(stats: CalibrationStats, source_model, target_model, window: torch.Tensor,
                  config: FitConfig) -> tuple[float, float]:
    """(capture seconds, sums seconds) of one window added to `stats`, as a fit's pass adds it."""
    started = time.perf_counter()
    source, target, _ = capture_batch(source_model, target_model, window)
    captured = time.perf_counter()
    stats.update(source, target, token_stride=config.token_stride, skip_first_tokens=config.skip_first_tokens)
    return captured - started, time.perf_counter() - captured


def measure_window(index: int, window: torch.Tensor, source_model, target_model, stats: CalibrationStats,
                   config: FitConfig) -> dict:
    """One window's forward-only and fit step, in the order of its parity (`index`)."""
    if index % 2 == 0:
        forward = time_forward_only(source_model, target_model, window)
        capture, sums = time_fit_step(stats, source_model, target_model, window, config)
    else:
        capture, sums = time_fit_step(stats, source_model, target_model, window, config)
        forward = time_forward_only(source_model, target_model, window)
    return {"window": index, "forward_only_s": forward, "capture_s": capture, "sums_s": sums,
            "fit_step_s": capture + sums}


def summarize_cost(rows: list[dict], solve_seconds: float, project_windows: int) -> dict:
    """Totals and ratios of the windows measured (`rows`) and the solve (module docstring)."""
    forward = sum(row["forward_only_s"] for row in rows)
    capture, sums = sum(row["capture_s"] for row in rows), sum(row["sums_s"] for row in rows)
    statistics_pass = capture + sums
    mean_forward = forward / len(rows)
    return {
        "windows": len(rows),
        "forward_only_s": forward,
        "statistics_pass_s": statistics_pass,
        "capture_s": capture,
        "sums_s": sums,
        "solve_s": solve_seconds,
        "pass_ratio": statistics_pass / forward,
        "capture_ratio": capture / forward,
        "fit_ratio": (statistics_pass + solve_seconds) / forward,
        "project_windows": project_windows,
        "projected_fit_ratio": statistics_pass / forward + solve_seconds / (mean_forward * project_windows),
    }


def measure_fit_cost(source_model, target_model, windows: Sequence[torch.Tensor],
                     config: FitConfig = FitConfig(),  # noqa: B008 - frozen
                     target_gram: bool = False, project_windows: int = CalibrationSpec().num_sequences,
                     progress: Progress | bool = False) -> dict:
    """The fit's wall time and peak memory against forward-only passes over `windows` ([batch, tokens] token id
    batches), measured in this process (module docstring). target_gram: the pass sums the target's Gram too (a
    pass for both directions). progress: a bar over the windows (`kvhandoff.progress`)."""
    if not windows:
        raise ConfigError("the fit bench needs at least one calibration window")
    time_forward_only(source_model, target_model, windows[0])  # warm-up: weights read, hooks and kernels ready
    capture_batch(source_model, target_model, windows[0])
    baseline = read_memory()
    resettable = reset_peak()
    time_forward_only(source_model, target_model, windows[0])
    forward_peak = peak_above(baseline)
    stats = empty_statistics(source_model, target_model, target_gram=target_gram, kv_cross=config.joint_inputs)
    reset_peak()
    rows = [measure_window(i, window, source_model, target_model, stats, config)
            for i, window in enumerate(as_progress(progress)(windows, desc="fit bench", unit="window"))]
    pass_peak = peak_above(baseline)
    reset_peak()
    started = time.perf_counter()
    mapper = mapper_from_statistics(stats, config, {}, {})
    solve_seconds = time.perf_counter() - started
    solve_peak = peak_above(baseline)
    after = read_memory()
    estimate = estimate_memory(stats.source, stats.target, config, target_gram=target_gram)
    memory = {
        "baseline_rss_bytes": baseline["VmRSS"],
        "forward_peak_bytes": forward_peak,
        "pass_peak_bytes": pass_peak,
        "solve_peak_bytes": solve_peak,
        "fit_peak_bytes": max(pass_peak, solve_peak),
        "peak_reset": resettable,
        "file_backed_bytes": {"before": baseline["RssFile"], "after": after["RssFile"]},
        "statistics_bytes": sum(t.numel() * t.element_size() for t in stats.sums()),
        "mapper_bytes": mapper.nbytes(),
        "estimate": estimate.to_dict(),
    }
    return {
        "format": FIT_BENCH_FORMAT,
        "settings": {"config": config.to_dict(), "target_gram": target_gram, "tokens_per_window":
                     int(windows[0].numel()), "statistics_rows": stats.count, **machine()},
        "summary": summarize_cost(rows, solve_seconds, project_windows),
        "memory": memory,
        "windows": rows,
    }


def machine() -> dict:
    return {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine()}


def describe_fit_cost(result: dict) -> list[str]:
    """The result in a few lines for the console."""
    summary, memory = result["summary"], result["memory"]
    gib = 2**30
    lines = [
        f"{summary['windows']} windows of {result['settings']['tokens_per_window']} tokens, "
        f"{result['settings']['torch_threads']} threads: forward-only {summary['forward_only_s']:.1f} s, "
        f"statistics pass {summary['statistics_pass_s']:.1f} s (capture {summary['capture_s']:.1f} s, sums "
        f"{summary['sums_s']:.1f} s), solve {summary['solve_s']:.1f} s",
        f"time ÷ forward-only: pass {summary['pass_ratio']:.3f}×, pass + solve {summary['fit_ratio']:.3f}×, "
        f"projected to {summary['project_windows']} windows {summary['projected_fit_ratio']:.3f}×",
        f"peak memory above the loaded models: forward-only {memory['forward_peak_bytes'] / gib:.2f} GiB, pass "
        f"{memory['pass_peak_bytes'] / gib:.2f} GiB, solve {memory['solve_peak_bytes'] / gib:.2f} GiB (sums "
        f"{memory['statistics_bytes'] / gib:.2f} GiB; estimate {memory['estimate']['peak_bytes'] / gib:.2f} GiB)",
    ]
    before, after = memory["file_backed_bytes"]["before"], memory["file_backed_bytes"]["after"]
    if after < before:
        lines.append(f"note: {(before - after) / gib:.2f} GiB of file-backed pages (memory-mapped weights) were "
                     "dropped during the run: the peaks may read low")
    if not memory["peak_reset"]:
        lines.append("note: the peak could not be reset between phases (/proc/self/clear_refs): each peak includes "
                     "the earlier phases'")
    return lines


def run_fit_bench(source_model, target_model, windows: Sequence[torch.Tensor], out_dir: str | Path,
                  config: FitConfig = FitConfig(),  # noqa: B008 - frozen
                  target_gram: bool = False, description: dict | None = None,
                  progress: Progress | bool = False) -> dict:
    """`measure_fit_cost`, written to OUT/bench-fit.json with `description` (the models, the windows)."""
    result = {**measure_fit_cost(source_model, target_model, windows, config, target_gram, progress=progress),
              "description": description or {}}
    atomic_write_json(Path(out_dir) / "bench-fit.json", result)
    return result
