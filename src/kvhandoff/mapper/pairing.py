"""Whether a mapper was fitted for the models it is given (`PairingCheck`): their fingerprints against the ones its
manifest records."""

from __future__ import annotations

import json
import weakref

from kvhandoff.errors import MapperMismatchError
from kvhandoff.mapper.manifest import MapperManifest
from kvhandoff.model.geometry import PAIRING_KEYS, model_fingerprint, signatures_match


class PairingCheck:
    """A mapper's check of its models against the fingerprints its manifest records, remembering the models it
    verified (weakly: a model let go is forgotten), so that the hot path fingerprints a model only once."""

    def __init__(self) -> None:
        self._verified: dict[str, weakref.WeakSet] = {"source": weakref.WeakSet(), "target": weakref.WeakSet()}

    def check_models(self, manifest: MapperManifest, source_model=None, target_model=None) -> None:
        """`verify` for these models, once per model: the hot path (`handoff_cache`, `catch_up`,
        `SwitchingSession`) calls it every time and fingerprints a model only the first time it sees it (a refused
        model is not remembered)."""
        for side, model in (("source", source_model), ("target", target_model)):
            if model is None or model in self._verified[side]:
                continue
            self.verify(manifest, **{f"{side}_model": model})
            self._verified[side].add(model)

    @staticmethod
    def verify(manifest: MapperManifest, source_model=None, target_model=None, source_tokenizer=None,
               target_tokenizer=None) -> None:
        """Raise MapperMismatchError unless the given models (and tokenizers) are the ones ``manifest`` records."""
        for side, model, tokenizer in (
            ("source", source_model, source_tokenizer),
            ("target", target_model, target_tokenizer),
        ):
            if model is None:
                continue
            expected = getattr(manifest, f"{side}_fingerprint")
            actual = model_fingerprint(model, tokenizer)
            key = differing_pairing_key(expected, actual)
            if key is not None:
                raise MapperMismatchError(
                    f"this mapper was fitted for a different {side} model ({key} differs: fitted "
                    f"{_short(expected.get(key))}, given {_short(actual[key])}); load the mapper fitted for "
                    f"this pair or fit one with `kvhandoff fit`"
                )


def differing_pairing_key(expected: dict, actual: dict) -> str | None:
    """The first `PAIRING_KEYS` entry where fingerprint ``actual`` differs from the fitted ``expected`` (None: the
    same model). A tokenizer hash missing on either side is not compared; weight signatures match loosely
    (`signatures_match`)."""
    for key in PAIRING_KEYS:
        if key == "tokenizer_hash" and (actual[key] is None or expected.get(key) is None):
            continue
        if key == "weight_signature":
            same = signatures_match(actual[key], expected.get(key) or [])
        else:
            same = actual[key] == expected.get(key)
        if not same:
            return key
    return None


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
