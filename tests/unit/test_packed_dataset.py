"""The training dataset over prepared corpora (dattri_ds.data.packed) against slow references.

Invariants: the window indices equal megatron-core's ``GPTDataset`` indices (valid split,
no extra token, last partial window kept); example ``i``'s real tokens are window
``shuffle_index[i]`` of the documents concatenated in document-index order (the slow
reference cuts that Python list), its spans name exactly those tokens, and over all
examples every token of every document is covered once (0 dropped); ``batch`` has the form
of ``TokenizedDocuments.batch`` (labels -100 and mask 0 on padding); a blend without weights
holds every example of every corpus once, with weights every example at least once; the
indices are built once (by rank 0) and reused.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, spm_file, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

require("megatron.core", "megatron")
from dattri_ds.data.packed import (  # noqa: E402
    PackedDataset, Span, parse_blend, window_indices,
)
from dattri_ds.errors import ConfigError, InputFileError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _megatron_prefix(path: Path, lengths, seed: int = 0) -> list[np.ndarray]:
    """A prefix written by megatron-core's builder; document d's tokens are 1000*d + arange
    (distinct, so a misplaced token is seen)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = [(np.arange(n) % 997 + 1 + 3 * d) % 60000 for d, n in enumerate(lengths)]
    b = IndexedDatasetBuilder(str(path) + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(d.astype(np.uint16), [len(d)])
    b.finalize(str(path) + ".idx")
    return docs


def _lengths(n: int, seed: int, high: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high, n)


@pytest.mark.parametrize("seq_len,seed,high", [(64, 1234, 300), (128, 7, 40), (50, 3, 500)])
def test_window_indices_equal_gptdataset(tmp_path, seq_len, seed, high):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    lengths = _lengths(300, seed, high)
    lengths[5] = seq_len  # a document of exactly one window
    _megatron_prefix(tmp_path / "m", lengths)

    class Tok:
        vocab_size, eod, pad, unique_identifiers = 60000, 0, 0, {"class": "Tok"}

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, tokenizer=Tok(),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, split="1,0,0", create_attention_mask=False,
                           drop_last_partial_validation_sequence=False,
                           add_extra_token_to_sequence=False, path_to_cache=str(tmp_path / "g"))
    ds = IndexedDataset(str(tmp_path / "m"))
    g = GPTDataset(ds, str(tmp_path / "m"), np.arange(len(ds), dtype=np.int32), None,
                   Split.valid, cfg)
    ours = window_indices(ds.sequence_lengths, seq_len, seed)
    assert np.array_equal(ours["document_index"], g.document_index)
    assert np.array_equal(ours["sample_index"], g.sample_index)
    assert np.array_equal(ours["shuffle_index"], g.shuffle_index)
    p = PackedDataset(str(tmp_path / "m"), seq_len, seed=seed)
    for i in (0, 1, len(p) - 1):
        ref = g[i]["tokens"].numpy()  # GPTDataset pads with id 0, then rolls the labels
        got = p.tokens(i)
        assert np.array_equal(ref[:len(got)], got) and not ref[len(got):].any()


def test_window_indices_count_past_float32():
    """No token dropped where the compiled helper's float32 ceil would: 2**24 + 1 tokens."""
    lengths = np.array([2 ** 24 + 1], dtype=np.int32)
    ix = window_indices(lengths, 512, 0)
    assert len(ix["shuffle_index"]) == 32769 and tuple(ix["sample_index"][-1]) == (0, 2 ** 24 + 1)


