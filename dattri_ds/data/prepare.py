"""``dattri-ds prepare``: a corpus read, tokenized once on every core, and written as
megatron-core's indexed dataset with a document table and a manifest, crash-safe.

Steps (:func:`prepare`):

1. the inputs are resolved and checked (:mod:`dattri_ds.data.read`) and hashed in blocks;
2. the tokenizer is opened, or trained once on a bounded sample (reservoir sampling over
   one pass of the corpus, seeded) and kept in the work folder;
3. the documents stream in chunks of ``chunk_docs`` rows to a pool of ``workers`` processes;
   each tokenizes its chunk (the document rule of :mod:`dattri_ds.data.tokenizers`) and
   writes the chunk's part files (an ``IndexedDatasetBuilder`` ``.bin``/``.idx`` and a
   document table part) under temporary names, fsynced, then renamed; the main process
   commits the chunks in order in ``progress.json`` (written atomically), at most
   ``2 * workers`` chunks ahead;
4. when every chunk is committed, the parts are merged (``IndexedDatasetBuilder.add_index``,
   as Megatron-LM's ``preprocess_data.py`` merges its partitions), the final files are
   renamed into place, the manifest is written last and the work folder removed.

A ``kill -9`` at any moment loses only uncommitted chunks: a rerun with the same inputs
and settings resumes after the last committed chunk (its rows skipped while reading), so no
document is lost or repeated. Nothing is read as complete before the manifest exists
(``open_prepared`` refuses a prefix whose work folder is there). A rerun of a finished
prepare with the same request does nothing; another request is refused unless
``overwrite``.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dattri_ds.data.prepared import FORMAT, FORMAT_VERSION, PreparedPaths, fingerprint_of
from dattri_ds.data.read import FieldMap, check_shards, describe_inputs, iter_batches, \
    resolve_inputs
from dattri_ds.data.tokenizers import CorpusTokenizer, TrainedSentencePiece, load_saved, \
    open_tokenizer
from dattri_ds.errors import InputFileError, OutputError
from dattri_ds.io.outputs import fsync_dir, write_json_atomic
from dattri_ds.io.schema import bounds

__all__ = ["PrepareConfig", "PrepareProgress", "prepare", "DOCUMENT_RULE", "usable_cores"]

logger = logging.getLogger(__name__)

#: The document rule, as recorded in the manifest.
DOCUMENT_RULE = "tokenizer ids with its own special tokens, then EOS unless already last"


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What ``dattri-ds prepare`` reads, how it tokenizes and where it writes."""

    input: tuple[str, ...]
    """Corpus files, folders of shards, save_to_disk folders or quoted globs."""

    output_prefix: str
    """Where to write: PREFIX.bin, PREFIX.idx, PREFIX.docs/, PREFIX.tokenizer/,
    PREFIX.manifest.json."""

    tokenizer: str | None = None
    """A Hugging Face tokenizer folder or a SentencePiece .model file (default: train a
    SentencePiece model once on a sample of the corpus)."""

    vocab_size: int = field(default=1024, metadata=bounds(ge=8))
    """Vocabulary of the trained tokenizer (without --tokenizer)."""

    tokenizer_type: Literal["bpe", "unigram", "char"] = "bpe"
    """SentencePiece model type of the trained tokenizer."""

    tokenizer_sample: int = field(default=20000, metadata=bounds(ge=1))
    """Documents the trained tokenizer learns from: a seeded uniform sample of the corpus
    (all of them when it has fewer)."""

    text_field: str = "text"
    """Input column of the document text."""

    id_field: str = "id"
    """Input column of the document id (string or integer; absent: <file>:<row>)."""

    source_field: str = "source"
    """Input column of the domain label (absent: empty)."""

    title_field: str = "title"
    """Input column of the title (absent: empty)."""

    workers: int | None = field(default=None, metadata=bounds(ge=1))
    """Tokenizing processes (default: every core this process may use)."""

    chunk_docs: int = field(default=4096, metadata=bounds(ge=1))
    """Documents per committed chunk (a kill -9 loses at most the chunks in flight)."""

    seed: int = 0
    """Seed of the tokenizer's training sample."""

    overwrite: bool = False
    """Replace a prepared corpus (or an unfinished prepare) of other inputs or settings."""

    max_docs: int | None = field(default=None, metadata=bounds(ge=1))
    """Prepare only the first N documents (reading stops there: the inputs are not hashed
    whole, the fingerprint hashes the documents read); null = all."""

    @property
    def fields(self) -> FieldMap:
        return FieldMap(self.text_field, self.id_field, self.source_field, self.title_field)

    def n_workers(self) -> int:
        return self.workers or usable_cores()


