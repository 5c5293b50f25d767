"""The selection benchmark's noisy pools (benchmarks/_noisy_pools.py) and compute curves.

Invariants: a noisy pool is the same on every call (paired seeds train on one pool); every
kind asked for is there with its count and source label; no junk is made of, or carries
text of, the target's held-out evaluation documents (else the benchmark would leak the
evaluation set into training); the kinds that claim a defect have it (wrong answers are
wrong, broken code does not parse). The compute helpers read curves as documented.
No training.
"""

from __future__ import annotations

import ast
import math
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
noisy = pytest.importorskip("benchmarks._noisy_pools")
compute = pytest.importorskip("benchmarks._compute")

from dattri_ds.data import load_documents  # noqa: E402


def _split(target: str):
    docs = load_documents(os.path.join(ROOT, "data", "target", f"{target}.jsonl"))
    return noisy.shipped_split(docs, 64, 64)


def _shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    w = text.split()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


@pytest.mark.parametrize("target", ["trivia", "code", "hamlet"])
def test_deterministic_kinds_present_no_eval_leak(target):
    """Same pool twice; every kind with PER_KIND docs; junk built only from non-eval docs
    and sharing no 6-word run with an evaluation document that the base text lacks."""
    score, extra, evald = _split(target)
    name, kinds = noisy.parse_noisy(f"noisy:{target}:all")
    a = noisy.build_junk(name, kinds, score + extra, 20)
    b = noisy.build_junk(name, kinds, score + extra, 20)
    assert [(d.id, d.text) for d in a] == [(d.id, d.text) for d in b]
    counts = {k: sum(d.source == noisy.JUNK_PREFIX + k for d in a) for k in kinds}
    assert counts == {k: 20 for k in kinds}
    assert set(noisy.HELDOUT_KINDS) <= set(kinds)
    eval_ids = {d.id for d in evald}
    assert not eval_ids & {d.id for d in score + extra}
    assert all(d.title.removeprefix("from ") not in eval_ids for d in a)
    base = set().union(*(_shingles(d.text) for d in score + extra))
    leak = set().union(*(_shingles(d.text) for d in evald)) - base
    assert not any(_shingles(d.text) & leak for d in a)
    assert len({d.id for d in a}) == len(a)


def test_kinds_have_their_defect():
    """wronganswer pairs a question with another question's answer; broken code does not
    parse; a kind of another style is refused; tune/heldout are disjoint."""
    score, extra, _ = _split("trivia")
    qa = {noisy._QA.match(d.text)["q"]: noisy._QA.match(d.text)["a"] for d in score + extra}
    wrong = noisy.build_junk("trivia", ("wronganswer",), score + extra, 50)
    for d in wrong:
        m = noisy._QA.match(d.text)
        assert qa[m["q"]] != m["a"]
    score, extra, _ = _split("code")
    for d in noisy.build_junk("code", ("broken",), score + extra, 30):
        with pytest.raises(SyntaxError):
            ast.parse(d.text)
    with pytest.raises(SystemExit, match="needs a qa target"):
        noisy.parse_noisy("noisy:code:wronganswer")
    with pytest.raises(SystemExit, match="unknown junk kind"):
        noisy.parse_noisy("noisy:code:bogus")
    assert not set(noisy.TUNING_KINDS) & set(noisy.HELDOUT_KINDS)
    assert noisy.parse_noisy("noisy:carve:austen:tune") == ("carve:austen",
                                                            ("dup", "shuffle", "wordswap"))
    assert noisy.junk_shares({"junk:dup": 0.1, "kjv": 0.5}) == {"dup": 0.1}


def test_compute_curves():
    """Loss read at CPU-seconds, CPU to reach a level, and the paired equal-compute gains."""
    rnd = [{"step": s, "cpu_s": s / 10, "target": 6 - s / 100, "examples": 16 * s}
           for s in (0, 100, 200, 300)]
    var = [{"step": s, "cpu_s": s / 5, "target": 6 - s / 50, "examples": 16 * s}
           for s in (0, 50, 100)]
    assert compute.loss_at(rnd, 15) == pytest.approx(4.5)
    assert math.isnan(compute.loss_at(rnd, 31))
    assert compute.reach(rnd, 4.5) == pytest.approx(15)
    assert compute.reach(var, 3) == math.inf
    ec = compute.equal_compute(rnd, var, 100)
    # random at 100 steps: loss 5 at 10 CPU-s; the variant reaches 5 at 50 steps, 10 CPU-s
    assert ec["cpu_ratio"] == pytest.approx(1.0)
    assert ec["gain_cpu"] == pytest.approx((6 - 2.0) - 4.0)  # random at 20 CPU-s: 4.0
    assert ec["gain_at_random_cpu"] == pytest.approx(5 - 5)
    assert [e["step"] for e in compute.truncate(rnd, 200)] == [0, 100, 200]
