"""kvhandoff: cross-model KV-cache transfer with a closed-form linear mapper."""

from kvhandoff import compact, mlp  # noqa: F401 - register the "blocks", "lowrank", "mlp" methods with `Mapper.load`
from kvhandoff.cache import prefill
from kvhandoff.config import FitConfig
from kvhandoff.errors import KVHandoffError
from kvhandoff.fit import fit_mapper
from kvhandoff.handoff import catch_up, handoff_cache, handoff_generate
from kvhandoff.mapper import Mapper
from kvhandoff.session import SwitchingSession

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
