"""The run's training data: corpora prepared once, read memory-mapped, and their tokenizer.

    python launch/train.py ... --data-path runs/data/corpus      # a dattri-ds prepare prefix
    python launch/train.py ... --data-path 0.7 runs/data/web 0.3 runs/data/code
    python launch/train.py ... --train-data data/corpus/train.jsonl   # prepared here, once

``--data-path`` trains on prepared corpora as they are (Megatron-LM ``.bin``/``.idx``
prefixes too). ``--train-data`` (anything ``dattri-ds prepare`` reads) is prepared by rank 0
into ``<out>/data/<name>-<key>`` while the other ranks wait (``key`` hashes the inputs'
paths, sizes and modification times, ``--max-docs`` and the tokenizer: a resumed or
restarted run of the same ``--out`` reads it again without preparing). Either way
``PackedDataset`` (dattri_ds/data/packed.py) reads it: ``--seq-len`` windows or chunks, each
naming its documents.

The tokenizer (``named_tokenizer``): ``--tokenizer``, else the ``--model-path`` folder's,
else the ``--init-from`` run's copy (``run_tokenizer_path``), else the corpus's own (saved
with a prepared corpus; for ``--train-data``, one SentencePiece model of ``--vocab-size``
trained once by prepare on a sample). ``check_data`` refuses at start, one line each: inputs
that cannot be read, a tokenizer other than the prepared corpus's, a Megatron-LM prefix
without one, a tokenizer with more ids than the model's embeddings. ``data_record`` is the
run's data identity (checkpoints, stores, ``data.json``); ``check_overlap`` counts held-out
texts that are training documents.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from dattri_ds.data.doctable import hash64
from dattri_ds.data.packed import PackedDataset, blend_weight, parse_blend
from dattri_ds.data.prepared import PreparedPaths, fingerprint_of, open_prepared
from dattri_ds.data.tokenizers import HF_TOKENIZER_FILES, CorpusTokenizer, HFTokenizerFolder, \
    load_saved, open_tokenizer
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig, TrainConfig
from dattri_ds.launch.evaluate import text_reads

__all__ = ["named_tokenizer", "run_tokenizer_path", "save_run_tokenizer", "check_data",
           "training_data", "data_record", "data_source", "check_overlap", "start_vocab"]

logger = logging.getLogger("dattri_ds.launch")

#: A ``data_source`` key -> the flags that set it (named in a refused resume).
SOURCE_FLAGS = {"train_data": "--train-data", "max_docs": "--max-docs",
                "data_path": "--data-path", "tokenizer": "--tokenizer / --model-path / "
                "--init-from / --vocab-size", "seq_len": "--seq-len", "packing": "--packing"}


def run_tokenizer_path(run: str | os.PathLike) -> Path:
    """Where a launch/train.py run keeps its tokenizer's copy: ``model/`` (Hugging Face files
    beside its config) or ``tokenizer.model`` (SentencePiece)."""
    hf = Path(run) / "model"
    return hf if any((hf / f).is_file() for f in HF_TOKENIZER_FILES[:2]) else \
        Path(run) / "tokenizer.model"


def save_run_tokenizer(tok: CorpusTokenizer, out: Path) -> None:
    """The run's copy of its tokenizer, where ``run_tokenizer_path`` finds it (``--init-from``
    and the offline tools read it)."""
    tok.save(out / "model" if isinstance(tok, HFTokenizerFolder) else out)


def named_tokenizer(tc: TrainConfig) -> tuple[str, str] | None:
    """``(path, flag)`` of the tokenizer a flag names; None when the corpus brings its own
    (or prepare trains one)."""
    if tc.tokenizer:
        return tc.tokenizer, "--tokenizer"
    if tc.model_path:
        if not any((Path(tc.model_path) / f).is_file() for f in HF_TOKENIZER_FILES[:2]):
            raise ConfigError(f"--model-path {tc.model_path} holds no tokenizer (tokenizer.json "
                              f"or tokenizer_config.json) to tokenize the training data with. "
                              f"Fix: pass --tokenizer PATH (the model's tokenizer folder or "
                              f"SentencePiece .model)")
        return tc.model_path, "--model-path"
    if tc.init_from:
        return str(run_tokenizer_path(tc.init_from)), "--init-from"
    return None


@functools.lru_cache(maxsize=4)
def _tokenizer_at(path: str) -> CorpusTokenizer:
    """The tokenizer at ``path``, opened once per process (start checks and training)."""
    return open_tokenizer(path)


def _corpus_tokenizer(prefixes: list[str]) -> tuple[dict, Path] | None:
    """The tokenizer record of the first corpus with a manifest, and its saved copy."""
    for p in prefixes:
        c = open_prepared(p)
        if c.manifest is not None:
            return c.manifest["tokenizer"], c.paths.tokenizer
    return None


def check_data(cfg: RunConfig) -> None:
    """Open what the run will read, at start: the prepared corpora (their files and
    manifests) or the first rows of every ``--train-data`` file, the named tokenizer; then
    compare the tokenizer with the corpus's and the model's embeddings.

    Raises:
        InputFileError / ConfigError: one line naming the input, both sides and the fix.
    """
    from dattri_ds.data.read import FieldMap, check_shards, resolve_inputs

    tc = cfg.train
    named = named_tokenizer(tc)
    tok = _tokenizer_at(named[0]) if named else None
    if tc.data_path is None:
        check_shards(resolve_inputs(tc.train_data), FieldMap())
        _check_vocab(tc, tok.vocab_size if tok else tc.vocab_size,
                     f"{named[1]} {named[0]}" if named else f"--vocab-size {tc.vocab_size}")
        return
    prefixes, _ = parse_blend(tc.data_path)
    found = _corpus_tokenizer(prefixes)
    if found is None and tok is None:
        raise ConfigError(f"--data-path {' '.join(tc.data_path)}: a Megatron-LM prefix records "
                          f"no tokenizer. Fix: pass --tokenizer PATH (the one it was made with) "
                          f"or --model-path")
    if found is not None and tok is not None and tok.fingerprint != found[0]["fingerprint"]:
        raise ConfigError(f"--data-path {prefixes[0]} was prepared with the tokenizer "
                          f"{found[0]['source']} ({found[0]['fingerprint']}, vocab "
                          f"{found[0]['vocab_size']}), {named[1]} {named[0]} tokenizes with "
                          f"{tok.fingerprint} (vocab {tok.vocab_size}): its ids would be read "
                          f"as another tokenizer's. Fix: prepare the corpus with --tokenizer "
                          f"{named[0]}, or drop {named[1]}")
    _check_vocab(tc, tok.vocab_size if tok else found[0]["vocab_size"],
                 f"{named[1]} {named[0]}" if named else f"the tokenizer of {prefixes[0]}")


def _check_vocab(tc: TrainConfig, vocab: int, where: str) -> None:
    """Raises: ConfigError: the tokenizer has more ids than ``--model-path``'s embeddings."""
    if not tc.model_path:
        return  # a model built here takes the tokenizer's vocabulary
    from dattri_ds.io.files import read_json

    have = read_json(Path(tc.model_path) / "config.json", "--model-path config").get("vocab_size")
    if isinstance(have, int) and vocab > have:
        raise ConfigError(f"the tokenizer ({where}) has {vocab} ids, the embeddings of "
                          f"--model-path {tc.model_path} hold {have} (vocab_size in its "
                          f"config.json): ids {have}..{vocab - 1} would index past them. Fix: "
                          f"tokenize with the model's own tokenizer (drop --tokenizer: "
                          f"--model-path reads its folder's), or one of at most {have} ids")


