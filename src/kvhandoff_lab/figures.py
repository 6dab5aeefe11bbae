"""Figures the lab draws, written atomically."""

from __future__ import annotations

from pathlib import Path

from kvhandoff.files import atomic_path


def save_figure(figure, path: str | Path, **savefig_options) -> Path:
    """Write a matplotlib figure atomically (format from the file suffix) and close it."""
    path = Path(path)
    import matplotlib.pyplot as plt  # only callers that draw pay for matplotlib

    try:
        with atomic_path(path) as tmp:
            figure.savefig(tmp, format=path.suffix.lstrip(".") or "png", **savefig_options)
    finally:
        plt.close(figure)
    return path
