"""The corpus tokenizers (dattri_ds.data.tokenizers) against the libraries themselves.

Invariant: ``encode_batch(texts)[i]`` equals the library's own ids for ``texts[i]``
(``AutoTokenizer.from_pretrained(folder)(text)["input_ids"]``; SentencePiece ``encode`` with
the model's BOS), and ``encode_documents`` appends EOS unless the tokenizer put one last; a
saved copy reloads with the same fingerprint; a damaged tokenizer is one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, hf_folder, spm_file  # noqa: E402
from _deps import require  # noqa: E402

require("transformers", "hf")
require("sentencepiece", "hf")
from dattri_ds.data.tokenizers import (  # noqa: E402
    TOKENIZERS, HFTokenizerFolder, SentencePieceFile, TrainedSentencePiece, load_saved,
    open_tokenizer,
)
from dattri_ds.errors import InputFileError  # noqa: E402

TEXTS = [d["text"] for d in documents(60, seed=3)] + ["", "  spaces  ", "naïve λ\n\nx"]


@pytest.mark.parametrize("template", [None, "<s> $A", "<s> $A </s>"])
def test_hf_ids_equal_autotokenizer(tmp_path, template):
    """GPT-2-like (no special tokens), Llama-like (BOS) and a tokenizer that appends EOS
    itself: ids are AutoTokenizer's, one EOS after each document, never two."""
    from transformers import AutoTokenizer

    folder = hf_folder(tmp_path / "hf", TEXTS, template=template)
    tok = open_tokenizer(folder)
    assert isinstance(tok, HFTokenizerFolder) and tok.kind == "hf"
    ref = AutoTokenizer.from_pretrained(str(folder))
    want = [ref(t)["input_ids"] for t in TEXTS]  # one text at a time: the slow reference
    assert tok.encode_batch(TEXTS) == want
    docs = tok.encode_documents(TEXTS)
    for ids, w in zip(docs, want):
        assert ids == (w if w and w[-1] == ref.eos_token_id else w + [ref.eos_token_id])
        assert ids.count(tok.eos_id) == 1 or ids[:-1].count(tok.eos_id) == 0
    if template is not None:
        assert all(d[0] == ref.bos_token_id for d in docs)
    assert tok.vocab_size == len(ref) and tok.eos_id == ref.eos_token_id
    saved = load_saved(tok.save(tmp_path / "copy"), tok.describe())
    assert saved.fingerprint == tok.fingerprint and saved.encode_batch(TEXTS) == want


def test_sentencepiece_ids_and_saved_copy(tmp_path):
    """A .model file: the model's ids with its BOS, then EOS; the saved copy reloads equal."""
    import sentencepiece as spm

    path = spm_file(tmp_path / "t.model", TEXTS)
    tok = open_tokenizer(path)
    assert isinstance(tok, SentencePieceFile) and tok.kind == "spm"
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert tok.encode_documents(TEXTS) == [[sp.bos_id()] + sp.encode(t) + [sp.eos_id()]
                                           for t in TEXTS]
    tok.set_threads(2)
    assert tok.encode_batch(TEXTS) == [[sp.bos_id()] + sp.encode(t) for t in TEXTS]
    again = load_saved(tok.save(tmp_path / "copy"), tok.describe())
    assert again.fingerprint == tok.fingerprint
    with pytest.raises(InputFileError, match="fingerprint"):
        load_saved(tmp_path / "copy", {**tok.describe(), "fingerprint": "spm-other"})


def test_a_prepared_tokenizer_folder_opens_as_its_sentencepiece_model(tmp_path):
    """``--tokenizer PREFIX.tokenizer`` (the folder prepare keeps: only ``tokenizer.model``)
    is that SentencePiece model: same fingerprint and ids as the file itself."""
    path = spm_file(tmp_path / "t.model", TEXTS)
    folder = open_tokenizer(path).save(tmp_path / "corpus.tokenizer")
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.model"]
    tok, ref = open_tokenizer(folder), open_tokenizer(path)
    assert isinstance(tok, SentencePieceFile) and tok.fingerprint == ref.fingerprint
    assert tok.encode_documents(TEXTS) == ref.encode_documents(TEXTS)


def test_trained_tokenizer_records_its_sample(tmp_path):
    tok = TrainedSentencePiece.train(TEXTS, vocab_size=150, model_type="bpe",
                                     cache_dir=tmp_path, sample={"sample_docs": len(TEXTS)})
    d = tok.describe()
    assert d["kind"] == "spm-trained" and d["trained"]["vocab_size"] == 150
    again = load_saved(tok.save(tmp_path / "saved"), d)
    assert isinstance(again, TrainedSentencePiece) and again.trained == d["trained"]
    assert set(TOKENIZERS) >= {"hf", "spm", "spm-trained"}


def test_damaged_tokenizers_are_one_line(tmp_path):
    folder = hf_folder(tmp_path / "hf", TEXTS)
    raw = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(raw[: len(raw) // 2])
    cases = {folder: "tokenizer.json", tmp_path / "empty": "neither tokenizer.json",
             tmp_path / "bad.model": "not a SentencePiece model",
             tmp_path / "missing.model": "does not exist"}
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.model").write_bytes(b"\x00garbage" * 10)
    for path, needle in cases.items():
        with pytest.raises(InputFileError) as e:
            open_tokenizer(path)
        msg = str(e.value)
        assert needle in msg and str(path.name) in msg and "\n" not in msg and "Fix" in msg, msg


def test_a_tokenizer_without_eos_is_refused(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = hf_folder(tmp_path / "hf", TEXTS)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok.eos_token = None
    tok.save_pretrained(str(tmp_path / "noeos"))
    with pytest.raises(InputFileError, match="no EOS token"):
        open_tokenizer(tmp_path / "noeos")
