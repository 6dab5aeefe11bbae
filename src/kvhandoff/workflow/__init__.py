"""The fit-or-reuse steps shared by the CLI commands: statistics and mappers for a named pair, cached on disk.

Calibration statistics are the expensive part (a forward pass of both models over the corpus); they are
kept, so a mapper for any k or λ is a solve away. A pass asked for both directions (`both_directions`) sums the
target's Gram too, so the reverse direction's fit reuses it instead of running a pass of its own. Cache
entries are keyed by both models' identities (`geometry.model_fingerprint`: the pairing keys, tokenizer hash
included, and the weights checksum) and the settings, so a changed model under the same folder name never reuses
old statistics. A cached mapper is reused only when its manifest matches the fit config; otherwise it is refitted
and saved (atomically). Why a cache entry is not used is logged (`logging`, each module's logger).

Its modules: `named_pair` (the pair, its names and identities, and its cache folders), `calibration_passes`
(obtaining the statistics), `pair_mappers` (obtaining, fitting and describing mappers) and `measured` (what was
measured for the embedded pair's default mappers). The names docs/API.md documents are importable from here.
"""

from kvhandoff.workflow.calibration_passes import obtain_statistics
from kvhandoff.workflow.measured import MEASURED_RECORDS_FILE, MeasuredRecord, measured_record, measured_records
from kvhandoff.workflow.named_pair import NamedPair, load_named_pair, mapper_dir
from kvhandoff.workflow.pair_mappers import (
    describe_fit,
    fit_on_texts,
    load_pair_mapper,
    obtain_mapper,
    refine_saved_mapper,
)

__all__ = [
    "MEASURED_RECORDS_FILE",
    "MeasuredRecord",
    "NamedPair",
    "describe_fit",
    "fit_on_texts",
    "load_named_pair",
    "load_pair_mapper",
    "mapper_dir",
    "measured_record",
    "measured_records",
    "obtain_mapper",
    "obtain_statistics",
    "refine_saved_mapper",
]