def start_vocab(tc: TrainConfig) -> int | None:
    """The vocabulary a model built from ``--model-config`` gets, known at start without
    preparing anything: the prepared corpus's or the named tokenizer's (None when it cannot
    be read: its own error follows)."""
    try:
        named = named_tokenizer(tc)
        if named:
            return _tokenizer_at(named[0]).vocab_size
        if tc.data_path is not None:
            found = _corpus_tokenizer(parse_blend(tc.data_path)[0])
            return None if found is None else int(found[0]["vocab_size"])
    except (ConfigError, OSError, ValueError):
        return None
    return tc.vocab_size


# ---- the data, prepared once and opened --------------------------------------------------

def cache_prefix(cfg: RunConfig, out: Path) -> Path:
    """``<out>/data/<name>-<key>``: where ``--train-data`` is prepared (module docstring)."""
    from dattri_ds.data.read import resolve_inputs

    tc, named = cfg.train, named_tokenizer(cfg.train)
    files = resolve_inputs(tc.train_data)
    key = fingerprint_of({
        "inputs": [[str(f.path.resolve()), f.size, f.path.stat().st_mtime_ns] for f in files],
        "max_docs": tc.max_docs,
        "tokenizer": _tokenizer_at(named[0]).fingerprint if named else tc.vocab_size})
    return out / "data" / f"{files[0].path.name.split('.')[0]}-{key[:16]}"


