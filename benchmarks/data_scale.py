"""Data at scale: ``dattri-ds prepare``, the memory-mapped training dataset and launch/train.py
on corpora of 1x / 10x / 100x / 400x the shipped one.

    python benchmarks/data_scale.py                         # 1x, 10x, 100x
    python benchmarks/data_scale.py --scales 1,10,100,400   # + the 1.9 GB corpus
    python benchmarks/data_scale.py --scales 1 --workers 1  # smoke
    python benchmarks/data_scale.py --launch --scales 1,10,100,400 --repeats 2  # launch half

Corpora: ``runs/data_scale/corpus-<k>x.jsonl`` is ``data/corpus/train.jsonl`` written ``k``
times, the ids of copy ``j`` suffixed ``-r<j>`` (unique), streamed line by line (never held
in memory) and kept for later runs. Every scale is tokenized by the same SentencePiece model
(BPE, vocabulary 1024: the launch's default, trained once on the shipped corpus), so the
scales differ only in size.

Printed, in one run:

* per scale, just before its prepare, the tokenizer's own batch throughput
  (``encode_batch`` of the shipped texts in one call on ``--workers`` threads, best of 3;
  per wall second and per CPU second): the ceiling prepare is compared with;
* per scale, a cold ``prepare`` in a fresh process (``--workers`` processes): wall seconds
  of the ``prepare`` call (imports excluded), documents/s and tokens/s, the share of the
  tokenizer's throughput, CPU seconds of the call (main + workers), and the peak RSS of the
  main process (and what it was after the imports) and of the largest worker (forked: the
  pages it shares with the main process count in both);
* per scale, the training dataset (``PackedDataset``, ``--seq-len`` windows) opened in a
  fresh process, cold (its indices built) and warm (cached): seconds from the call to the
  first batch of 8 examples read, and the peak RSS it adds over the imports (VmHWM reset
  after them) and the anonymous memory it adds (what is not a file page of the memory map).

``--launch`` (on the corpora prepared above, kept under runs/data_scale/prepared-<k>x/):
``launch/train.py --data-path`` in a fresh process per run (one process, DeepSpeed ZeRO-2,
configs/zero2_cpu.json, the default tiny GPT-2, ``--launch-seq-len`` windows, ``--steps``
steps), without and with ``--online-selection`` (default content score, target
data/target/hamlet.jsonl), the runs interleaved over the scales and repeated
``--repeats`` times after one unmeasured run per scale that builds the indices: seconds
from the process's start to the end of the first training step (imports included) and its
CPU seconds, the exact peak RSS of the process (``ru_maxrss``) at that step and at the
end, and the median wall and CPU seconds of the later steps (the per-step cost of
selection); and, per corpus, the tokens the windows leave out (0) and the padding share at
``--seq-len``.

The machine is shared: wall times are noise; CPU seconds are the firmer measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import table  # noqa: E402

from dattri_ds.data.prepare import usable_cores  # noqa: E402

CORPUS = ROOT / "data" / "corpus" / "train.jsonl"

_PREPARE = """
import json, resource, sys, time
from dattri_ds.data.prepare import PrepareConfig, prepare
import megatron.core.datasets.indexed_dataset  # imported before the clock starts
cfg = PrepareConfig(input=(sys.argv[1],), output_prefix=sys.argv[2], tokenizer=sys.argv[3],
                    workers=int(sys.argv[4]), overwrite=True)
def cpu():
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0, c0 = time.perf_counter(), cpu()
m = prepare(cfg)
wall, used = time.perf_counter() - t0, cpu() - c0
print(json.dumps({"wall_s": wall, "cpu_s": used, "base_rss_mb": base_mb,
                  "main_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "documents": m["documents"], "tokens": m["tokens"]}))
"""

_OPEN = """
import json, sys, time
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: F401
from dattri_ds.data.packed import PackedDataset

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")  # VmHWM := current RSS (after the imports)
before = {k: status(k) for k in ("VmHWM", "RssAnon")}
t0 = time.perf_counter()
p = PackedDataset(sys.argv[1], int(sys.argv[2]))
b = p.batch(list(range(8)))
ids = [p.example_id(i) for i in range(8)]
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "peak_mb": (status("VmHWM") - before["VmHWM"]) / 1024,
                  "anon_mb": (status("RssAnon") - before["RssAnon"]) / 1024,
                  "examples": len(p), "padding": p.padding_share}))
"""


_LAUNCH = """
import json, resource, sys, time
t0 = float(sys.argv[1])  # the parent's clock when it started this process
from dattri_ds.launch.runlog import RunLog
marks = []
end_step = RunLog.end_step

