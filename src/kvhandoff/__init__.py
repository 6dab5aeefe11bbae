"""kvhandoff: cross-model KV-cache transfer with a closed-form linear mapper."""

from kvhandoff.config import FitConfig
from kvhandoff.errors import KVHandoffError
from kvhandoff.fit import fit_mapper
from kvhandoff.handoff import SwitchingSession, catch_up, handoff_cache, handoff_generate, prefill
from kvhandoff.mapper import Mapper

__all__ = [
    "FitConfig",
    "KVHandoffError",
    "Mapper",
    "SwitchingSession",
    "catch_up",
    "fit_mapper",
    "handoff_cache",
    "handoff_generate",
    "prefill",
]
__version__ = "0.1.0"