@pytest.fixture(scope="module")
def mega(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    lengths = _lengths(400, 11)
    lengths[:3] = (1, 64, 640)
    docs = _megatron_prefix(root / "m", lengths)
    return root, docs


def _reference_windows(docs, order, seq_len) -> list[list[int]]:
    flat = [int(t) for d in order for t in docs[d]]
    return [flat[k: k + seq_len] for k in range(0, len(flat), seq_len)]


def test_windows_against_the_slow_reference(mega):
    root, docs = mega
    p = PackedDataset(str(root / "m"), 64)
    order = np.asarray(p._idx[0]["document_index"])
    shuffle = np.asarray(p._idx[0]["shuffle_index"])
    windows = _reference_windows(docs, order, 64)
    assert len(p) == len(windows) and sorted(shuffle.tolist()) == list(range(len(p)))
    covered = Counter()
    for i in range(len(p)):
        want = windows[shuffle[i]]
        assert p.tokens(i).tolist() == want, i
        spans = p.spans(i)
        assert sum(s.end - s.start for s in spans) == len(want)
        assert [int(t) for s in spans for t in docs[s.document][s.start:s.end]] == want
        for s in spans:
            covered.update((s.document, t) for t in range(s.start, s.end))
    assert len(covered) == sum(map(len, docs)) and set(covered.values()) == {1}  # 0 dropped
    total = sum(map(len, docs))
    assert p.n_tokens == total
    assert p.padding_share == pytest.approx(1 - total / (len(p) * 64))


def test_batch_has_the_form_of_tokenized_documents(mega):
    """Keys, dtypes, shapes, padding and labels as ``TokenizedDocuments.batch``."""
    from dattri_ds.data import tokenize_documents

    class CharTok:
        pad_id, bos_id, eos_id, fingerprint = 0, 2, 3, "x"

        def encode_batch(self, texts):
            return [[ord(c) % 50 + 4 for c in t] for t in texts]

    root, _ = mega
    p = PackedDataset(str(root / "m"), 64)
    ref = tokenize_documents(["ab", "c" * 80], CharTok(), 64).batch([0, 1])
    last = next(i for i in range(len(p)) if len(p.tokens(i)) < 64)
    got = p.batch(torch.tensor([0, last]))
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype == torch.long and got[k].shape == (2, 64)
    n = len(p.tokens(last))
    assert got["attention_mask"][1].tolist() == [1] * n + [0] * (64 - n)
    assert got["labels"][1, n:].eq(-100).all() and got["labels"][1, :n].equal(
        got["input_ids"][1, :n])
    assert got["input_ids"][1, n:].eq(p.corpora[0].pad_id).all()
    one = p[last]
    assert all(one[k].equal(got[k][1]) for k in got)
    assert p.batch(slice(0, 3))["input_ids"].equal(p.batch([0, 1, 2])["input_ids"])


def test_documents_packing_cuts_each_document(mega):
    root, docs = mega
    p = PackedDataset(str(root / "m"), 64, packing="documents")
    want = sorted((d, k) for d, doc in enumerate(docs) for k in range(0, len(doc), 64))
    got = []
    for i in range(len(p)):
        (s,) = p.spans(i)
        got.append((s.document, s.start))
        assert p.tokens(i).tolist() == docs[s.document][s.start:s.start + 64].tolist()
    assert sorted(got) == want and p.n_tokens == sum(map(len, docs))


def test_blends(tmp_path, mega):
    """No weights: every example of every corpus once; weights: every example at least once,
    the counts follow the weights; ids name the corpus; the blend form is checked."""
    root, docs = mega
    _megatron_prefix(tmp_path / "b", _lengths(100, 12))
    a, b = PackedDataset(str(root / "m"), 64), PackedDataset(str(tmp_path / "b"), 64)
    both = PackedDataset([str(root / "m"), str(tmp_path / "b")], 64)
    assert len(both) == len(a) + len(b)
    seen = Counter(tuple(both.tokens(i).tolist()) for i in range(len(both)))
    ref = Counter(tuple(x.tokens(i).tolist()) for x in (a, b) for i in range(len(x)))
    assert seen == ref and both.n_tokens == a.n_tokens + b.n_tokens
    w = PackedDataset(["0.3", str(root / "m"), "0.7", str(tmp_path / "b")], 64)
    per = Counter(int(w._blend["dataset_index"][i]) for i in range(len(w)))
    assert per[0] >= len(a) and per[1] >= len(b)
    assert per[1] / len(w) == pytest.approx(0.7, abs=2 / len(w))
    got_b = Counter(tuple(w.tokens(i).tolist()) for i in range(len(w)) if w.spans(i)[0].corpus)
    assert set(got_b) == {tuple(b.tokens(i).tolist()) for i in range(len(b))}
    ids = [w.example_id(i) for i in range(len(w))]
    assert len(set(ids)) == len(ids) and any("~1" in x for x in ids)
    assert all(x.startswith(("m/", "b/")) for x in ids)
    assert w.n_tokens == sum(len(w.tokens(i)) for i in range(len(w)))
    for bad in (["0.5", "A", "B"], ["A", "0.5"], ["-1", "A"], []):
        with pytest.raises(ConfigError):
            parse_blend(bad)
    assert parse_blend(["0.5", "A", "1.5", "B"]) == (["A", "B"], [0.25, 0.75])


def test_indices_are_cached_and_reused(tmp_path, mega):
    root, _ = mega
    _megatron_prefix(tmp_path / "c", _lengths(50, 13))
    PackedDataset(str(tmp_path / "c"), 32)
    folder = tmp_path / "c.indices"
    files = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert len(files) == 4 and any(n.endswith("-description.json") for n in files)
    PackedDataset(str(tmp_path / "c"), 32)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == files  # reused
    PackedDataset(str(tmp_path / "c"), 16)
    PackedDataset(str(tmp_path / "c"), 32, seed=1)
    assert len(list(folder.iterdir())) == 12  # another key per seq_len and seed
    PackedDataset(str(tmp_path / "c"), 32, cache_dir=tmp_path / "elsewhere")
    gone = next((tmp_path / "elsewhere").glob("*-sample_index.npy"))
    gone.unlink()
    with pytest.raises(InputFileError, match="delete the"):
        PackedDataset(str(tmp_path / "c"), 32, cache_dir=tmp_path / "elsewhere")
    for f in (tmp_path / "elsewhere").iterdir():
        f.unlink()
    assert len(PackedDataset(str(tmp_path / "c"), 32, cache_dir=tmp_path / "elsewhere")) > 0


def _open_in_rank(rank, world, prefix):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    p = PackedDataset(prefix, 48)
    return p.batch(list(range(len(p))))["input_ids"]


@pytest.mark.dist
def test_rank0_builds_the_indices_once(tmp_path):
    """Two gloo ranks open the same prefix: rank 0 builds, the other waits and reads; both
    see the same examples as one process."""
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from _dist import run

    _megatron_prefix(tmp_path / "d", _lengths(80, 14))
    out = run(_open_in_rank, 2, prefix=str(tmp_path / "d"))
    single = PackedDataset(str(tmp_path / "d"), 48).batch(list(range(len(out[0]))))
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], single["input_ids"])
    assert len(list((tmp_path / "d.indices").iterdir())) == 4