def timed(self, step, *a, **k):
    marks.append((time.time() - t0, time.process_time(),
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    return end_step(self, step, *a, **k)

RunLog.end_step = timed
from dattri_ds.launch.train import main
summary = main(sys.argv[2:])
steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks[1:], marks[2:])]
print(json.dumps({"first_step_s": marks[0][0], "first_step_cpu_s": marks[0][1],
                  "first_step_rss_mb": marks[0][2],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "steps": steps, "status": summary["status"]}))
"""


def launch_run(out: Path, k: int, seq_len: int, steps: int, selection: bool) -> dict:
    """One ``launch/train.py --data-path`` run in a fresh process (``_LAUNCH``)."""
    run = out / f"launch-{k}x-{'selection' if selection else 'plain'}"
    argv = ["--deepspeed_config", str(ROOT / "configs/zero2_cpu.json"), "--data-path",
            str(out / f"prepared-{k}x" / "corpus"), "--seq-len", str(seq_len), "--steps",
            str(steps), "--log-every", str(steps), "--out", str(run), "--force"]
    if selection:
        argv += ["--online-selection", "--target-data", str(ROOT / "data/target/hamlet.jsonl")]
    return _child(_LAUNCH, str(time.time()), *argv)


def data_checks(out: Path, k: int, seq_len: int) -> dict:
    """Tokens the windows leave out of the corpus (0) and the padding share at ``seq_len``."""
    from dattri_ds.data.packed import PackedDataset

    data = PackedDataset(str(out / f"prepared-{k}x" / "corpus"), seq_len)
    return {"dropped": data.corpora[0].n_tokens - data.n_tokens,
            "padding": data.padding_share, "examples": len(data)}


def launch_half(out: Path, scales: list[int], args) -> list[dict]:
    """The launch table: per scale, plain and selection runs, ``args.repeats`` rounds."""
    import statistics

    for k in scales:  # unmeasured: builds the indices of launch's --seq-len windows once
        launch_run(out, k, args.launch_seq_len, 2, False)
    runs: dict[tuple[int, bool], list[dict]] = {}
    for _ in range(args.repeats):
        for k in scales:
            for sel in (False, True):
                r = launch_run(out, k, args.launch_seq_len, args.steps, sel)
                runs.setdefault((k, sel), []).append(r)
                print(json.dumps({"scale": k, "selection": sel, **r}), flush=True)
    results = []
    for k in scales:
        row = {"scale": k, **data_checks(out, k, args.seq_len)}
        for sel in (False, True):
            rs = runs[(k, sel)]
            med = statistics.median
            row["selection" if sel else "plain"] = {
                "first_step_s": [round(r["first_step_s"], 2) for r in rs],
                "first_step_cpu_s": med(r["first_step_cpu_s"] for r in rs),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "first_step_rss_mb": max(r["first_step_rss_mb"] for r in rs),
                "step_s": med(s[0] for r in rs for s in r["steps"]),
                "step_cpu_s": med(s[1] for r in rs for s in r["steps"])}
        results.append(row)
    return results


def print_launch(results: list[dict]) -> None:
    base = {m: results[0][m] for m in ("plain", "selection")}
    rows = []
    for r in results:
        cells = [f"{r['scale']}x", r["examples"], r["dropped"], f"{100 * r['padding']:.4f}%"]
        for m in ("plain", "selection"):
            x = r[m]
            cells += ["/".join(f"{t:.1f}" for t in x["first_step_s"]),
                      round(x["first_step_cpu_s"], 1),
                      f"{min(x['first_step_s']) / min(base[m]['first_step_s']):.2f}x",
                      round(x["peak_rss_mb"]),
                      f"{x['peak_rss_mb'] - base[m]['peak_rss_mb']:+.0f}",
                      round(x["step_s"], 3), round(x["step_cpu_s"], 3)]
        cells.append(f"{r['selection']['step_cpu_s'] / r['plain']['step_cpu_s']:.2f}x")
        rows.append(cells)
    head = []
    for m in ("plain", "selection"):
        head += [f"{m}: first step s", "CPU s", "vs 1x", "peak MB", "vs 1x", "step s",
                 "step CPU s"]
    print(table(["corpus", "examples", "tokens dropped", "padding", *head,
                 "selection step CPU / plain"], rows))


def make_corpus(out: Path, k: int) -> Path:
    """``corpus-<k>x.jsonl`` (kept: written once, streamed)."""
    path = out / f"corpus-{k}x.jsonl"
    done = path.with_suffix(".done")
    if done.exists() and path.exists():
        return path
    lines = [ln for ln in CORPUS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    head = [json.loads(ln)["id"] for ln in lines]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for j in range(k):
            for doc_id, ln in zip(head, lines):
                key = json.dumps(doc_id)
                at = ln.index(key)
                fh.write(ln[:at] + json.dumps(f"{doc_id}-r{j}") + ln[at + len(key):] + "\n")
    os.replace(tmp, path)
    done.write_text(str(k * len(lines)))
    return path


def tokenizer(out: Path) -> Path:
    """The launch's default tokenizer (SentencePiece BPE 1024 on the shipped corpus)."""
    from dattri_ds.data import load_documents, train_tokenizer

    path = out / "tokenizer.model"
    if not path.exists():
        tok = train_tokenizer([d.text for d in load_documents(CORPUS)], vocab_size=1024,
                              cache_dir=out / "cache")
        tok.save(path)
    return path


