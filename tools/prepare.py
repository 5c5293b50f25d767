"""Tokenize a corpus once into megatron-core's indexed dataset with a document table.

    dattri-ds prepare --input data/corpus/train.jsonl --output-prefix runs/data/corpus
    dattri-ds prepare --input 'shards/*.jsonl.zst' --tokenizer path/to/hf_model \
        --text-field content --output-prefix runs/data/web
    dattri-ds prepare --input hf_saved_dataset/ --tokenizer tokenizer.model --workers 16 ...

Reads jsonl (also .gz/.zst), parquet, Arrow, a datasets save_to_disk folder, a folder of
shards or a quoted glob; tokenizes with a Hugging Face tokenizer folder, a SentencePiece
.model, or (no --tokenizer) a SentencePiece model trained once on a sample; writes
PREFIX.bin/.idx, PREFIX.docs/, PREFIX.tokenizer/ and, last, PREFIX.manifest.json. A rerun
after a crash resumes; a rerun of a finished prepare does nothing (docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dattri_ds.data.prepare import PrepareConfig, prepare  # noqa: E402
from dattri_ds.tools.configs import Flag, add_flags, values  # noqa: E402

#: Every PrepareConfig field but the two required ones, as flags.
FLAGS = [Flag(PrepareConfig, f) for f in PrepareConfig.__dataclass_fields__
         if f not in ("input", "output_prefix")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="corpus files, folders of shards, save_to_disk folders or quoted globs")
    p.add_argument("--output-prefix", required=True,
                   help="PREFIX of PREFIX.bin/.idx/.docs/.tokenizer/.manifest.json")
    add_flags(p, FLAGS)
    p.add_argument("--force", dest="overwrite", action="store_true", default=argparse.SUPPRESS,
                   help="same as --overwrite (the name the other commands use)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.add_argument("--verbose", action="store_true", help="show third-party log lines")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from dattri_ds.cli.noise import setup_logging

    setup_logging(0, args.verbose)
    cfg = PrepareConfig(input=tuple(args.input), output_prefix=args.output_prefix,
                        **values(args, FLAGS, PrepareConfig))
    manifest = prepare(cfg)
    if args.json:
        print(json.dumps(manifest, indent=1))
    else:
        print(f"prepared {manifest['documents']} documents, {manifest['tokens']} tokens "
              f"({manifest['tokenizer']['kind']} tokenizer {manifest['tokenizer']['fingerprint']}"
              f", vocab {manifest['tokenizer']['vocab_size']}) -> {cfg.output_prefix}.bin/.idx "
              f"(fingerprint {manifest['fingerprint']})")
    return manifest


if __name__ == "__main__":
    main()
