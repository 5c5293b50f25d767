"""The offline tools read prepared data (``--data-path``) as a training run on it does.

Invariants: ``collect --data-path P`` stores one row per example of ``PackedDataset(P, T)``,
named by its example id and equal to the library's capture of the same batches (what a
training store holds for those examples), and records the data's fingerprint in the store;
a model whose vocabulary is smaller than the data's tokenizer is refused at start, naming
both sizes; a store of other data (jsonl, another seq_len) is refused by collect, attribute
and curate before anything is written, naming both sides and the fix; reports show a row's
window decoded; curate writes the chosen windows as a prepared prefix that ``PackedDataset``
reads back token for token; a target sharing documents with the pool is refused unless
``--allow-target-overlap``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dattri_ds.errors import ConfigError, StoreMismatchError

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

T = 16
WORDS = 60


def _model_folder(path: Path, vocab: int = 64) -> Path:
    """A GPT-2 (context 32) saved with save_pretrained, with a word-level tokenizer whose
    specials are <pad> 0, <s> 1, </s> 2 and whose words a0..a59 are ids 3..62."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1,
                               n_head=2, bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"a{i}": 3 + i for i in range(WORDS)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def _texts(path: Path, n: int, seed: int, prefix: str = "d") -> Path:
    g = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for i in range(n):
            words = " ".join(f"a{w}" for w in g.integers(0, WORDS, int(g.integers(4, 20))))
            fh.write(json.dumps({"id": f"{prefix}{i}", "source": f"s{i % 3}",
                                 "title": f"t{i % 2}", "text": words}) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A model folder, a corpus prepared with its tokenizer, and a store collected on it."""
    from dattri_ds.data import PrepareConfig, prepare
    from dattri_ds.tools import collect

    tmp = tmp_path_factory.mktemp("tooldata")
    model = _model_folder(tmp / "m")
    corpus = _texts(tmp / "train.jsonl", 40, seed=0)
    prefix = tmp / "corpus"
    prepare(PrepareConfig(input=(str(corpus),), output_prefix=str(prefix),
                          tokenizer=str(model), workers=1))
    collect.main(["--model", str(model), "--data-path", str(prefix), "--seq-len", str(T),
                  "--projection-dim", "8", "--out", str(tmp / "grads")])
    return {"tmp": tmp, "model": model, "corpus": corpus, "prefix": prefix,
            "grads": tmp / "grads"}


def _store(world):
    from dattri_ds.store import GradientStore

    return GradientStore.open(world["grads"] / "m", require_complete=True)


def test_collect_rows_are_the_training_examples(world):
    """Every row is an example of PackedDataset(P, T): its id is the example id (document
    id + offset) and its values are the library's capture of that example's batch, as a
    training store holds them; the store records the data's fingerprint, path, seq_len and
    packing. Breaks if the tools read prepared data in another order, unit or tokenization."""
    from dattri_ds import CaptureConfig, GradBatch, ProjectionConfig, collect
    from dattri_ds.data import PackedDataset
    from dattri_ds.sample_id import SampleId
    from dattri_ds.tools.sources import HFModelDir

    data = PackedDataset(world["prefix"], T)
    with _store(world) as store:
        assert store.spec.data == data.record(data.tokenizer_fingerprint)
        assert store.spec.data["data_path"] == [str(world["prefix"].resolve())]
        assert [SampleId.parse(i).doc for i in store.ids] == [
            data.example_id(i) for i in range(len(data))]
        src = HFModelDir.open(world["model"])
        model = src.model(src.tag)
        rows = list(range(len(data)))
        cfg = CaptureConfig(projection=ProjectionConfig(**store.spec.projection_config))
        want = GradBatch.cat(list(collect(model, [data.batch(rows)], cfg,
                                          user_ids=[[data.example_id(i) for i in rows]])))
        assert list(want.sample_ids) == list(store.ids)
        got = store.to_gradbatch(slice(None))
        for name, lg in want.layers.items():
            np.testing.assert_allclose(got.layers[name].data.values.numpy(),
                                       lg.data.values.numpy(), rtol=1e-4, atol=1e-5)


def test_vocabulary_larger_than_the_model_is_refused(world, tmp_path, capsys):
    """A model of vocab_size 32 cannot read ids of a 63-id tokenizer: one line naming both
    sizes, before any store is written."""
    from dattri_ds.cli.exits import run
    from dattri_ds.tools import collect

    small = _model_folder(tmp_path / "small", vocab=32)
    capsys.readouterr()
    code = run(collect.main, ["--model", str(small), "--data-path", str(world["prefix"]),
                              "--seq-len", str(T), "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "63 ids" in err[0] and "vocab_size 32" in err[0] and "--tokenizer" in err[0]
    assert not list((tmp_path / "g").rglob("info.json"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("other", ["jsonl", "seq_len"])
def test_collect_into_a_store_of_other_data_is_refused(world, other):
    """collect --data J (or another --seq-len) into a store of --data-path P is refused
    before anything is written: the store and collect's record are unchanged, the error
    names both fingerprints and the flags that read the store's data."""
    from dattri_ds.tools import collect

    before = _snapshot(world["grads"])
    flags = ["--data", str(world["corpus"]), "--seq-len", str(T)] if other == "jsonl" else \
        ["--data-path", str(world["prefix"]), "--seq-len", str(T + 4)]
    with pytest.raises(StoreMismatchError) as err:
        collect.main(["--model", str(world["model"]), *flags, "--projection-dim", "8",
                      "--out", str(world["grads"])])
    msg = str(err.value)
    assert "computed on other data" in msg and "--data-path" in msg and "\n" not in msg
    with _store(world) as store:
        assert store.spec.data["fingerprint"] in msg
    assert _snapshot(world["grads"]) == before


def test_attribute_and_curate_refuse_a_store_of_other_data(world, tmp_path):
    """attribute --train-data J and curate --pool J against a store collected from
    --data-path P: refused, naming the store's data, with no output written."""
    from dattri_ds.tools import attribute, curate

    queries = _texts(tmp_path / "q.jsonl", 2, seed=9, prefix="q")
    with pytest.raises(StoreMismatchError, match="computed on other data than attribute"):
        attribute.main(["--model", str(world["model"]), "--store", str(world["grads"]),
                        "--queries", str(queries), "--method", "graddot", "--train-data",
                        str(world["corpus"]), "--out", str(tmp_path / "a")])
    with pytest.raises(StoreMismatchError, match="computed on other data than curate"):
        curate.main(["--model", str(world["model"]), "--store", str(world["grads"]),
                     "--pool", str(world["corpus"]), "--target", str(queries),
                     "--examples", "3", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "a/scores.npy").exists() and not (tmp_path / "c").exists()


def test_attribute_text_prior_and_report_read_the_windows(world, tmp_path):
    """attribute finds the store's prepared data by its records, tokenizes queries with the
    data's tokenizer, and its text prior reads each row's window decoded; report shows the
    same text for a proponent. Breaks if texts are looked up by document instead of by
    example."""
    from dattri_ds.data import PackedDataset
    from dattri_ds.data.tokenizers import open_tokenizer
    from dattri_ds.eval import tfidf_scores
    from dattri_ds.sample_id import SampleId
    from dattri_ds.tools import attribute, report

    queries = _texts(tmp_path / "q.jsonl", 2, seed=9, prefix="q")
    out = tmp_path / "attr"
    summary = attribute.main(["--model", str(world["model"]), "--store", str(world["grads"]),
                              "--queries", str(queries), "--method", "graddot",
                              "--text-weight", "0.5", "--out", str(out)])
    assert summary["text_weight"] == 0.5 and str(world["prefix"]) in summary["text_prior"]
    data, tok = PackedDataset(world["prefix"], T), open_tokenizer(world["model"])
    ids = json.loads((out / "train_ids.json").read_text())
    index = {data.example_id(i): i for i in range(len(data))}
    texts = [tok.decode(data.tokens(index[SampleId.parse(i).doc]).tolist()) for i in ids]
    qtexts = [tok.decode(tok.encode_documents([json.loads(x)["text"]])[0])
              for x in queries.read_text().splitlines()]
    np.testing.assert_allclose(np.load(out / "text_overlap.npy"),
                               tfidf_scores(texts, qtexts).numpy(), rtol=1e-6)
    md = report.main(["--attribution", str(out), "--top-k", "1", "--chars", "2000"]).read_text()
    top = json.loads((out / "topk.json").read_text())[0]["proponents"][0]["id"]
    row = texts[ids.index(top)]
    assert f"| {SampleId.parse(top).doc} |" in md and " ".join(row.split()) in md


def test_curate_writes_a_prepared_subset_read_back_exactly(world, tmp_path):
    """curate --data-path writes the chosen windows as prefix OUT/subset: its documents are
    the chosen spans merged per document (whole documents keep their ids and text hashes,
    parts are <id>+<start>), and PackedDataset(subset) reads exactly their tokens; the
    manifest names the pool. Breaks if a token is lost, repeated or reordered."""
    from dattri_ds.data import PackedDataset, open_prepared
    from dattri_ds.tools import curate
    from dattri_ds.tools.subset import merged_spans

    target = _texts(tmp_path / "t.jsonl", 3, seed=5, prefix="t")
    out = tmp_path / "sub"
    curate.main(["--model", str(world["model"]), "--store", str(world["grads"]),
                 "--data-path", str(world["prefix"]), "--target", str(target),
                 "--fraction", "0.3", "--with-text", "--out", str(out)])
    data = PackedDataset(world["prefix"], T)
    index = {data.example_id(i): i for i in range(len(data))}
    chosen = [index[json.loads(x)["id"]] for x in (out / "subset.jsonl").read_text().split("\n")
              if x]
    spans = merged_spans(data, np.array(chosen))
    sub, pool = open_prepared(out / "subset"), data.corpora[0]
    assert len(sub) == len(spans) and sub.n_tokens == sum(
        len(data.tokens(i)) for i in chosen)
    for d, (_, doc, a, b) in enumerate(spans.tolist()):
        np.testing.assert_array_equal(sub.tokens(d), pool.tokens(doc, a, b))
        whole = a == 0 and b == int(pool.lengths[doc])
        assert sub.doc_id(d) == pool.doc_id(doc) + ("" if whole else f"+{a}")
        if whole:
            assert sub.table.text_hash[d] == pool.table.text_hash[doc]
    assert sub.manifest["subset_of"]["fingerprint"] == data.fingerprint
    assert sub.manifest["tokenizer"] == pool.manifest["tokenizer"]
    again = PackedDataset(out / "subset", T)
    stream = np.concatenate([again.tokens(i) for i in range(len(again))])
    assert sorted(stream.tolist()) == sorted(np.concatenate(
        [pool.tokens(doc, a, b) for _, doc, a, b in spans.tolist()]).tolist())
    assert again.n_tokens == sub.n_tokens and again.padding_share < 1 / len(again)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["inputs"]["target_overlap"] == 0
    assert "subset.manifest.json" in cfg["result"]["subset_files"]


def test_a_target_that_overlaps_the_pool_is_refused_unless_allowed(world, tmp_path):
    """Target documents also in the pool (same text) are counted by text hash: refused in
    one line naming the count and --allow-target-overlap; with the flag the count is
    recorded in config.json."""
    from dattri_ds.tools import curate

    lines = world["corpus"].read_text().splitlines()
    target = tmp_path / "t.jsonl"
    target.write_text("\n".join(lines[:2] + [json.dumps({"id": "new", "source": "s", "title": "",
                                                            "text": "a1 a2 a3"})]))
    base = ["--model", str(world["model"]), "--store", str(world["grads"]), "--target",
            str(target), "--examples", "4"]
    with pytest.raises(ConfigError, match="2 of 3 documents are also in the pool.*"
                                          "--allow-target-overlap"):
        curate.main([*base, "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()
    curate.main([*base, "--allow-target-overlap", "--out", str(tmp_path / "yes")])
    cfg = json.loads((tmp_path / "yes/config.json").read_text())
    assert cfg["inputs"]["target_overlap"] == 2 and cfg["result"]["kept_rows"] == 4


def test_a_run_records_its_prepared_data(tmp_path, monkeypatch):
    """A run whose resolved config names train.data_path (prepared data, with seq_len and
    packing) is the tools' default data, its prefixes found and made absolute; a blend keeps
    its weights."""
    from dattri_ds.tools.provenance import PREPARED, training_data
    from dattri_ds.tools.sources import Run

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model/config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for name in ("a", "b"):
        (tmp_path / f"{name}.idx").write_bytes(b"")
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {
        "data_path": ["0.7", "a", "0.3", "b"], "seq_len": 16, "packing": "documents"}}))
    monkeypatch.chdir(tmp_path)
    got = training_data("--data", None, source=Run.open(run))
    assert (got.kind, got.seq_len, got.packing) == (PREPARED, 16, "documents")
    assert got.files == ("0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b"))
    assert got.record == (run / "resolved_dattri_ds_config.json", "train.data_path")