def encode_rate(model: Path, threads: int) -> dict:
    """The tokenizer's own batch throughput on the shipped texts, per wall second (best of
    3 calls) and per CPU second of this process (its threads included)."""
    from dattri_ds.data import load_documents
    from dattri_ds.data.tokenizers import open_tokenizer

    texts = [d.text for d in load_documents(CORPUS)]
    tok = open_tokenizer(model)
    tok.set_threads(threads)
    best, cpu = float("inf"), float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = tok.encode_batch(texts)
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    n_tok = sum(map(len, ids)) + len(ids)  # + one EOS per document, as prepare stores
    return {"docs_s": len(texts) / best, "tokens_s": n_tok / best,
            "tokens_cpu_s": n_tok / cpu, "mb_s": CORPUS.stat().st_size / best / 1e6}


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_scale(out: Path, k: int, model: Path, workers: int, seq_len: int) -> dict:
    import shutil

    corpus = make_corpus(out, k)
    prefix = out / f"prepared-{k}x" / "corpus"
    shutil.rmtree(prefix.parent, ignore_errors=True)
    base = encode_rate(model, workers)  # just before: the machine's load drifts
    prep = _child(_PREPARE, str(corpus), str(prefix), str(model), str(workers))
    cold = _child(_OPEN, str(prefix), str(seq_len))
    warm = _child(_OPEN, str(prefix), str(seq_len))
    return {"scale": k, "corpus_mb": corpus.stat().st_size / 1e6, "encode": base,
            "prepare": prep,
            "open_cold": cold, "open_warm": warm}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="1,10,100", help="comma list of corpus multiples")
    p.add_argument("--workers", type=int, default=usable_cores(),
                   help="prepare's processes, and the tokenizer's threads for its baseline")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training example")
    p.add_argument("--out", default=str(ROOT / "runs" / "data_scale"))
    p.add_argument("--launch", action="store_true",
                   help="the launch half (time to the first step, peak RSS, step cost) on "
                        "the corpora prepared before")
    p.add_argument("--launch-seq-len", type=int, default=128,
                   help="launch's --seq-len (the default model has 256 positions)")
    p.add_argument("--steps", type=int, default=6, help="launch: training steps per run")
    p.add_argument("--repeats", type=int, default=2, help="launch: measured rounds")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.launch:
        results = launch_half(out, [int(x) for x in args.scales.split(",")], args)
        print_launch(results)
        (out / f"launch-{args.scales.replace(',', '_')}.json").write_text(
            json.dumps(results, indent=1))
        return results
    model = tokenizer(out)
    results = []
    for k in (int(x) for x in args.scales.split(",")):
        r = run_scale(out, k, model, args.workers, args.seq_len)
        results.append(r)
        print(json.dumps(r), flush=True)
    rows = []
    for r in results:
        pr, c, w, base = r["prepare"], r["open_cold"], r["open_warm"], r["encode"]
        rows.append([f"{r['scale']}x", round(r["corpus_mb"]), pr["documents"],
                     round(pr["tokens"] / 1e6, 1), round(pr["wall_s"], 1),
                     round(pr["documents"] / pr["wall_s"]),
                     round(pr["tokens"] / pr["wall_s"] / 1e6, 2),
                     round(base["tokens_s"] / 1e6, 2),
                     f"{100 * pr['tokens'] / pr['wall_s'] / base['tokens_s']:.0f}%",
                     f"{100 * pr['tokens'] / pr['cpu_s'] / base['tokens_cpu_s']:.0f}%",
                     round(pr["cpu_s"], 1), f"{pr['main_rss_mb']:.0f} ({pr['base_rss_mb']:.0f})",
                     round(pr["worker_rss_mb"]), round(c["wall_s"], 2), round(w["wall_s"], 3),
                     round(c["peak_mb"], 1), round(w["peak_mb"], 1), round(w["anon_mb"], 2),
                     f"{100 * w['padding']:.3f}%"])
    print(table(["corpus", "MB", "docs", "M tok", "prep s", "docs/s", "M tok/s",
                 "encode M tok/s", "of encode", "of encode/CPU-s",
                 "CPU s", "main MB (imports)", "worker MB", "open cold s", "open warm s",
                 "cold +MB", "warm +MB", "warm anon +MB", "padding"], rows))
    (out / f"results-{args.scales.replace(',', '_')}.json").write_text(
        json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
