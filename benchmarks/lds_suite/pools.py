"""Check that the second data set's training pools are disjoint from the first pool and
from their queries (ids and SHA-256 of the text), and print each seed's sources.

Usage: python pools.py RUN_DIR [RUN_DIR ...]   (benchmarks/lds.py --repeats output folders whose
seed<s>/lds.json were run with --train-data data/corpus/train.jsonl --exclude-data
data/tiny/train.jsonl)
"""
from __future__ import annotations

import collections
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def docs(path: Path) -> dict[str, dict]:
    return {d["id"]: d for d in map(json.loads, path.read_text(encoding="utf-8").splitlines())
            if d}


def text_hash(d: dict) -> str:
    return hashlib.sha256(d["text"].encode("utf-8")).hexdigest()


def main(argv: list[str]) -> None:
    corpus = docs(ROOT / "data/corpus/train.jsonl")
    tiny = docs(ROOT / "data/tiny/train.jsonl")
    queries = {**docs(ROOT / "data/tiny/target.jsonl"), **docs(ROOT / "data/target/code.jsonl"),
               **corpus}
    tiny_hashes = {text_hash(d) for d in tiny.values()}
    for run in map(Path, argv):
        for seed in sorted(run.glob("seed*/lds.json")):
            rep = json.loads(seed.read_text())
            train, query = rep["train_ids"], rep["query_ids"]
            th = {text_hash(corpus[i]) for i in train}
            qh = {text_hash(queries[i]) for i in query}
            sources = collections.Counter(corpus[i]["source"] for i in train)
            print(f"{seed.parent}: {len(train)} training documents from "
                  f"{rep['args'].get('train_data')}, {len(set(train) & set(tiny))} ids and "
                  f"{len(th & tiny_hashes)} texts shared with data/tiny/train.jsonl, "
                  f"{len(set(train) & set(query))} ids and {len(th & qh)} texts shared with "
                  f"its {len(query)} queries ({', '.join(query[:3])}, ...); sources "
                  f"{dict(sorted(sources.items()))}")


if __name__ == "__main__":
    main(sys.argv[1:])
