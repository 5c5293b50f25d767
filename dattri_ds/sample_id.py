"""The id of one captured example: ``[<document>[@<step>[+<repeat>]]#]<digest>``, parsed and
formatted once.

A row's id is the 16-hex-digit content hash of its tokens and loss mask (``digest``,
``semantics.content_id``), prefixed by the id the loop gave it when it gave one: the
document id of the data file, and, for the examples the loop trained on, the step at which
it trained them (``<document>@<step>``). A document that one step holds more than once (the
step's slots run past the end of an epoch into the next) is tagged ``+1``, ``+2``, ... from
its second slot on, in stream order, so that every trained occurrence has its own id
(docs/multinode.md). Every reader of ids (reports, offline
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
        repeat: how many earlier slots of that step held the same document (0: the first).
    """

    digest: str
    document: str | None = None
    step: int | None = None
    repeat: int = 0

    @classmethod
    def parse(cls, text: str) -> SampleId:
        """``"doc@12#ab12"`` -> ``SampleId("ab12", "doc", 12)``; ``"doc@12+1#ab12"`` -> repeat
        1; ``"doc#ab12"`` -> no step; ``"ab12"`` -> digest only. ``@`` followed by anything
        but ``<number>`` or ``<number>+<number>`` belongs to the document id."""
        user, sep, digest = text.rpartition("#")
        return cls(digest) if not sep else cls.of(user, digest)

    @classmethod
    def of(cls, user: str | None, digest: str) -> SampleId:
        """The id of content ``digest`` under the loop's id ``user`` (``doc``, ``doc@step`` or
        ``doc@step+repeat``)."""
        if user is None:
            return cls(digest)
        doc, at, tail = user.rpartition("@")
        step, plus, repeat = tail.partition("+")
        if at and step.isdigit() and (not plus or repeat.isdigit()):
            return cls(digest, doc, int(step), int(repeat or 0))
        return cls(digest, user)

    @property
    def doc(self) -> str:
        """The document id to look the example up by (the digest when the loop gave none)."""
        return self.digest if self.document is None else self.document

    @staticmethod
    def user_id(document: str, step: int | None = None, repeat: int = 0) -> str:
        """The loop's id of an example (what ``GradientCapture.tag`` takes): ``document``,
        ``document@step`` for one trained at ``step``, ``document@step+repeat`` for a
        repeat of it in that step."""
        if step is None:
            return document
        return f"{document}@{step}" + (f"+{repeat}" if repeat else "")

    def __str__(self) -> str:
        if self.document is None:
            return self.digest
        return f"{self.user_id(self.document, self.step, self.repeat)}#{self.digest}"
