"""One error hierarchy: every failure kvhandoff raises on purpose is a KVHandoffError."""


class KVHandoffError(Exception):
    """Base class of every error kvhandoff raises deliberately."""


class ConfigError(KVHandoffError, ValueError):
    """A setting or argument is out of range; ``field``: the setting's name, where the raiser knows it (e.g. for
    a request field an edge reports the refusal against)."""

    def __init__(self, *args, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class UnsupportedModelError(KVHandoffError):
    """The model's architecture or attention layout cannot be mapped (named in the message)."""


class IncompatiblePairError(KVHandoffError):
    """Source and target cannot be paired (e.g. different tokenizers)."""


class MapperFormatError(KVHandoffError):
    """A saved mapper is missing, truncated, edited or of an unknown format version."""


class MapperMismatchError(KVHandoffError):
    """A mapper was loaded or applied with models it was not fitted for."""


class StatisticsError(KVHandoffError):
    """Calibration statistics are empty or cannot be merged."""


class AssetError(KVHandoffError):
    """A model or data asset is missing, corrupt or half-written; the message names the command that fixes it."""


class ContextTooLongError(ConfigError):
    """A context is longer than a model's max_position_embeddings (refused before any work)."""


class NonFiniteError(KVHandoffError, ValueError):
    """A cache or a mapper holds NaN/Inf (the layer is named)."""


class DistributedError(KVHandoffError):
    """A distributed calibration run failed: a rank died, stopped answering, or runs other models (the rank
    and the step are named)."""
