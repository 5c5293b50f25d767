"""One error hierarchy for dattri-ds: every error we raise derives from DattriDSError."""

from __future__ import annotations

__all__ = ["DattriDSError", "ConfigError", "UsageError", "InputFileError",
           "UnsupportedLayerError", "ShapeError", "StoreMismatchError", "CaptureError",
           "StoreCorruptError", "DuplicateSampleError", "FactorFileError", "FactorStateError",
           "ClosedError", "StreamStateError", "StreamItemError", "UnsupportedEngineError",
           "CheckpointMismatchError", "OutputError", "WriteError", "DoesNotFitError",
           "CREATED_FOLDERS"]

#: Output folders the output door (``io.outputs.check_dir``) created in this process, in
#: order: a refused command (``cli.exits.run``) removes the ones still empty, so that a
#: refusal leaves nothing behind.
CREATED_FOLDERS: list = []


class DattriDSError(Exception):
    """Base class of all dattri-ds errors."""


class ConfigError(DattriDSError, ValueError):
    """A configuration value is invalid, unknown or inconsistent."""


class InputFileError(ConfigError):
    """An input file or folder is missing, unreadable or malformed (path, line and fix named)."""


class UsageError(ConfigError):
    """A command line is malformed (unknown flag, missing argument, bad flag value)."""


class UnsupportedLayerError(DattriDSError, TypeError):
    """A trainable module has no registered LayerKind (or an op is not defined for it)."""


class ShapeError(DattriDSError, ValueError):
    """A tensor does not have the shape an invariant requires."""


class StoreMismatchError(DattriDSError):
    """A gradient store was written with a configuration that differs from the requested one."""


class CaptureError(DattriDSError, RuntimeError):
    """Gradient capture was misused or observed an inconsistent forward/backward."""


class StoreCorruptError(DattriDSError, OSError):
    """A shard file is truncated, fails its checksum or has an unreadable index (path named)."""


class DuplicateSampleError(DattriDSError, ValueError):
    """The same sample id is stored more than once across the shards of a store."""


class FactorFileError(DattriDSError, ValueError):
    """A K-FAC/EK-FAC factor file is not one, or its factors disagree with what they are
    combined with (another projection, another layer layout)."""


class FactorStateError(DattriDSError, RuntimeError):
    """K-FAC/EK-FAC factors were used out of order: a phase skipped (precondition before
    eigendecompose), repeated (reduce twice) or mixed (merging parts of different phases)."""


class ClosedError(DattriDSError, ValueError):
    """A gradient store or spill was read after ``close()``: its maps or files are gone."""


class StreamStateError(DattriDSError, RuntimeError):
    """A one-shot gradient stream was consumed out of order (a second pass before the first
    one finished)."""


class StreamItemError(DattriDSError, TypeError):
    """An item of a gradient stream is not a ``GradBatch``."""


class UnsupportedEngineError(DattriDSError, TypeError):
    """No engine adapter handles the object passed as the training engine."""


class CheckpointMismatchError(DattriDSError, RuntimeError):
    """A checkpoint read back differs from the model state it was written from."""


class OutputError(ConfigError):
    """An output path cannot be written: a file where a folder is expected, not creatable, or
    it would overwrite an earlier result without ``--force`` (checked at start)."""


class WriteError(DattriDSError, OSError):
    """A write failed halfway (disk full, quota, permission): names the path, the bytes
    needed and what stays committed."""


class DoesNotFitError(ConfigError):
    """The planner predicts the requested run needs more memory than this machine has."""