def _prepared(cfg: RunConfig, out: Path, rank: int) -> str:
    """Rank 0 prepares ``--train-data`` (unless done); every rank gets the prefix, or rank 0's
    error."""
    from dattri_ds.data.prepare import PrepareConfig, prepare

    tc, prefix, error = cfg.train, cache_prefix(cfg, out), None
    if rank == 0 and not PreparedPaths.of(prefix).manifest.exists():
        named = named_tokenizer(tc)
        try:
            prefix.parent.mkdir(parents=True, exist_ok=True)
            prepare(PrepareConfig(input=tuple(tc.train_data), output_prefix=str(prefix),
                                  tokenizer=named[0] if named else None,
                                  vocab_size=tc.vocab_size, max_docs=tc.max_docs))
        except Exception as e:  # noqa: BLE001 - every rank raises it, none waits forever
            error = e
    sent = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(sent, src=0)
    if sent[0] is not None:
        raise sent[0]
    return str(prefix)


def training_data(cfg: RunConfig, out: Path, rank: int) -> tuple[PackedDataset, CorpusTokenizer]:
    """The run's examples (``PackedDataset``, indices built by rank 0) and tokenizer."""
    tc = cfg.train
    path = tc.data_path if tc.data_path is not None else (_prepared(cfg, out, rank),)
    data = PackedDataset(list(path), tc.seq_len, packing=tc.packing)
    named = named_tokenizer(tc)
    if named:
        tok = _tokenizer_at(named[0])
    else:
        desc, folder = _corpus_tokenizer([str(c.paths.prefix) for c in data.corpora])
        tok = load_saved(folder, desc)
    if rank == 0:
        info = data.describe()
        logger.info("data: %d examples of %d tokens (%s), %d tokens, padding %.4f%%, "
                    "tokenizer %s (vocab %d)", info["examples"], data.seq_len, data.packing,
                    info["tokens"], 100 * info["padding_share"], tok.fingerprint,
                    tok.vocab_size)
    return data, tok


# ---- identity ------------------------------------------------------------------------------

def data_record(data: Any, tok: Any) -> dict[str, Any] | None:
    """The run's data identity, recorded by checkpoints (``run_record``), stores and
    ``data.json``: the examples' fingerprint (corpora, ``seq_len``, packing, seed), the
    tokenizer's, and how to open them again (``data_path``, ``seq_len``, ``packing``,
    ``seed``). None for examples a caller tokenized itself (``train_in_process``)."""
    if not isinstance(data, PackedDataset):
        return None
    return data.record(tok.fingerprint)


def data_source(tc: TrainConfig) -> dict[str, Any]:
    """What the flags name as the run's data (compared at start by ``--resume``; the
    fingerprints of ``data_record`` are compared once the data is open)."""
    def paths(items):
        return None if items is None else [x if blend_weight(x) is not None else os.path.abspath(x)
                                           for x in items]
    named = named_tokenizer(tc)
    return {"train_data": paths(tc.train_data), "max_docs": tc.max_docs,
            "data_path": paths(tc.data_path), "seq_len": tc.seq_len, "packing": tc.packing,
            "tokenizer": os.path.abspath(named[0]) if named else f"trained, vocab "
                                                                 f"{tc.vocab_size}"}


def check_overlap(cfg: RunConfig, data: PackedDataset, rank: int) -> None:
    """Count the documents of the selection target and of the held-out sets whose text is a
    training document's too (the document table's ``text_hash``): a note for the target,
    refused for held-out sets unless ``allow_eval_overlap``.

    Raises:
        ConfigError: naming the file, the count and the flag.
    """
    from dattri_ds.data.corpus import load_documents

    tables = [c.table for c in data.corpora if c.table is not None]
    for path, flag, rows, held_out in text_reads(cfg):
        docs = load_documents(path)[rows]
        mine = np.array([hash64(d.text.encode("utf-8")) for d in docs], dtype=np.uint64)
        found = set()
        for t in tables:
            for lo in range(0, len(t.text_hash), 1 << 20):  # 8 MB at a time
                chunk = np.asarray(t.text_hash[lo:lo + (1 << 20)])
                found.update(chunk[np.isin(chunk, mine)].tolist())
        n = int(np.isin(mine, np.array(sorted(found), dtype=np.uint64)).sum())
        if not n:
            continue
        what = f"{flag} {path}: {n} of the {len(docs)} documents it reads are also training " \
               f"documents (the same text)"
        if held_out and not cfg.train.allow_eval_overlap:
            raise ConfigError(f"{what}, so the held-out loss would measure texts the run "
                              f"trains on. Fix: remove them from {path}, or pass "
                              f"--allow-eval-overlap to evaluate on them anyway")
        if rank == 0:
            logger.warning("%s%s", what, "" if held_out else ": selection scores candidates "
                           "against texts that are in the training stream")
