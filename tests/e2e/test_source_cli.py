"""``attribute --method source`` on Hugging Face checkpoint folders equals the library call.

Invariant: the tool passes every checkpoint's step and learning rate (from its
``trainer_state.json``) with its store and factors, so SOURCE's segments (steps 5, 10, 20;
the logged linear-decay rates) are those of ``make_attributor("source")`` on
``Checkpoint(..., lr, factors, step)`` built by hand; without a recorded rate the tool
refuses, naming ``--lrs``.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from test_tools_hf import _in_order, _library, _lr, _texts, _trainer_checkpoints


def test_attribute_source_equals_the_library_call(tmp_path, capsys):
    """Breaks if the tool drops a checkpoint's step or lr, or the segments are misordered."""
    import dattri_ds
    from dattri_ds import CaptureConfig, Checkpoint, GradBatch, make_attributor
    from dattri_ds.cli import run
    from dattri_ds.tools import attribute, collect, fit
    from dattri_ds.tools.common import load_texts
    from dattri_ds.tools.sources import HFTokenizer
    from transformers import AutoModelForCausalLM

    root = _trainer_checkpoints(tmp_path / "out")
    tags = ["checkpoint-5", "checkpoint-10", "checkpoint-20"]
    data, queries = _texts(tmp_path / "train.jsonl", 6), _texts(tmp_path / "q.jsonl", 2, seed=5)
    src = ["--checkpoints", str(root / "checkpoint-*")]
    collect.main([*src, "--data", data, "--projection-dim", str(1 << 22), "--out",
                  str(tmp_path / "g")])
    fit.main([*src, "--data", data, "--out", str(tmp_path / "factors")])
    factors, _, _ = _library([root / t for t in tags], data, queries)
    tok = HFTokenizer(root / tags[0])
    train, query = load_texts(data, tok, 24), load_texts(queries, tok, 24, context=24)
    cks = []
    for tag, f in zip(tags, factors):
        model = AutoModelForCausalLM.from_pretrained(str(root / tag), dtype=torch.float32).eval()
        rows = {name: GradBatch.cat(list(dattri_ds.collect(
            model, [d.batch(torch.arange(len(d)))], CaptureConfig(),
            user_ids=[[doc.id for doc in d.docs]]))) for name, d in (("train", train),
                                                                     ("query", query))}
        step = int(tag.split("-")[1])
        cks.append(Checkpoint([rows["train"]], rows["query"], _lr(step), f, step))
    want = make_attributor("source").trajectory_scores(cks)
    base = [*src, "--store", str(tmp_path / "g"), "--queries", queries, "--method", "source",
            "--factors", str(tmp_path / "factors")]
    attribute.main([*base, "--out", str(tmp_path / "source")])
    got = np.load(tmp_path / "source/scores.npy")
    ids = json.loads((tmp_path / "source/train_ids.json").read_text())
    np.testing.assert_allclose(got, _in_order(want, ids), rtol=1e-4,
                               atol=1e-6 * float(abs(got).max()))
    for tag in tags:  # no recorded learning rates: the tool names --lrs
        (root / tag / "trainer_state.json").unlink()
    code = run(attribute.main, [*base, "--steps", "5", "10", "20", "--out",
                                str(tmp_path / "nolr")])
    assert code == 2 and "--lrs" in capsys.readouterr().err
