"""The tools' documents: jsonl texts or token ids, tokenized into rows, and rows back to text.

* text jsonl (``{"id", "source", "title", "text"}`` per line; a query needs only ``id`` and
  a non-empty ``text``),
  tokenized by the source's tokenizer;
* token-id jsonl (``{"id"?, "input_ids": [...]}`` per line): data that needs no tokenizer
  at all (``load_token_ids``).

Errors name the file, the line and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dattri_ds.io import files
from dattri_ds.data import Document, TokenizedDocuments, load_documents, tokenize_documents
from dattri_ds.errors import ConfigError, InputFileError

__all__ = ["load_texts", "row_texts", "load_token_ids", "is_token_file"]


def load_texts(path: str | list[str], tokenizer, seq_len: int, max_docs: int | None = None,
               context: int | None = None, truncate: bool = True, queries: bool = False,
               vocab_size: int | None = None) -> TokenizedDocuments:
    """Tokenized documents of a jsonl file of texts or of token ids (``is_token_file``).

    ``tokenizer`` is a Tokenizer, a callable returning one (called only for text files),
    or None for token-id files. ``queries``: every line needs an ``id`` and (a text line)
    a non-empty ``text``; ``source`` and ``title`` default to empty. Token ids are checked to
    lie below ``vocab_size`` (default: the tokenizer's, when it is one). Errors name the
    file and the fix.
    """
    if not isinstance(path, (str, os.PathLike)) and len(path) == 1:
        path = path[0]
    one = isinstance(path, (str, os.PathLike))
    if one:
        p = files.check_file(path, "data file",
                             "pass an existing jsonl file of documents or token ids")
    else:  # several text files (a run's train_data)
        for f in path:
            files.check_file(f, "data file", "pass existing jsonl files of documents")
        p = Path(path[0])
    if one and is_token_file(p):
        vocab = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
        data = load_token_ids(p, seq_len, max_docs, vocab if type(vocab) is int else None)
        if queries:
            _query_token_ids(p, max_docs)
        _check_truncation(data, p, seq_len, context, truncate)
        return data
    if callable(tokenizer) and not hasattr(tokenizer, "encode_batch"):
        tokenizer = tokenizer()
    docs = _query_documents(p) if queries and one else load_documents(p if one else list(path))
    if max_docs:
        docs = docs[:max_docs]
    if not docs:
        raise ConfigError(f"'{p}' holds no documents: give at least one jsonl line with a "
                          f"'text' field")
    data = tokenize_documents(docs, tokenizer, seq_len,
                              add_bos=getattr(tokenizer, "bos_id", None) is not None,
                              add_eos=getattr(tokenizer, "eos_id", None) is not None)
    _check_truncation(data, p, seq_len, context, truncate)
    return data


def _query_documents(p: Path) -> list:
    """Query documents: every line a JSON object with an ``id`` and a non-empty string
    ``text``; ``source`` and ``title`` optional (a query needs no other metadata).

    Raises:
        InputFileError: a line without a string ``text``, with an empty ``text``, without
            an ``id`` or with one repeated (file and line named).
    """
    docs, seen = [], set()
    for n, d in files.iter_json_lines(p, "--queries file", 'one {"id", "text"} object per line',
                                      _QUERY_FIX):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise InputFileError(f"--queries file {p}:{n}: expected a JSON object with a string "
                                 f"'text', got {str(d)[:60]}. Fix: {_QUERY_FIX}")
        if not d["text"].strip():
            state = "only whitespace" if d["text"] else "empty"
            raise InputFileError(f"--queries file {p}:{n}: the query's 'text' is {state}: there "
                                 f"is nothing to score. Fix: give the query its text, or "
                                 f"remove the line")
        docs.append(Document(_query_id(d, p, n, seen), str(d.get("source", "")),
                             str(d.get("title", "")), d["text"]))
    return docs


_QUERY_FIX = 'write one {"id": ..., "text": ...} object per line'


def _query_id(d: dict, p: Path, n: int, seen: set[str]) -> str:
    """The ``id`` of query line ``n`` (a non-empty string or an integer, not seen before).

    Raises:
        InputFileError: no id, an empty or non-scalar one, or one an earlier line has.
    """
    doc_id = d.get("id")
    if type(doc_id) not in (str, int) or not str(doc_id).strip():
        got = "no 'id'" if "id" not in d else f"the id {json.dumps(doc_id)[:40]}"
        raise InputFileError(f"--queries file {p}:{n}: the query has {got}; every query needs "
                             f"its own id (the scores, top-k and reports name queries by it). "
                             f"Fix: add \"id\": \"...\" (a non-empty string) to the line")
    doc_id = str(doc_id)
    if doc_id in seen:
        raise InputFileError(f"--queries file {p}:{n}: id '{doc_id}' repeats an earlier "
                             f"line. Fix: give every query its own id")
    seen.add(doc_id)
    return doc_id


def _query_token_ids(p: Path, max_docs: int | None) -> None:
    """Every token-id query line (up to ``max_docs``) has its own ``id`` (``_query_id``)."""
    seen: set[str] = set()
    for n, rec in files.iter_json_lines(p, "--queries file", _TOKEN_EXPECTED, _TOKEN_FIX):
        _query_id(rec, p, n, seen)
        if max_docs and len(seen) >= max_docs:
            return


def row_texts(data, tokenizer) -> list[str] | None:
    """The text each row of ``data`` holds: token-id rows their ``text`` field (None when
    one lacks it), text rows their tokens decoded (``tokenizer`` a Tokenizer or a callable
    returning one)."""
    if data.tokenizer_fingerprint == "token-ids":
        texts = [d.text for d in data.docs]
        return texts if all(t.strip() for t in texts) else None
    if callable(tokenizer) and not hasattr(tokenizer, "decode"):
        tokenizer = tokenizer()
    return data.texts(tokenizer)


def _check_truncation(data, p: Path, seq_len: int, context: int | None, truncate: bool) -> None:
    if not truncate and bool(data.truncated.any()):
        i = int(torch.nonzero(data.truncated)[0])
        raise ConfigError(
            f"Document '{data.docs[i].id}' of '{p}' is longer than {seq_len} tokens (the model "
            f"context{'' if context is None else f' is {context}'}): shorten it, or pass "
            f"--truncate to score its first {seq_len} tokens")


_TOKEN_EXPECTED = 'one {"id"?, "input_ids": [int, ...]} object per line'
_TOKEN_FIX = 'write one {"id": ..., "input_ids": [token ids]} object per line'


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether a jsonl file holds token ids (its first record has ``input_ids``); read
    through :mod:`dattri_ds.io.files`, so a file that is not JSON lines is an InputFileError
    naming the file and line."""
    first = files.first_json_line(path, "data file", "one JSON object per line (documents "
                                  "with 'text', or token ids with 'input_ids')",
                                  "give a jsonl file of documents or of token ids")
    return isinstance(first, dict) and "input_ids" in first


def _token_row(rec, p: Path, n: int, vocab_size: int | None) -> list[int]:
    ids = rec.get("input_ids") if isinstance(rec, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise InputFileError(f"token-id file {p}:{n}: expected \"input_ids\": a non-empty list "
                             f"of integer token ids, got {str(ids)[:60]}. Fix: {_TOKEN_FIX}")
    high = vocab_size if vocab_size is not None else float("inf")
    bad = next(((j, i) for j, i in enumerate(ids) if i < 0 or i >= high), None)
    if bad is not None:
        rng = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InputFileError(
            f"token-id file {p}:{n}: token id {bad[1]} at position {bad[0]} is out of range "
            f"(expected {rng}{', the model vocab_size' if vocab_size is not None else ''}). "
            f"Fix: tokenize with the model's own tokenizer")
    return ids


def load_token_ids(path: str | os.PathLike, seq_len: int, max_docs: int | None = None,
                   vocab_size: int | None = None):
    """TokenizedDocuments from token-id jsonl: ``{"id"?, "input_ids": [int, ...]}`` per line.

    Rows longer than ``seq_len`` are truncated (``truncated`` is set); shorter ones are
    right-padded with 0 (masked). Ids default to ``tokens-<line>``.

    Raises:
        InputFileError: the file is unreadable or not JSON lines, a line without an
            ``input_ids`` list of ints, an id outside ``[0, vocab_size)`` (``>= 0`` when the
            vocabulary size is unknown), or no rows.
    """
    p = Path(path)
    rows, docs = [], []
    for n, rec in files.iter_json_lines(p, "token-id file", _TOKEN_EXPECTED, _TOKEN_FIX):
        rows.append(_token_row(rec, p, n, vocab_size))
        docs.append(Document(str(rec.get("id", f"tokens-{n - 1}")), str(rec.get("source", "")),
                             str(rec.get("title", "")), str(rec.get("text", ""))))
        if max_docs and len(rows) >= max_docs:
            break
    if not rows:
        raise InputFileError(f"token-id file '{p}' holds no token rows (it is empty or blank). "
                             f"Fix: {_TOKEN_FIX}")
    input_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    truncated = torch.tensor([len(r) > seq_len for r in rows])
    for i, r in enumerate(rows):
        x = torch.tensor(r[:seq_len])
        input_ids[i, :len(x)], mask[i, :len(x)] = x, 1
    return TokenizedDocuments(input_ids, mask, input_ids.masked_fill(mask == 0, -100),
                              tuple(docs), truncated, "token-ids")
