"""Small synthetic corpora and tokenizers for the prepare / packed-dataset tests.

``documents(n)`` makes deterministic rows ``{"id", "source", "title", "text"}`` of varied
length (some multi-line, some with non-ASCII characters); ``write_jsonl`` writes them;
``hf_folder`` saves a small byte-level BPE Hugging Face tokenizer (trained offline by the
``tokenizers`` library) and ``spm_file`` a SentencePiece model trained by dattri-ds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the", "data", "model", "attribution", "gradient", "token", "window", "corpus",
         "shard", "tokenizer", "λ", "naïve", "def", "return", "x", "=", "(", ")", "\n")
SOURCES = ("web", "code", "books")


def documents(n: int, seed: int = 0, min_words: int = 1, max_words: int = 60,
              id_prefix: str = "doc") -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(min_words, max_words)
        text = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append({"id": f"{id_prefix}-{i}", "source": SOURCES[i % 3],
                    "title": f"title {i % 7}", "text": text})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def hf_folder(path: Path, texts: list[str], *, template: str | None = None,
              vocab_size: int = 300) -> Path:
    """A ``PreTrainedTokenizerFast`` folder (bos ``<s>``, eos ``</s>``, pad ``<pad>``);
    ``template``: a TemplateProcessing single-sequence template, e.g. ``"<s> $A"``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if template is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", tk.token_to_id("<s>")),
                                             ("</s>", tk.token_to_id("</s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.save_pretrained(str(path))
    return path


def spm_file(path: Path, texts: list[str], vocab_size: int = 120) -> Path:
    """A SentencePiece ``.model`` (dattri-ds's trainer: pad 0, unk 1, bos 2, eos 3)."""
    from dattri_ds.data.tokenizer import train_tokenizer

    tok = train_tokenizer(texts, vocab_size=vocab_size, cache_dir=path.parent / "spm-cache")
    return tok.save(path)
