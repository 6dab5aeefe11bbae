"""A measurement's result file that a rerun continues: what it stored is taken up again only when it was made under
the same settings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def stored_part(out: Path | None, identity: Mapping, part: str = "records") -> dict:
    """``part`` of the result stored in ``out`` when every key of ``identity`` has the same value there (a run of the
    same settings); else (no file, other settings) an empty dict."""
    if out is None or not out.exists():
        return {}
    stored = json.loads(out.read_text())
    if all(stored.get(key) == value for key, value in identity.items()):
        return stored.get(part, {})
    return {}