def test_provenance_of_a_prepared_corpus(tmp_path):
    """On a prepared corpus: doc ids, sources and example ids from the document table."""
    from dattri_ds.data.prepare import PrepareConfig, prepare

    rows = documents(200, seed=8)
    write_jsonl(tmp_path / "c.jsonl", rows)
    model = spm_file(tmp_path / "t.model", [r["text"] for r in rows])
    prepare(PrepareConfig(input=(str(tmp_path / "c.jsonl"),), tokenizer=str(model),
                          output_prefix=str(tmp_path / "p"), workers=1))
    p = PackedDataset(str(tmp_path / "p"), 40)
    by_id = {r["id"]: r for r in rows}
    for i in (0, 5, len(p) - 1):
        spans = p.spans(i)
        ids = p.doc_ids(i)
        assert ids == [rows[s.document]["id"] for s in spans]
        ex = p.docs[i]
        assert ex.id == p.example_id(i) == f"{ids[0]}+{spans[0].start}"
        assert ex.source == by_id[ids[0]]["source"] and ex.spans == tuple(spans)
        assert isinstance(spans[0], Span)
    assert len({p.example_id(i) for i in range(len(p))}) == len(p)
    assert p.describe()["corpora"][0]["documents"] == 200


def test_padding_share_on_the_shipped_corpus(tmp_path):
    """data/corpus/train.jsonl, prepared with the launch's default tokenizer (SentencePiece
    BPE 1024 trained on it), in 512-token windows: no token dropped, padding <= 2%."""
    from dattri_ds.data.prepare import PrepareConfig, prepare

    m = prepare(PrepareConfig(input=(str(ROOT / "data/corpus/train.jsonl"),),
                              output_prefix=str(tmp_path / "corpus")))
    p = PackedDataset(str(tmp_path / "corpus"), 512)
    assert p.n_tokens == m["tokens"] and len(p) * 512 - p.n_tokens < 512
    assert p.padding_share <= 0.02


def test_bad_arguments_are_one_line(tmp_path, mega):
    root, _ = mega
    with pytest.raises(ConfigError, match="seq_len"):
        PackedDataset(str(root / "m"), 1)
    with pytest.raises(ConfigError, match="packing"):
        PackedDataset(str(root / "m"), 8, packing="sentences")  # type: ignore[arg-type]
    with pytest.raises(InputFileError, match="no prepared corpus"):
        PackedDataset(str(tmp_path / "none"), 8)
    os.makedirs(tmp_path / "half.prepare")
    with pytest.raises(InputFileError, match="rerun"):
        PackedDataset(str(tmp_path / "half"), 8)
