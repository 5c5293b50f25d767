"""CurateConfig: what ``dattri-ds curate`` does (method, budget, diversity), one frozen record;
the flags of ``tools/curate.py`` are generated from its fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dattri_ds.io import schema

from dattri_ds.errors import ConfigError

__all__ = ["CurateConfig", "AGGREGATES", "PRECONDITIONS"]

AGGREGATES = ("mean", "max")
PRECONDITIONS = ("none", "adam")


@dataclass(frozen=True, kw_only=True)
class CurateConfig:
    """One offline curation: score the pool, rank, keep a budget under diversity caps.

    Raises:
        ConfigError: no budget or more than one, a value out of range, an unknown method.
    """

    method: str = "content"
    """A registered curation method (``METHODS``): cosine, adam-cosine, trajectory, content,
    combined. The default, content (the DSIR-style content prior), is what the curation
    benchmark supports (docs/curation.md, "Measured effect"). It needs --target documents;
    with only a --target-store choose a gradient method (--method cosine)."""

    fraction: float | None = field(default=None, metadata=schema.bounds(gt=0, le=1))
    """Budget: this share of the pool's rows, in (0, 1] (round(fraction * N), at least 1)."""

    examples: int | None = field(default=None, metadata=schema.bounds(ge=1))
    """Budget: exactly this many examples (1 <= examples <= pool rows)."""

    tokens: int | None = field(default=None, metadata=schema.bounds(ge=1))
    """Budget: at most this many loss-bearing tokens (the store's per-row token counts),
    filled greedily in rank order until no unselected example fits the remainder."""

    aggregate: str = "mean"
    """How per-target cosines become one score: ``mean`` over target rows, or ``max`` (LESS
    with several target tasks)."""

    precondition: str = "none"
    """``trajectory`` and ``combined``: ``adam`` preconditions each checkpoint's target by
    its Adam second moments (LESS); ``adam-cosine`` always does."""

    combine_with: str = "cosine"
    """``combined``: the gradient method whose z-score is added to the content prior's."""

    content_weight: float = field(default=1.0, metadata=schema.bounds(ge=0))
    """``combined``: ``z(gradient score) + content_weight * z(content prior)``."""

    max_source_share: float | None = field(default=None, metadata=schema.bounds(gt=0, le=1))
    """Diversity: a source holds at most this share of the budget (examples, or tokens for
    a token budget), in (0, 1]; None: no cap."""

    max_per_cluster: int | None = field(default=None, metadata=schema.bounds(ge=1))
    """Diversity: at most this many examples per near-duplicate cluster (hashed n-gram
    MinHash signature); None: no cap."""

    dedupe: bool = True
    """Keep one example per content hash (the sample id's ``#<hash>``), the best ranked."""

    block_rows: int = field(default=1024, metadata=schema.bounds(ge=1))
    """Rows read from the store at a time (memory: one block per checkpoint)."""

    seed: int = field(default=0, metadata=schema.bounds(ge=0, le=2**32 - 1))
    """Seed of the tie-breaking order (rows with equal scores) and of the report's random
    baseline."""

    def __post_init__(self) -> None:
        from dattri_ds.selection.curate.methods import get_method

        schema.check(self, "curate")  # types and the declared bounds
        get_method(self.method)
        given = [n for n in ("fraction", "examples", "tokens") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ConfigError(f"curate needs exactly one budget of --fraction, --examples and "
                              f"--tokens; got {given or 'none'}")
        if self.aggregate not in AGGREGATES:
            raise ConfigError(f"--aggregate {self.aggregate!r}: choose one of {AGGREGATES}")
        if self.precondition not in PRECONDITIONS:
            raise ConfigError(f"--precondition {self.precondition!r}: choose one of "
                              f"{PRECONDITIONS}")
        inner = get_method(self.combine_with)
        if not inner.gradient or inner.name == "combined":
            raise ConfigError(f"--combine-with {self.combine_with!r} must be a gradient method "
                              f"(cosine, adam-cosine, trajectory)")

    @classmethod
    def from_dict(cls, d: dict) -> CurateConfig:
        """A config from a dict; unknown keys are refused (named)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"CurateConfig: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)
