"""Data pipeline for the demo and launch/train.py: documents, tokenizer, examples; and corpora prepared once (``prepare``: megatron-core's indexed dataset with a document table)
trained on memory-mapped (``PackedDataset``), docs/data.md.

Not imported by ``import dattri_ds``. Importing this package needs only torch and numpy:
``sentencepiece``, ``transformers``, ``pyarrow`` and ``megatron.core`` are imported by the
functions that use them.

Example:
    >>> from dattri_ds.data import load_documents, train_tokenizer, tokenize_documents
    >>> from dattri_ds.models.causal_lm import build_model
    >>> docs = load_documents("data/tiny/train.jsonl")
    >>> tok = train_tokenizer([d.text for d in docs], vocab_size=512)
    >>> ds = tokenize_documents(docs, tok, seq_len=128)   # ds.input_ids: [N, T]
    >>> model = build_model("configs/model_gpt2_tiny.json", tokenizer=tok)
"""

from dattri_ds.data.corpus import (
    FIELDS, Document, iter_jsonl, load_documents, source_counts,
)
from dattri_ds.data.packed import PackedDataset, Span
from dattri_ds.data.prepare import PrepareConfig, prepare
from dattri_ds.data.prepared import open_prepared
from dattri_ds.data.read import FieldMap
from dattri_ds.data.tokenizer import (
    BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, UNK_ID, TokenizedDocuments, Tokenizer,
    default_cache_dir, tokenize_documents, train_tokenizer,
)

__all__ = [
    "Document", "FIELDS", "load_documents", "iter_jsonl", "source_counts",
    "Tokenizer", "TokenizedDocuments", "train_tokenizer", "tokenize_documents",
    "default_cache_dir", "PAD_ID", "UNK_ID", "BOS_ID", "EOS_ID", "IGNORE_INDEX",
    "prepare", "PrepareConfig", "FieldMap", "open_prepared", "PackedDataset", "Span",
]
