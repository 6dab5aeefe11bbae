"""Progress bars are the caller's choice: a library loop reports through the `Progress` it is given.

A `Progress` is called as tqdm's class is, ``progress(iterable=None, total=None, desc=None, unit="it", ...)``, and
returns a bar that iterates ``iterable``, takes ``update(n)``, ``set_postfix(...)`` and ``close()`` and works as a
context manager; tqdm's class is one. Library functions take ``progress`` as such a callable or as a flag, and draw
nothing unless asked (`SilentBar`); the command lines ask for tqdm's bars (``progress=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: a tqdm-like bar factory (see the module docstring)
Progress = Callable[..., Any]


class SilentBar:
    """The bar that draws nothing: it iterates what it wraps and ignores every report."""

    def __init__(self, iterable: Iterable | None = None, **_options: Any) -> None:
        self._iterable = () if iterable is None else iterable

    def __iter__(self) -> Iterator:
        return iter(self._iterable)

    def __enter__(self) -> SilentBar:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        return None

    def set_postfix(self, *_args: Any, **_values: Any) -> None:
        return None

    def close(self) -> None:
        return None


def as_progress(progress: Progress | bool | None) -> Progress:
    """``progress`` as a bar factory: a callable as it is, True → tqdm's bars, False or None → `SilentBar`."""
    if progress is True:
        from tqdm.auto import tqdm  # imported only where bars are asked for

        return tqdm
    if progress is False or progress is None:
        return SilentBar
    return progress