@dataclass(frozen=True)
class PrepareProgress:
    """Where a prepare stands (passed to the ``progress`` callback after each commit)."""

    documents: int
    tokens: int
    chunks: int
    seconds: float


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


# ---- the work folder ----------------------------------------------------------------------

@dataclass
class _Work:
    """The work folder: ``progress.json`` (``parts``: ``[documents, tokens, bytes of each of
    PART_FILES]`` per committed chunk) and the committed parts ``part-<k>.*``."""

    folder: Path
    state: dict

    PART_FILES = (".bin", ".idx", ".docs.npz")

    def part(self, k: int, ext: str = "") -> Path:
        return self.folder / f"part-{k:06d}{ext}"

    @property
    def parts(self) -> list[list[int]]:
        return self.state["parts"]

    @property
    def documents(self) -> int:
        return sum(p[0] for p in self.parts)

    @property
    def tokens(self) -> int:
        return sum(p[1] for p in self.parts)

    def commit(self, result: dict) -> None:
        if result["part"] != len(self.parts):
            raise RuntimeError(f"part {result['part']} committed out of order")
        self.parts.append([result["docs"], result["tokens"],
                           *(result["sizes"][e] for e in self.PART_FILES)])
        self.save()

    def save(self) -> None:
        write_json_atomic(self.folder / "progress.json", self.state)

    def check_and_clean(self) -> None:
        """Committed parts must be there with their recorded sizes; every other file of a
        part (uncommitted, or a temporary one of a killed worker) is removed."""
        keep = {self.part(k, e).name for k in range(len(self.parts)) for e in self.PART_FILES}
        for k, rec in enumerate(self.parts):
            for ext, size in zip(self.PART_FILES, rec[2:]):
                p = self.part(k, ext)
                if not p.is_file() or p.stat().st_size != size:
                    raise InputFileError(f"prepare work folder '{self.folder}': committed part "
                                         f"{p.name} is missing or has another size. Fix: pass "
                                         f"--overwrite to start over")
        for p in self.folder.glob("part-*"):
            if p.name not in keep:
                p.unlink()


def _request(cfg: PrepareConfig, inputs: list[dict], tok: CorpusTokenizer | None) -> dict:
    """What determines the output (paths excluded: a moved corpus is the same corpus)."""
    tokenizer = ({"fingerprint": tok.fingerprint} if tok is not None else
                 {"train": {"vocab_size": cfg.vocab_size, "model_type": cfg.tokenizer_type,
                            "sample_docs": cfg.tokenizer_sample, "seed": cfg.seed}})
    return {"format_version": FORMAT_VERSION, "fields": asdict(cfg.fields),
            "inputs": [{k: f[k] for k in ("name", "size", "blake2b", "mtime_ns") if k in f}
                       for f in inputs], "max_docs": cfg.max_docs,
            "tokenizer": tokenizer, "document_rule": DOCUMENT_RULE}


