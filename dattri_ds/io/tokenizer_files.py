"""The file door for tokenizers: SentencePiece ``.model`` files and Hugging Face tokenizer
folders, checked before sentencepiece or transformers reads them.

Each failure is an :class:`~dattri_ds.errors.InputFileError` whose one line names the file,
what is wrong and the fix (docs/input_files.md). Two failures the libraries do not report:

* a SentencePiece model cut between two of its vocabulary pieces is a valid protobuf
  message, which sentencepiece loads as a smaller vocabulary without a word; the model's
  specs come after its pieces, so :func:`check_sentencepiece` refuses a model that ends
  before them;
* a Hugging Face folder without ``tokenizer.json`` whose vocabulary file is missing loads
  (transformers builds a tokenizer of its special tokens only) and encodes every text to
  nothing; :func:`load_hf_tokenizer` names the missing file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dattri_ds.errors import InputFileError
from dattri_ds.io.files import check_dir, check_file, read_json

__all__ = ["check_sentencepiece", "load_hf_tokenizer", "HF_TOKENIZER_JSON"]

#: JSON files of a Hugging Face tokenizer folder, read through the door when present.
HF_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json", "added_tokens.json")
#: ``vocab_files_names`` entries a slow tokenizer class cannot do without (others, such as a
#: Whisper normalizer, are optional).
_REQUIRED_VOCAB = ("vocab_file", "merges_file")
#: Fields of sentencepiece's ModelProto: pieces (repeated), trainer spec, normalizer spec.
_PIECES, _TRAINER, _NORMALIZER = 1, 2, 3
_MAX_MODEL_BYTES = 1 << 30


class _Damaged(Exception):
    """The bytes are not a protobuf message (why)."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf):
            raise _Damaged(f"it ends inside a record at byte {len(buf)} (cut off)")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise _Damaged(f"a malformed number at byte {i}")


def _top_fields(buf: bytes) -> list[int]:
    """The field numbers of a protobuf message's top-level records, in file order.

    Raises:
        _Damaged: a record runs past the end of the file or has an unknown wire type.
    """
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        kind = key & 7
        if kind == 0:
            _, i = _varint(buf, i)
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        elif kind == 2:
            n, i = _varint(buf, i)
            i += n
        else:
            raise _Damaged(f"a record of unknown type {kind} at byte {i}")
        if i > len(buf):
            raise _Damaged(f"it ends inside a record at byte {len(buf)} (cut off)")
        out.append(key >> 3)
    return out


def check_sentencepiece(path: str | os.PathLike, what: str = "SentencePiece model",
                        fix: str = "pass a whole tokenizer.model (copy it again)") -> Path:
    """``path`` if it is a whole SentencePiece model: a protobuf message read to its end,
    with vocabulary pieces followed by the normalizer spec that every trained model ends
    with (sentencepiece itself loads a model cut between two pieces). Read, not loaded.

    Raises:
        InputFileError: a path problem, an empty, cut or damaged file, or a model without
            pieces.
    """
    p = check_file(path, what, fix)
    size = p.stat().st_size
    if size == 0 or size > _MAX_MODEL_BYTES:
        problem = "is empty" if size == 0 else f"is {size} bytes, not a SentencePiece model"
        raise InputFileError(f"{what} '{p}' {problem}. Fix: {fix}")
    try:
        fields = _top_fields(p.read_bytes())
    except _Damaged as e:
        raise InputFileError(f"{what} '{p}' is not a whole SentencePiece model: {e}. "
                             f"Fix: {fix}") from None
    pieces = fields.count(_PIECES)
    if pieces == 0:
        raise InputFileError(f"{what} '{p}' holds no vocabulary pieces: it is not a "
                             f"SentencePiece model. Fix: {fix}")
    if _NORMALIZER not in fields:
        missing = ("its normalizer spec, which follows" if _TRAINER in fields else
                   "its trainer and normalizer specs, which follow")
        raise InputFileError(f"{what} '{p}' is cut off: it ends after {pieces} vocabulary "
                             f"pieces, before {missing} them in every SentencePiece model. "
                             f"Fix: {fix}")
    return p


def _tokenizer_class(folder: Path, config: Any):
    """The transformers tokenizer class ``tokenizer_config.json`` names (None: unnamed or
    unknown to the installed transformers)."""
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str):
        return None
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(name)
    except Exception:  # noqa: BLE001 - an unknown class is AutoTokenizer's to report
        return None


def _check_vocab_files(folder: Path, config: Any, what: str, file: str, fix: str) -> None:
    """Without ``tokenizer.json``, the vocabulary files of the named tokenizer class are
    present (and a SentencePiece one whole)."""
    cls = _tokenizer_class(folder, config)
    names = getattr(cls, "vocab_files_names", None) or {}
    for key in _REQUIRED_VOCAB:
        name = names.get(key)
        if name is None:
            continue
        f = folder / name
        if not f.exists() and not f.is_symlink():
            raise InputFileError(
                f"{what} '{folder}' has no {name}, the vocabulary file its "
                f"{cls.__name__} reads (tokenizer_config.json names that class and there is "
                f"no tokenizer.json): without it the tokenizer knows only its special tokens. "
                f"Fix: {fix}")
        if f.suffix in (".model", ".spm"):
            check_sentencepiece(f, file, fix)
        else:
            check_file(f, file, fix)


def load_hf_tokenizer(path: str | os.PathLike, what: str = "tokenizer folder",
                      fix: str = "save the tokenizer again with save_pretrained(path)"):
    """A Hugging Face tokenizer (``AutoTokenizer``, local files only) from a folder checked
    first: ``tokenizer.json`` or ``tokenizer_config.json`` present, every JSON file readable
    (:data:`HF_TOKENIZER_JSON`), without ``tokenizer.json`` the class's vocabulary files
    present and SentencePiece models whole; a tokenizer that loads with no vocabulary
    beyond its special tokens is refused.

    Raises:
        InputFileError: any of these, naming the folder or file and ``fix``.
    """
    folder = check_dir(path, what, fix)
    file = what.replace("folder", "file") if "folder" in what else f"{what} file"
    if not any((folder / f).is_file() for f in HF_TOKENIZER_JSON[:2]):
        raise InputFileError(f"{what} '{folder}' holds neither tokenizer.json nor "
                             f"tokenizer_config.json. Fix: {fix}")
    found = {}
    for name in HF_TOKENIZER_JSON:
        if (folder / name).exists() or (folder / name).is_symlink():
            found[name] = read_json(folder / name, file, fix=fix)
    if "tokenizer.json" not in found:
        _check_vocab_files(folder, found.get("tokenizer_config.json"), what, file, fix)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/...
        first = " ".join(str(e).split())[:160]
        raise InputFileError(f"{what} '{folder}' cannot be loaded by transformers' "
                             f"AutoTokenizer ({first}). Fix: {fix}") from None
    if len(tok) <= len(set(tok.all_special_ids)):
        raise InputFileError(f"{what} '{folder}' loads as a tokenizer of {len(tok)} special "
                             f"tokens and no vocabulary: its vocabulary file is missing. "
                             f"Fix: {fix}")
    return tok
