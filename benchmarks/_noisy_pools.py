"""Noisy candidate pools: in-domain-looking text that teaches nothing or the wrong thing.

A noisy target ``noisy:<target>:<kinds>`` is the shipped (or carved) target ``<target>``
whose candidate pool also holds *junk*: documents built deterministically (seeded by the
target, the kind and ``seed``) from the target's own non-evaluation text, so that they look
like the target to a bag-of-n-grams prior while teaching nothing or the wrong thing.

Kinds (``KINDS``; ``<kinds>`` is a comma list, or ``tune`` / ``heldout`` / ``all``):

* ``dup``       near-duplicates: three passages repeated with one or two tiny edits each
                (adjacent words swapped, a word doubled, a letter's case flipped).
* ``boiler``    licence / header boilerplate in the target's style (a licence comment for
                code, an e-book header for prose, a withheld-answer line for QA), its
                names and numbers varied.
* ``shuffle``   a passage with its words shuffled within each line (same unigrams).
* ``charnoise`` machine-garbled characters: each character replaced, deleted or doubled
                with probability 0.15.
* ``wordswap``  token-level corruption: each word replaced with probability 0.3 by a random
                word of the target's vocabulary.
* ``wronganswer`` (QA targets) the question of one pair with another pair's answer.
* ``broken``    (code targets) code that does not parse: lines shuffled in a window,
                truncated mid-line (checked with ``ast.parse``).

``HELDOUT_KINDS`` are kept out of every tuning: the benchmark reports them separately and
no default may be chosen on them. The base text of every kind is the target's scoring
documents plus, for a shipped target, the rest of its first half (never the second half,
where the held-out evaluation documents are); those leftover first-half documents also
enter the pool as clean in-domain text (source ``<target>_clean``), so that a pool holds
useful and useless in-domain text side by side.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Sequence

from dattri_ds.data.corpus import Document

#: kinds no setting may be tuned on (reported separately)
HELDOUT_KINDS = ("charnoise", "boiler")
#: the kinds a noisy target of ``tune`` holds (those that apply to its style)
TUNING_KINDS = ("dup", "shuffle", "wordswap", "wronganswer", "broken")
#: style of a target's text: what ``boiler``, ``wronganswer`` and ``broken`` need
STYLE = {"hamlet": "prose", "trivia": "qa", "code": "code", "carve:python_code": "code"}
#: kinds that need one style
NEEDS_STYLE = {"wronganswer": "qa", "broken": "code"}
JUNK_PREFIX = "junk:"
PER_KIND = 120

_QA = re.compile(r"^Q: (?P<q>.*?) A: (?P<a>.*)$", re.S)


def style_of(target: str) -> str:
    return STYLE.get(target, "prose")


def parse_noisy(spec: str) -> tuple[str, tuple[str, ...]]:
    """``noisy:<target>:<kinds>`` -> (target, kinds). ``<target>`` may be ``carve:SRC``.

    Raises:
        SystemExit: not a noisy spec, an unknown kind, or a kind that needs another style.
    """
    if not spec.startswith("noisy:"):
        raise SystemExit(f"not a noisy target: '{spec}' (expected noisy:<target>:<kinds>)")
    target, _, kinds = spec[len("noisy:"):].rpartition(":")
    if not target:
        raise SystemExit(f"'{spec}': expected noisy:<target>:<kinds>, e.g. noisy:code:tune")
    style = style_of(target)
    groups = {"tune": TUNING_KINDS, "heldout": HELDOUT_KINDS, "all": TUNING_KINDS + HELDOUT_KINDS}
    if kinds in groups:
        return target, tuple(k for k in groups[kinds] if NEEDS_STYLE.get(k, style) == style)
    out = tuple(filter(None, kinds.split(",")))
    for k in out:
        if k not in KINDS:
            raise SystemExit(f"'{spec}': unknown junk kind '{k}'; known: {sorted(KINDS)} "
                             f"or tune/heldout/all")
        if NEEDS_STYLE.get(k, style) != style:
            raise SystemExit(f"'{spec}': kind '{k}' needs a {NEEDS_STYLE[k]} target, "
                             f"'{target}' is {style}")
    if not out:
        raise SystemExit(f"'{spec}': no junk kinds given")
    return target, out


def shipped_split(docs: Sequence[Document], target_docs: int, eval_docs: int
                  ) -> tuple[list[Document], list[Document], list[Document]]:
    """A shipped target file -> (scoring, leftover first half, evaluation): the first half
    scores (``target_docs`` of it), the second half evaluates (``eval_docs`` of it)."""
    half = len(docs) // 2
    return list(docs[:half][:target_docs]), list(docs[:half][target_docs:]), \
        list(docs[half:][:eval_docs])


# ---- the kinds ---------------------------------------------------------------------
def _edit(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    i = rng.randrange(max(1, len(words) - 1))
    op = rng.randrange(3)
    if op == 0 and len(words) > 1:
        words[i], words[i + 1] = words[i + 1], words[i]
    elif op == 1:
        words.insert(i, words[i])
    else:
        words[i] = words[i].swapcase()
    return " ".join(words)


def _dup(base, rng, n, style):
    passages = rng.sample(base, min(3, len(base)))
    out = []
    for j in range(n):
        text = passages[j % len(passages)].text
        for _ in range(rng.randint(1, 2)):
            text = _edit(text, rng)
        out.append((passages[j % len(passages)].id, text))
    return out


_BOILER = {
    "code": ("# Copyright (c) {year} {name} and contributors. All rights reserved.\n"
             "# Licensed under the Apache License, Version 2.0 (the \"License\");\n"
             "# you may not use this file except in compliance with the License.\n"
             "# You may obtain a copy of the License at http://www.apache.org/licenses/\n"
             "# Generated file {n}: do not edit. Module {name}.{word}\n"),
    "prose": ("The Project Gutenberg eBook of {name}, by {word}\n"
              "This eBook is for the use of anyone anywhere at no cost and with almost no "
              "restrictions whatsoever. Release date: {year} [eBook #{n}]\n"
              "*** START OF THE PROJECT GUTENBERG EBOOK {name} ***\n"),
    "qa": "Q: Question {n} of the {name} quiz ({year} edition). A: Answer withheld, see {word}.",
}


def _boiler(base, rng, n, style):
    names = sorted({w.strip(".,;:!?()'\"") for d in base for w in d.text.split()
                    if w[:1].isupper() and len(w) > 3})
    words = sorted({w for d in base for w in re.findall(r"[A-Za-z_]{4,}", d.text)})
    out = []
    for j in range(n):
        d = rng.choice(base)
        out.append((d.id, _BOILER[style].format(year=rng.randint(1990, 2024), n=rng.randint(1, 99999),
                                                name=rng.choice(names) if names else "Anon",
                                                word=rng.choice(words) if words else "x")))
    return out


def _shuffle(base, rng, n, style):
    out = []
    for j in range(n):
        d = base[j % len(base)]
        lines = []
        for line in d.text.split("\n"):
            w = line.split()
            rng.shuffle(w)
            lines.append(" ".join(w))
        out.append((d.id, "\n".join(lines)))
    return out


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _charnoise(base, rng, n, style, p: float = 0.15):
    out = []
    for j in range(n):
        d = base[j % len(base)]
        chars = []
        for c in d.text:
            r = rng.random()
            if r >= p:
                chars.append(c)
            elif r < p / 3:
                chars.append(rng.choice(_LETTERS))
            elif r < 2 * p / 3:
                chars.append(c + c)
        out.append((d.id, "".join(chars)))
    return out


def _wordswap(base, rng, n, style, p: float = 0.3):
    vocab = sorted({w for d in base for w in d.text.split()})
    out = []
    for j in range(n):
        d = base[j % len(base)]
        lines = [" ".join(rng.choice(vocab) if rng.random() < p else w for w in line.split(" "))
                 for line in d.text.split("\n")]
        out.append((d.id, "\n".join(lines)))
    return out


def _wronganswer(base, rng, n, style):
    pairs = [(d.id, m["q"], m["a"]) for d in base if (m := _QA.match(d.text))]
    if len(pairs) < 2:
        raise SystemExit("kind 'wronganswer' needs at least two 'Q: ... A: ...' documents")
    out = []
    while len(out) < n:
        perm = list(range(len(pairs)))
        rng.shuffle(perm)
        shift = perm[1:] + perm[:1]  # a derangement: every question gets another's answer
        for i, j in zip(perm, shift):
            if pairs[i][2] != pairs[j][2]:
                out.append((pairs[i][0], f"Q: {pairs[i][1]} A: {pairs[j][2]}"))
    return out[:n]


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def _broken(base, rng, n, style):
    out = []
    for j in range(n):
        d = base[j % len(base)]
        lines = d.text.split("\n")
        if len(lines) > 3:  # within the first lines: what a 64-token example holds
            a = rng.randrange(min(len(lines) - 2, 4))
            window = lines[a:a + 6]
            rng.shuffle(window)
            lines[a:a + 6] = window
        cut = rng.randrange(min(len(lines), 6))
        lines[cut] = lines[cut][: max(1, len(lines[cut]) // 2)]
        text = "\n".join(lines)
        if _parses(text):
            text = text + "\n    return (" if rng.random() < 0.5 else "def (:\n" + text
        out.append((d.id, text))
    return out


KINDS: dict[str, Callable] = {"dup": _dup, "boiler": _boiler, "shuffle": _shuffle,
                              "charnoise": _charnoise, "wordswap": _wordswap,
                              "wronganswer": _wronganswer, "broken": _broken}


def build_junk(target: str, kinds: Sequence[str], base: Sequence[Document],
               per_kind: int = PER_KIND, seed: int = 0) -> list[Document]:
    """``per_kind`` junk documents of every kind, built from ``base`` only.

    Args:
        target: the target's name (``trivia``, ``carve:austen``): its style and the seed.
        kinds: junk kinds (keys of ``KINDS``).
        base: the documents the junk is made of (never evaluation documents).
        per_kind: documents per kind.
        seed: the pool's seed (the same pool for every training seed of a benchmark).

    Returns:
        Documents with ids ``junk-<kind>-<n>``, source ``junk:<kind>`` and title
        ``from <base document id>``.
    """
    style, out = style_of(target), []
    base = sorted(base, key=lambda d: d.id)
    for kind in kinds:
        rng = random.Random(f"{target}|{kind}|{seed}")
        for i, (src, text) in enumerate(KINDS[kind](base, rng, per_kind, style)):
            out.append(Document(f"junk-{kind}-{i}", JUNK_PREFIX + kind, f"from {src}", text))
    return out


def clean_extra(target: str, extra: Sequence[Document]) -> list[Document]:
    """The leftover first-half documents as clean in-domain pool text (``<target>_clean``)."""
    return [Document(f"clean-{d.id}", f"{target}_clean", d.title, d.text) for d in extra]


def junk_shares(sources: dict[str, float]) -> dict[str, float]:
    """``{kind: share of trained examples}`` from a run's per-source shares."""
    return {s[len(JUNK_PREFIX):]: v for s, v in sources.items() if s.startswith(JUNK_PREFIX)}