def _finished(paths: PreparedPaths, request: str, overwrite: bool) -> dict | None:
    """The manifest when this request is already prepared; else clear the way (or refuse)."""
    from dattri_ds.io.files import read_json

    fix = f"pass --overwrite to replace it, or another --output-prefix than {paths.prefix}"
    if paths.manifest.exists():
        m = read_json(paths.manifest, "prepared corpus manifest")
        had = m.get("request") if isinstance(m, dict) else None
        if had == request and not overwrite:
            return m
        if not overwrite:
            raise OutputError(f"{paths.prefix} already holds a prepared corpus of other inputs "
                              f"or settings (request {had}, now {request}). Fix: {fix}")
        paths.manifest.unlink()  # first: the old files no longer read as complete
        fsync_dir(paths.manifest.parent)
        shutil.rmtree(paths.work, ignore_errors=True)
    elif not paths.work.exists() and (paths.bin.exists() or paths.idx.exists()) and not overwrite:
        raise OutputError(f"{paths.bin} / {paths.idx} exist and were not written by a finished "
                          f"prepare. Fix: {fix}")
    return None


def _open_work(paths: PreparedPaths, request: str, cfg: PrepareConfig) -> _Work:
    progress = paths.work / "progress.json"
    if progress.exists():
        from dattri_ds.io.files import read_json

        state = read_json(progress, "prepare progress record")
        if isinstance(state, dict) and state.get("request") == request:
            work = _Work(paths.work, state)
            work.check_and_clean()
            logger.info("prepare: resuming %s after %d committed documents (%d chunks)",
                        paths.prefix, work.documents, len(work.parts))
            return work
        if not cfg.overwrite:
            raise OutputError(f"{paths.work} holds an unfinished prepare of other inputs or "
                              f"settings. Fix: pass --overwrite to discard it, or another "
                              f"--output-prefix")
    shutil.rmtree(paths.work, ignore_errors=True)
    paths.work.mkdir(parents=True)
    work = _Work(paths.work, {"format_version": FORMAT_VERSION, "request": request,
                              "chunk_docs": cfg.chunk_docs, "tokenizer": None, "parts": []})
    work.save()
    return work


# ---- the tokenizer ------------------------------------------------------------------------

def _sample_texts(files, fields: FieldMap, n: int, seed: int, limit: int | None = None
                  ) -> tuple[list[str], int]:
    """A uniform sample of ``n`` texts of the first ``limit`` documents (reservoir sampling,
    one pass), in corpus order, and the number of documents seen."""
    rng = np.random.default_rng(seed)
    slots: list[tuple[int, str]] = []
    seen = 0
    for batch in iter_batches(files, fields, limit=limit):
        texts = batch.column("text")
        m = batch.num_rows
        fill = min(max(n - seen, 0), m)
        slots += [(seen + i, texts[i].as_py()) for i in range(fill)]
        if fill < m:
            rows = np.arange(seen + fill, seen + m)
            j = rng.integers(0, rows + 1)
            for h in np.nonzero(j < n)[0]:
                slots[int(j[h])] = (int(rows[h]), texts[fill + int(h)].as_py())
        seen += m
    return [t for _, t in sorted(slots)], seen


def _trained(cfg: PrepareConfig, files, work: _Work) -> CorpusTokenizer:
    """The tokenizer trained on a sample (once: kept in the work folder for a resume)."""
    saved = work.state.get("tokenizer")
    if saved:
        return load_saved(work.folder / "tokenizer", saved)
    t0 = time.perf_counter()
    texts, seen = _sample_texts(files, cfg.fields, cfg.tokenizer_sample, cfg.seed,
                                cfg.max_docs)
    if seen == 0:
        raise InputFileError(f"the corpus {list(cfg.input)} holds no document. Fix: pass "
                             f"files with at least one row")
    tok = TrainedSentencePiece.train(
        texts, vocab_size=cfg.vocab_size, model_type=cfg.tokenizer_type,
        cache_dir=work.folder / "cache",
        sample={"sample_docs": len(texts), "corpus_docs": seen, "seed": cfg.seed})
    tok.save(work.folder / "tokenizer")
    work.state["tokenizer"] = tok.describe()
    work.save()
    logger.info("prepare: trained a %s tokenizer (vocab %d) on %d of %d documents in %.1f s",
                cfg.tokenizer_type, tok.vocab_size, len(texts), seen, time.perf_counter() - t0)
    return tok


