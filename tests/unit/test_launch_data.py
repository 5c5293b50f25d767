"""launch/train.py on prepared data: memory-mapped windows, the model's tokenizer, one data identity.

Invariants: the loop trains on ``PackedDataset`` examples (``--data-path``, or ``--train-data``
prepared once into ``<out>/data/``: a second run and ``--max-docs`` read no further than they
must); every stored row and selection record names its example by its first document
(``PackedDataset.example_id``), from which every document of the window is found
(``spans_of``); the model's special ids and vocabulary are its tokenizer's (an HF folder's ids
equal ``AutoTokenizer``'s); the data record (fingerprint of the examples and of the tokenizer)
is the same in ``data.json``, the checkpoint and the store manifest; a resume on other data, a
run writing over its ``--init-from`` run, a held-out set that holds training documents, a
tokenizer the model's embeddings cannot take, a tokenizer other than the prepared corpus's and
a Megatron prefix without one are each refused at start in one line, nothing overwritten.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, hf_folder, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

from dattri_ds.cli.exits import run  # noqa: E402

require("sentencepiece", "hf")
require("megatron.core", "megatron")
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "data/tiny/train.jsonl"


def _model(tmp: Path) -> Path:
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 64,
         "tie_word_embeddings": False}))
    return tmp / "model.json"


def _argv(tmp: Path, out: Path, *extra: str) -> list[str]:
    return ["--backend", "torch", "--deepspeed_config", str(ROOT / "configs/zero0_cpu.json"),
            "--model-config", str(_model(tmp)), "--out", str(out), "--steps", "2",
            "--seq-len", "32", "--vocab-size", "256", "--log-every", "1", *extra]


def _main(argv: list[str]) -> dict:
    from dattri_ds.launch.train import main

    return main(argv)


def _errors(capsys, argv: list[str]) -> tuple[int, list[str]]:
    from dattri_ds.launch.train import main

    code = run(main, argv)
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.startswith("dattri-ds: error: ")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """data/tiny prepared once (SentencePiece BPE 256 trained on it)."""
    from dattri_ds.data.prepare import PrepareConfig, prepare

    prefix = tmp_path_factory.mktemp("prepared") / "tiny"
    prepare(PrepareConfig(input=(str(TINY),), output_prefix=str(prefix), vocab_size=256,
                          workers=1))
    return prefix


def test_data_path_trains_windows_and_rows_name_documents(tmp_path, corpus):
    """--data-path with capture and online selection: the record in data.json, the
    checkpoint and the store manifest are one; every stored row and chosen candidate names a
    window by its first document and offset, and ``spans_of`` finds all its documents."""
    import torch

    from dattri_ds.data.packed import PackedDataset
    from dattri_ds.sample_id import SampleId
    from dattri_ds.selection import read_selection_log
    from dattri_ds.store import GradientStore

    out = tmp_path / "run"
    summary = _main(_argv(tmp_path, out, "--data-path", str(corpus), "--capture",
                          "--capture-projection-dim", "16", "--online-selection",
                          "--target-data", str(ROOT / "data/tiny/target.jsonl")))
    assert summary["status"] == "ok"
    data = PackedDataset(str(corpus), 32)
    record = json.loads((out / "data.json").read_text())["record"]
    assert record["fingerprint"] == data.fingerprint and record["data_path"] == data.data_path
    assert record["tokenizer"] == data.tokenizer_fingerprint
    state = torch.load(out / "checkpoints/step2/loop_state.rank00000.pt", weights_only=False)
    assert state["run"]["data"]["record"] == record
    with GradientStore.open(out / "grad_store") as store:
        assert store.spec.data == record
        ids = [SampleId.parse(i) for i in store.ids]
    chosen = [SampleId.parse(i) for r in read_selection_log(out / "selection.jsonl")
              for i in r["chosen"]]
    assert {i.document for i in ids} == {i.document for i in chosen}
    assert len(ids) == summary["examples"]
    for sid in ids:
        spans = data.spans_of(sid.document)
        first = data.corpora[0].doc_id(spans[0].document)
        assert sid.document == f"{first}+{spans[0].start}"
        assert sum(s.end - s.start for s in spans) <= 32
    assert (out / "tokenizer.model").read_bytes() == (
        Path(f"{corpus}.tokenizer") / "tokenizer.model").read_bytes()


def test_train_data_is_prepared_once_and_max_docs_reads_no_further(tmp_path):
    """--train-data with --max-docs 12 on a file whose line after 16 MB is not JSON: only
    the blocks that hold the first 12 documents are read (pyarrow reads up to ~32 MiB ahead
    but parses none of the broken line's block), prepared into <out>/data/; a forced rerun
    in the same --out reuses them (the manifest untouched)."""
    lines = TINY.read_text().splitlines()
    filler = json.dumps({"id": "f{}", "source": "s", "title": "t", "text": "w " * 500})
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:40] + [filler.replace("f{}", f"f{i}")
                                              for i in range(16_000)] + ["{not json"]) + "\n")
    out = tmp_path / "run"
    assert _main(_argv(tmp_path, out, "--train-data", str(broken), "--max-docs", "12"))[
        "status"] == "ok"
    manifest, = (out / "data").glob("*.manifest.json")
    assert json.loads(manifest.read_text())["documents"] == 12
    stamp = manifest.stat().st_mtime_ns
    _main(_argv(tmp_path, out, "--train-data", str(broken), "--max-docs", "12", "--force"))
    assert manifest.stat().st_mtime_ns == stamp and len(list((out / "data").glob("*.bin"))) == 1


def test_hf_tokenizer_gives_the_model_its_ids(tmp_path):
    """--tokenizer HF_FOLDER: the prepared tokens are AutoTokenizer's ids plus one EOS, the
    model gets the tokenizer's vocabulary and pad/bos/eos, and the run keeps the tokenizer's
    copy in model/ (what --init-from reads). A --model-path whose embeddings are smaller than
    its tokenizer is refused at start naming both sizes."""
    from transformers import AutoTokenizer

    from dattri_ds.data.packed import PackedDataset

    rows = documents(40, seed=5)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    folder = hf_folder(tmp_path / "hf", [r["text"] for r in rows], template="<s> $A")
    out = tmp_path / "run"
    _main(_argv(tmp_path, out, "--train-data", str(train), "--tokenizer", str(folder)))
    ref = AutoTokenizer.from_pretrained(str(folder))
    record = json.loads((out / "data.json").read_text())["record"]
    corpus = PackedDataset(record["data_path"], 32).corpora[0]
    for d in (0, 17, 39):
        want = ref(rows[d]["text"])["input_ids"] + [ref.eos_token_id]
        assert corpus.tokens(d).tolist() == want
    config = json.loads((out / "model/config.json").read_text())
    assert config["vocab_size"] == len(ref)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert (out / "model/tokenizer.json").is_file()

    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64}))
    ref.save_pretrained(str(small))
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.config import RunConfig
    from dattri_ds.launch.data import check_data

    with pytest.raises(ConfigError) as e:
        check_data(RunConfig.from_dict({"train": {"model_path": str(small)}}))
    assert f"has {len(ref)} ids" in str(e.value) and "hold 64" in str(e.value), e.value


def _snapshot(out: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted(out.rglob("*"))
            if "data" not in p.relative_to(out).parts[:1]}


def test_resume_on_other_data_is_refused_and_nothing_is_overwritten(tmp_path, capsys):
    """A 2-step run resumed with another --train-data, --seq-len, --max-docs or tokenizer:
    refused at start naming both sides and the flags; the same path with other content (the
    file rewritten) is refused once the data is prepared, by its fingerprint; the run's files
    untouched. --init-from RUN --out RUN --force is refused before anything is written."""
    train = write_jsonl(tmp_path / "a.jsonl", documents(30, seed=1))
    other = write_jsonl(tmp_path / "b.jsonl", documents(30, seed=2))
    out = tmp_path / "run"
    base = _argv(tmp_path, out, "--train-data", str(train), "--save-every", "2",
                 "--vocab-size", "120")
    _main(base)
    before = _snapshot(out)
    resume = [*base, "--steps", "4", "--resume", "latest"]
    cases = {"--train-data": ["--train-data", str(other)], "--seq-len": ["--seq-len", "16"],
             "--max-docs": ["--max-docs", "10"], "--tokenizer": ["--vocab-size", "100"]}
    for flag, change in cases.items():
        code, errors = _errors(capsys, [*resume, *change])
        assert code == 2 and len(errors) == 1, (flag, errors)
        assert "trained on other data" in errors[0] and flag in errors[0], errors[0]
        assert "there" in errors[0] and "here" in errors[0], errors[0]
    write_jsonl(train, documents(30, seed=3))  # same path and size class, other texts
    code, errors = _errors(capsys, resume)
    assert code == 2 and "fingerprint=" in errors[0], errors
    assert _snapshot(out) == before
    code, errors = _errors(capsys, _argv(tmp_path, out, "--train-data", str(train),
                                         "--init-from", str(out), "--init-checkpoint",
                                         "latest", "--force"))
    assert code == 2 and "is the --init-from run" in errors[0], errors
    assert _snapshot(out) == before


def test_held_out_texts_in_the_training_data(tmp_path, capsys, caplog):
    """--eval-data holding 3 training documents: refused naming the count and
    --allow-eval-overlap, which runs it; a selection target holding training documents is
    a note."""
    rows = [json.loads(x) for x in TINY.read_text().splitlines()]
    held = write_jsonl(tmp_path / "held.jsonl", rows[:3] + documents(5, seed=9))
    argv = _argv(tmp_path, tmp_path / "run", "--train-data", str(TINY), "--eval-every", "2",
                 "--eval-data", str(held))
    code, errors = _errors(capsys, argv)
    assert code == 2 and "3 of the 8 documents" in errors[0], errors
    assert "--allow-eval-overlap" in errors[0] and str(held) in errors[0]
    caplog.set_level("WARNING", logger="dattri_ds.launch")
    assert _main([*argv, "--allow-eval-overlap", "--online-selection", "--target-data",
                  str(held)])["status"] == "ok"
    assert any("--target-data" in r.message and "3 of the 8" in r.message
               for r in caplog.records)


def test_prepared_data_refusals(tmp_path, capsys, corpus):
    """One line each, at start: an .idx without its .bin, a tokenizer other than the one
    the corpus was prepared with, a Megatron-LM prefix without a tokenizer."""
    import shutil

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import numpy as np

    lone = tmp_path / "lone"
    shutil.copy(f"{corpus}.idx", f"{lone}.idx")
    code, errors = _errors(capsys, _argv(tmp_path, tmp_path / "r", "--data-path", str(lone)))
    assert code == 2 and "has no data file" in errors[0] and f"{lone}.bin" in errors[0], errors
    spm = tmp_path / "other.model"
    from dattri_ds.data.tokenizer import train_tokenizer

    train_tokenizer(["some other text entirely", "and more"] * 20, vocab_size=40,
                    cache_dir=tmp_path).save(spm)
    code, errors = _errors(capsys, _argv(tmp_path, tmp_path / "r", "--data-path", str(corpus),
                                         "--tokenizer", str(spm)))
    assert code == 2 and "was prepared with the tokenizer" in errors[0], errors
    mega = tmp_path / "mega"
    builder = IndexedDatasetBuilder(f"{mega}.bin", dtype=np.uint16)
    builder.add_document(np.arange(1, 50, dtype=np.uint16), [49])
    builder.finalize(f"{mega}.idx")
    code, errors = _errors(capsys, _argv(tmp_path, tmp_path / "r", "--data-path", str(mega)))
    assert code == 2 and "records no tokenizer" in errors[0], errors
    assert not (tmp_path / "r").exists()
