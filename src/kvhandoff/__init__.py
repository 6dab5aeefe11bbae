"""kvhandoff: cross-model KV-cache transfer with a closed-form linear mapper."""

from kvhandoff.config import FitConfig
from kvhandoff.errors import KVHandoffError
from kvhandoff.fit import compact, mlp  # noqa: F401 - register the "blocks", "lowrank", "mlp" methods with `Mapper.load`
from kvhandoff.fit.pipeline import fit_mapper
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import prefill
from kvhandoff.runtime.handoff import catch_up, handoff_cache, handoff_generate
from kvhandoff.runtime.session import SwitchingSession

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