# ---- chunks and workers -------------------------------------------------------------------

def _chunks(batches: Iterator[Any], size: int) -> Iterator[Any]:
    """Record batches of exactly ``size`` rows (the last one shorter)."""
    import pyarrow as pa

    held, rows = [], 0
    for batch in batches:
        held.append(batch)
        rows += batch.num_rows
        while rows >= size:
            table = pa.Table.from_batches(held).combine_chunks()
            yield table.slice(0, size).to_batches()[0]
            rest = table.slice(size)
            held, rows = rest.to_batches(), rest.num_rows
    if rows:
        yield pa.Table.from_batches(held).combine_chunks().to_batches()[0]


_WORKER: dict[str, Any] = {}


def _init_worker(tok: CorpusTokenizer, dtype: Any, pool: bool = True) -> None:
    """This process's tokenizer (one thread); a pool worker also dies with its parent."""
    if pool:
        try:  # Linux: a worker dies with prepare (kill -9 of the parent leaves no orphan)
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass
    tok.set_threads(1)
    _WORKER.update(tok=tok, dtype=dtype)


def _fsynced_replace(tmp: Path, final: Path) -> int:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final.stat().st_size


def _write_chunk(folder: str, k: int, batch: Any) -> dict:
    """Tokenize chunk ``k`` and write its part files (temporary names, fsynced, renamed)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from dattri_ds.data.doctable import write_part

    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    docs = tok.encode_documents(batch.column("text").to_pylist())
    work = _Work(Path(folder), {})
    tmp = {e: work.part(k, f"{e}.{os.getpid()}.tmp") for e in _Work.PART_FILES}
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
    for ids in docs:
        builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
    builder.finalize(str(tmp[".idx"]))
    lengths = [len(ids) for ids in docs]
    write_part(tmp[".docs.npz"], batch, lengths)
    sizes = {e: _fsynced_replace(tmp[e], work.part(k, e)) for e in _Work.PART_FILES}
    fsync_dir(work.folder)
    return {"part": k, "docs": len(docs), "tokens": int(sum(lengths)), "sizes": sizes}


class _Runner:
    """Chunks to workers (a fork pool, or this process for one worker), results in order.
    The pool starts with the second chunk: a corpus of one chunk is tokenized here."""

    def __init__(self, tok: CorpusTokenizer, dtype: Any, workers: int) -> None:
        self.pool, self.tok, self.dtype, self.workers = None, tok, dtype, workers
        self._env = os.environ.get("TOKENIZERS_PARALLELISM")  # restored by close()
        self.held: tuple | None = None  # the first chunk, until a second one comes
        self.ahead = 2 * workers
        self.pending: deque = deque()

    def submit(self, folder: str, k: int, batch: Any) -> Iterator[dict]:
        """Queue chunk ``k``; yields the results that are due, in order."""
        if self.workers > 1 and self.pool is None:
            if self.held is None:
                self.held = (folder, k, batch)
                return
            import multiprocessing as mp

            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the fork
            self.pool = mp.get_context("fork").Pool(self.workers, _init_worker,
                                                    (self.tok, self.dtype))
            self.pending.append(self.pool.apply_async(_write_chunk, self.held))
            self.held = None
        if self.pool is None:
            _init_worker(self.tok, self.dtype, pool=False)
            yield _write_chunk(folder, k, batch)
            return
        self.pending.append(self.pool.apply_async(_write_chunk, (folder, k, batch)))
        while len(self.pending) >= self.ahead:
            yield self.pending.popleft().get()

    def drain(self) -> Iterator[dict]:
        if self.held is not None:  # the only chunk
            _init_worker(self.tok, self.dtype, pool=False)
            yield _write_chunk(*self.held)
            self.held = None
        while self.pending:
            yield self.pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        if self._env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._env


def _tokenize(cfg: PrepareConfig, files, tok: CorpusTokenizer, work: _Work, dtype: Any,
              progress: Callable[[PrepareProgress], None] | None) -> None:
    t0, last = time.perf_counter(), 0.0
    done0 = work.documents

    def commit(result: dict) -> None:
        nonlocal last
        work.commit(result)
        now = time.perf_counter() - t0
        state = PrepareProgress(work.documents, work.tokens, len(work.parts), now)
        if progress is not None:
            progress(state)
        if now - last >= 10:
            last = now
            rate = (work.documents - done0) / max(now, 1e-9)
            logger.info("prepare: %d documents, %d tokens, %d chunks committed (%.0f docs/s)",
                        work.documents, work.tokens, len(work.parts), rate)

    chunks = _chunks(iter_batches(files, cfg.fields, skip=work.documents, limit=cfg.max_docs),
                     work.state["chunk_docs"])
    runner = _Runner(tok, dtype, cfg.n_workers())
    try:
        for k, batch in enumerate(chunks, start=len(work.parts)):
            for result in runner.submit(str(work.folder), k, batch):
                commit(result)
        for result in runner.drain():
            commit(result)
    finally:
        runner.close()
    if work.documents == 0:
        raise InputFileError(f"the corpus {list(cfg.input)} holds no document. Fix: pass "
                             f"files with at least one row")


# ---- finishing ----------------------------------------------------------------------------

def _merge(paths: PreparedPaths, work: _Work, dtype: Any) -> dict[str, Path]:
    """The final files under temporary names beside the prefix (fsynced)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from dattri_ds.data.doctable import merge_parts

    tmp = {k: paths.prefix.with_name(f".{paths.name}.{k}.{os.getpid()}.tmp")
           for k in ("bin", "idx", "docs", "tokenizer")}
    builder = IndexedDatasetBuilder(str(tmp["bin"]), dtype=dtype)
    gc.freeze()  # add_index runs gc.collect() per part: over torch's heap, 0.5 s each
    try:
        for k in range(len(work.parts)):
            builder.add_index(str(work.part(k)))
        builder.finalize(str(tmp["idx"]))
    finally:
        gc.unfreeze()
    for k in ("bin", "idx"):
        with open(tmp[k], "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(tmp["docs"], ignore_errors=True)
    merge_parts([work.part(k, ".docs.npz") for k in range(len(work.parts))], work.documents,
                tmp["docs"])
    return tmp


def _refuse_duplicate_ids(folder: Path, cfg: PrepareConfig) -> None:
    from dattri_ds.data.doctable import DocumentTable

    dups = DocumentTable(folder).duplicate_ids()
    if dups:
        shown = ", ".join(f"'{i}' (documents {a} and {b})" for i, a, b in dups)
        raise InputFileError(f"the corpus {list(cfg.input)} repeats document ids: {shown}. Fix: "
                             f"make the '{cfg.id_field}' values unique, or map --id-field to a "
                             f"column that is absent so ids are <file>:<row>")


def _read_rows(docs: Path, max_docs: int) -> dict:
    """What a prepare of the first ``max_docs`` rows read: the digest of its documents' id
    and text hashes (the inputs were not hashed whole)."""
    from dattri_ds.data.doctable import DocumentTable

    table, h = DocumentTable(docs), hashlib.blake2b(digest_size=16)
    for arr in (table.id_hash, table.text_hash):
        h.update(np.ascontiguousarray(arr).tobytes())
    return {"max_docs": max_docs, "documents": h.hexdigest()}


def _manifest(cfg: PrepareConfig, inputs: list[dict], tok: CorpusTokenizer, request: str,
              work: _Work, dtype: Any, paths: PreparedPaths, docs: Path) -> dict:
    ids_from = (f"<file>:<row> (the inputs have no '{cfg.id_field}' field)"
                if work.state.get("ids_generated") else f"field '{cfg.id_field}'")
    data: Any = [{k: f[k] for k in ("name", "size", "blake2b")} for f in inputs]
    if cfg.max_docs is not None:
        data = {"files": data, "rows": _read_rows(docs, cfg.max_docs)}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint_of({"data": data, "fields": asdict(cfg.fields),
                                       "tokenizer": tok.fingerprint, "rule": DOCUMENT_RULE,
                                       "format_version": FORMAT_VERSION}),
        "request": request, "inputs": inputs, "fields": asdict(cfg.fields), "ids": ids_from,
        "tokenizer": tok.describe(), "document_rule": DOCUMENT_RULE,
        "dtype": np.dtype(dtype).name, "documents": work.documents, "tokens": work.tokens,
        "chunks": len(work.parts), "chunk_docs": work.state["chunk_docs"],
        "files": {k: getattr(paths, k).name for k in ("bin", "idx", "docs", "tokenizer")},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _finish(cfg: PrepareConfig, paths: PreparedPaths, work: _Work, tok: CorpusTokenizer,
            inputs: list[dict], request: str, dtype: Any) -> dict:
    tmp = _merge(paths, work, dtype)
    _refuse_duplicate_ids(tmp["docs"], cfg)
    shutil.rmtree(tmp["tokenizer"], ignore_errors=True)
    tok.save(tmp["tokenizer"])
    for k in ("bin", "idx", "docs", "tokenizer"):  # the manifest is absent: none reads these
        final = getattr(paths, k)
        if final.is_dir():
            shutil.rmtree(final)
        os.replace(tmp[k], final)
    fsync_dir(paths.prefix.parent)
    manifest = _manifest(cfg, inputs, tok, request, work, dtype, paths, paths.docs)
    write_json_atomic(paths.manifest, manifest)  # last: from here the corpus reads as complete
    shutil.rmtree(paths.work)
    return manifest


def prepare(cfg: PrepareConfig, *,
            progress: Callable[[PrepareProgress], None] | None = None) -> dict:
    """Prepare the corpus ``cfg.input`` at ``cfg.output_prefix`` (or resume, or find it
    done); returns its manifest.

    Args:
        cfg: the inputs, tokenizer, field mapping, workers and output prefix.
        progress: called after every committed chunk (prepare also logs a line every 10 s).

    Raises:
        InputFileError: a damaged or mismatched input or tokenizer (one line, file and fix
            named); an empty corpus; repeated ids.
        OutputError: the prefix holds another prepared corpus and ``overwrite`` is off.
    """
    from megatron.core.datasets.indexed_dataset import DType

    from dattri_ds.io.outputs import check_dir

    paths = PreparedPaths.of(cfg.output_prefix)
    check_dir(paths.prefix.parent, flag="the folder of --output-prefix")
    files = resolve_inputs(cfg.input)
    plans = check_shards(files, cfg.fields)
    given = open_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else None
    inputs = describe_inputs(files, whole=cfg.max_docs is None)
    request = fingerprint_of(_request(cfg, inputs, given))
    done = _finished(paths, request, cfg.overwrite)
    if done is not None:
        logger.info("prepare: %s is already prepared (%d documents, %d tokens)", paths.prefix,
                    done["documents"], done["tokens"])
        return done
    work = _open_work(paths, request, cfg)
    work.state["ids_generated"] = all(cfg.id_field not in p for p in plans if p)
    tok = given if given is not None else _trained(cfg, files, work)
    dtype = DType.optimal_dtype(tok.vocab_size)
    t0 = time.perf_counter()
    _tokenize(cfg, files, tok, work, dtype, progress)
    t1 = time.perf_counter()
    manifest = _finish(cfg, paths, work, tok, inputs, request, dtype)
    logger.info("prepare: %d documents, %d tokens -> %s.bin/.idx (tokenized in %.1f s, "
                "merged %d chunks in %.1f s)", manifest["documents"], manifest["tokens"],
                paths.prefix, t1 - t0, manifest["chunks"], time.perf_counter() - t1)
    return manifest
