"""One error hierarchy for dattri-ds: every error we raise derives from DattriDSError."""

from __future__ import annotations

__all__ = [
    "DattriDSError",
    "ConfigError",
    "UsageError",
    "UnsupportedLayerError",
    "ShapeError",
    "StoreMismatchError",
    "CaptureError",
    "StoreCorruptError",
    "DuplicateSampleError",
    "registered",
]


class DattriDSError(Exception):
    """Base class of all dattri-ds errors."""


class ConfigError(DattriDSError, ValueError):
    """A configuration value is invalid, unknown or inconsistent."""


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


def registered(table, name, what: str):
    """``table[name]`` from a registry; otherwise a ConfigError naming ``what``, the value and
    every registered name (the one lookup every strategy registry shares)."""
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"{what} '{name}' is not registered; registered: "
                          f"{sorted(table)}") from None
