"""The id of one captured example: ``[<document>[@<step>]#]<digest>``, parsed and formatted once.

A row's id is the 16-hex-digit content hash of its tokens and loss mask (``digest``,
``semantics.content_id``), prefixed by the id the loop gave it when it gave one: the
document id of the data file, and, for the examples online selection trained on, the step
at which it trained them (``<document>@<step>``). Every reader of ids (reports, offline
curation, the LDS command, selection logs) goes through :class:`SampleId` instead of
splitting strings at ``#`` and ``@`` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SampleId"]


@dataclass(frozen=True)
class SampleId:
    """One example's id.

    Attributes:
        digest: the content hash (or, for an id without ``#``, the whole id).
        document: the loop's id of the example (the data file's document id), or None.
        step: the training step a selected example was trained at, or None.
    """

    digest: str
    document: str | None = None
    step: int | None = None

    @classmethod
    def parse(cls, text: str) -> SampleId:
        """``"doc@12#ab12"`` -> ``SampleId("ab12", "doc", 12)``; ``"doc#ab12"`` -> no step;
        ``"ab12"`` -> digest only. ``@`` followed by a non-number belongs to the document id."""
        user, sep, digest = text.rpartition("#")
        return cls(digest) if not sep else cls.of(user, digest)

    @classmethod
    def of(cls, user: str | None, digest: str) -> SampleId:
        """The id of content ``digest`` under the loop's id ``user`` (``doc`` or ``doc@step``)."""
        if user is None:
            return cls(digest)
        doc, at, step = user.rpartition("@")
        if at and step.isdigit():
            return cls(digest, doc, int(step))
        return cls(digest, user)

    @property
    def doc(self) -> str:
        """The document id to look the example up by (the digest when the loop gave none)."""
        return self.digest if self.document is None else self.document

    @staticmethod
    def user_id(document: str, step: int | None = None) -> str:
        """The loop's id of an example (what ``GradientCapture.tag`` takes): ``document``,
        or ``document@step`` for one trained at ``step``."""
        return document if step is None else f"{document}@{step}"

    def __str__(self) -> str:
        if self.document is None:
            return self.digest
        return f"{self.user_id(self.document, self.step)}#{self.digest}"
