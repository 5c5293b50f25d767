"""Registry: the one name -> strategy table every extension point of dattri-ds uses.

Layer kinds, curvature factor forms, projection kinds, attribution methods and the selection
stages each keep one ``Registry``; a subclass registers itself from ``__init_subclass__``::

    KINDS = Registry("projection kind", hint="register one with class X(ProjectionKind, name='x')")
    KINDS.register("sparse", SparseKind())
    KINDS.lookup("sparse")      # the entry
    KINDS.lookup("spares")      # ConfigError: projection kind 'spares' is not registered; ...

A failed lookup raises ``error`` (``ConfigError`` unless the registry says otherwise) naming
what was looked up, the offending value and every registered name. Later registrations win,
so a user's class overrides a built-in one of the same name.
"""

from __future__ import annotations

from typing import TypeVar

from dattri_ds.errors import ConfigError, DattriDSError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(dict[str, T]):
    """A named table of strategies (a dict in registration order) with one lookup and one
    error message.

    Args:
        what: what an entry is, for messages ("layer kind", "attribution method").
        error: the DattriDSError subclass a failed lookup raises (default ConfigError).
        hint: the fix appended to the message (e.g. how to register a new entry).
    """

    def __init__(self, what: str, *, error: type[DattriDSError] = ConfigError,
                 hint: str = "") -> None:
        super().__init__()
        self.what = what
        self.error = error
        self.hint = hint

    def register(self, name: str, entry: T) -> T:
        """Add (or replace) ``name``; returns ``entry`` so it can be used as an expression."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.what} name must be a non-empty string, got {name!r}")
        self[name] = entry
        return entry

    def register_class(self, cls: type, name: str | None, *, instance: bool = False) -> None:
        """A strategy class's ``__init_subclass__`` hook: ``class X(Base, name="x")`` sets
        ``X.name`` and registers ``X`` (or one ``X()`` when ``instance``); ``name=None``
        (an abstract intermediate class) registers nothing."""
        if name is not None:
            cls.name = name
            self.register(name, cls() if instance else cls)

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its entry (e.g. a test's own kind, at teardown).

        Raises:
            ``self.error``: ``name`` is not registered.
        """
        entry = self.lookup(name)
        del self[name]
        return entry

    #: ``lookup(name)``: the entry called ``name``; ``self.error`` naming the value and the
    #: known names (``__missing__``). The dict's own lookup: no Python call on a hit.
    lookup = dict.__getitem__

    def __missing__(self, name: str) -> T:
        hint = f" ({self.hint})" if self.hint else ""
        raise self.error(f"{self.what} '{name}' is not registered; registered: "
                         f"{self.names()}{hint}")

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self)

    def as_dict(self) -> dict[str, T]:
        """A copy of the table (name -> entry)."""
        return dict(self)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.names()})"
