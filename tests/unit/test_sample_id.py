"""Sample ids: ``[<document>[@<step>]#]<digest>`` parsed and formatted by one type.

Invariants: ``str(SampleId.parse(s)) == s`` for every form the library writes; the
document id is what precedes ``#`` (without a trailing ``@<step>``), or the whole id when
it has no ``#``; ``content_id`` writes exactly these forms. Breaks if a reader splits at
the wrong ``#``/``@`` (a document id may itself hold ``#`` or ``@``).
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds.sample_id import SampleId
from dattri_ds.capture.semantics import content_id


@pytest.mark.parametrize("text, doc, step, digest", [
    ("0123abcd", "0123abcd", None, "0123abcd"),
    ("hamlet-3#0123abcd", "hamlet-3", None, "0123abcd"),
    ("hamlet-3@12#0123abcd", "hamlet-3", 12, "0123abcd"),
    ("a#b#0123abcd", "a#b", None, "0123abcd"),
    ("user@example.org#0123abcd", "user@example.org", None, "0123abcd"),
    ("x@y@7#0123abcd", "x@y", 7, "0123abcd"),
    ("x@y@7+2#0123abcd", "x@y", 7, "0123abcd"),
])
def test_parse_and_format_round_trip(text, doc, step, digest):
    sid = SampleId.parse(text)
    assert (sid.doc, sid.step, sid.digest) == (doc, step, digest)
    assert str(sid) == text


def test_content_id_writes_the_parsed_forms():
    """The capture's ids parse back to the loop's document id and step and the digest."""
    tokens = torch.tensor([5, 6, 7])
    bare = content_id(tokens)
    assert SampleId.parse(bare) == SampleId(bare)
    tagged = content_id(tokens, user_id="doc-9@40")
    assert SampleId.parse(tagged) == SampleId(bare, "doc-9", 40)
    assert tagged == f"doc-9@40#{bare}"


def test_user_id_is_the_part_before_the_digest():
    """``SampleId.user_id`` is what the loop tags captured examples with."""
    assert SampleId.user_id("doc") == "doc" and SampleId.user_id("doc", 3) == "doc@3"
    assert str(SampleId("ab", "doc", 3)) == SampleId.user_id("doc", 3) + "#ab"


def test_repeat_of_a_document_within_a_step():
    """The second slot of a document within one step is ``doc@step+1`` (docs/multinode.md);
    the first keeps the id it always had."""
    assert SampleId.user_id("doc", 3, 0) == "doc@3"
    assert SampleId.user_id("doc", 3, 2) == "doc@3+2"
    sid = SampleId.parse("hamlet-3@12+1#0123abcd")
    assert (sid.doc, sid.step, sid.repeat) == ("hamlet-3", 12, 1)
    assert str(sid) == "hamlet-3@12+1#0123abcd"
    assert SampleId.parse("v@1+x#0123abcd").doc == "v@1+x"  # not a repeat: the document's id
