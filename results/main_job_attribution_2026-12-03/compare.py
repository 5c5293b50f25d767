"""Rank agreement of the main job's attributions with exact (unprojected) whitened scoring.

Usage: python compare.py EXACT_DIR ATTRIBUTION_DIR [ATTRIBUTION_DIR ...]

Every directory is an ``attribute --out`` folder (``scores.npy`` [N, Q], ``train_ids.json``).
EXACT_DIR scores a subset of the others' training documents (the first 140 of the corpus);
for each other folder the scores of those documents are compared query by query
(Spearman and Pearson), and the sources of its top-10 / top-50 proponents over all of its
documents are counted against the corpus's source labels.
"""
import collections
import json
import sys
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parents[2] / "data/corpus/train.jsonl"


def load(d: str):
    return json.loads(Path(d, "train_ids.json").read_text()), np.load(Path(d, "scores.npy"))


def ranks(x):
    return np.argsort(np.argsort(x))


def main() -> None:
    source = {json.loads(x)["id"]: json.loads(x)["source"]
              for x in CORPUS.read_text().splitlines()}
    exact_ids, exact = load(sys.argv[1])
    for d in sys.argv[2:]:
        ids, s = load(d)
        sub = s[[ids.index(i) for i in exact_ids]]
        sp = [np.corrcoef(ranks(sub[:, q]), ranks(exact[:, q]))[0, 1] for q in range(s.shape[1])]
        pe = [np.corrcoef(sub[:, q], exact[:, q])[0, 1] for q in range(s.shape[1])]
        srcs = np.array([source[i.split("#")[0]] for i in ids])
        top10, top50 = collections.Counter(), 0
        for q in range(s.shape[1]):
            order = np.argsort(-s[:, q])
            top10.update(srcs[order[:10]])
            top50 += int((srcs[order[:50]] == "shakespeare").sum())
        print(f"{d}: Spearman vs exact {np.round(sp, 2).tolist()}, Pearson "
              f"{np.round(pe, 2).tolist()}; top-10 sources {dict(top10.most_common(4))}; "
              f"Shakespeare in the top 50 of each query: {top50} of {50 * s.shape[1]}")


if __name__ == "__main__":
    main()
