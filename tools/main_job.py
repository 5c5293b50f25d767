"""The README's main job: DeepSpeed training with online selection vs without, then a report.

    python tools/main_job.py [--out runs/main] [--steps 150] [--world 2] [--quick]

Its four steps (README.md, "The main job"), after the corpus is prepared once (``dattri-ds
prepare``: tokenized into ``<out>/data/``, which both runs read memory-mapped with
``--data-path``): DeepSpeed ZeRO-3 training with the default online selection and gradient
capture; the same candidate stream chosen uniformly at random;
held-out target and general-corpus losses of both (``target_loss.png``, ``report.md``); the
offline attribution of held-out Hamlet passages from the saved checkpoints (``RECIPE``:
fit, collect, attribute, report). Data choices are ``DemoData``. Every phase prints its wall
and CPU seconds (tools/progress.py); the job ends with the table of its phases (also in
``<out>/phases.json``; docs/main_job.md has measured ones).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `dattri_ds.tools` importable
    sys.path.insert(0, str(ROOT))

from dattri_ds import ProjectionConfig  # noqa: E402
from dattri_ds.methods.recipe import Recipe  # noqa: E402
from dattri_ds.sample_id import SampleId  # noqa: E402
from dattri_ds.selection import read_selection_log  # noqa: E402
from dattri_ds.tools import attribute, collect, fit, report  # noqa: E402
from dattri_ds.tools.progress import PHASES, phase  # noqa: E402


@dataclass(frozen=True)
class DemoData:
    """Every data choice of the main job, in one place (files written under ``--out``)."""

    corpus: str = "data/corpus/train.jsonl"
    """The training corpus (mixed sources)."""

    general_heldout: int = 140
    """Its last N documents are never trained on: the general-corpus evaluation set."""

    target: str = "data/target/hamlet.jsonl"
    """The target texts: the first half scores candidates (``--target-data``), the second
    half is the held-out evaluation set (``--eval-data``) selection never sees."""

    eval_docs: int = 64
    """Evaluation documents taken from the target's second half."""

    queries: int = 3
    """Held-out target passages attributed offline (the evaluation half's last ones)."""

    def write(self, out: Path) -> dict[str, Path]:
        """Split the files; return ``{"score", "eval", "general", "queries"}`` paths and the
        number of training documents (``"max_docs"``)."""
        out.mkdir(parents=True, exist_ok=True)
        corpus = (ROOT / self.corpus).read_text(encoding="utf-8").splitlines()
        target = (ROOT / self.target).read_text(encoding="utf-8").splitlines()
        half = len(target) // 2
        parts = {"score": target[:half], "eval": target[half:][:self.eval_docs],
                 "general": corpus[-self.general_heldout:],
                 "queries": target[half:][-self.queries:]}
        paths = {}
        for name, lines in parts.items():
            paths[name] = out / f"data_{name}.jsonl"
            paths[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
        return {**paths, "max_docs": len(corpus) - self.general_heldout}


DEMO = DemoData()


def prepare_corpus(out: Path, max_docs: int) -> Path:
    """The training corpus's first ``max_docs`` documents, prepared once (``dattri-ds
    prepare``: SentencePiece BPE 1024 trained on them) at ``<out>/data/corpus-<max_docs>``
    (a rerun finds it done)."""
    from dattri_ds.tools import prepare

    prefix = out / "data" / f"corpus-{max_docs}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prepare.main(["--input", str(ROOT / DEMO.corpus), "--max-docs", str(max_docs),
                  "--output-prefix", str(prefix)])
    return prefix


def run_training(out: Path, args, extra: list[str]) -> dict:
    """One ``deepspeed`` launch of launch/train.py; returns its summary.json. Its step and
    evaluation lines are printed as they come (the whole output goes to ``train.log``)."""
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.world),
                "--master_port", str(_free_port())]  # not 29500: another job may hold it
    if args.world == 1:
        launcher = [sys.executable]
    cmd = [*launcher, str(ROOT / "launch/train.py"), "--deepspeed_config",
           str(ROOT / args.config), "--out", str(out), "--steps", str(args.steps),
           "--data-path", str(args.data_path), "--seq-len", str(args.seq_len),
           "--eval-every", str(args.eval_every), "--log-every", str(args.log_every),
           "--save-every", str(args.save_every), "--candidate-multiple",
           str(args.candidate_multiple), "--force", *extra]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    print(f"$ {' '.join(cmd[len(launcher):])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:  # live: one line per --log-every steps and per evaluation
        lines.append(line)
        if "target loss" in line or ("step" in line and "ex/s" in line) or \
                "error" in line.lower():
            print("   ", line.rstrip().split("] ", 1)[-1], flush=True)
    proc.wait()
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text("".join(lines))
    if proc.returncode != 0:
        sys.exit(f"training failed (exit {proc.returncode}); last lines:\n"
                 f"{''.join(lines)[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corpus_sources() -> dict[str, str]:
    """Document id -> source of the main job's corpus."""
    lines = (ROOT / DEMO.corpus).read_text(encoding="utf-8").splitlines()
    return {d["id"]: d["source"] for d in map(json.loads, lines)}


def chosen_sources(run: Path) -> Counter:
    """Which corpus sources the selector trained on, in tokens (selection.jsonl: each chosen
    window counts for the documents it covers, found from its id in the run's data)."""
    from dattri_ds.data.packed import PackedDataset

    data = PackedDataset.of_record(json.loads((run / "data.json").read_text())["record"])
    tokens: Counter = Counter()
    for record in read_selection_log(run / "selection.jsonl"):
        for sid in record["chosen"]:
            for sp in data.spans_of(SampleId.parse(sid).doc):
                tokens[data.corpora[sp.corpus].document(sp.document)["source"]] += \
                    sp.end - sp.start
    return tokens


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    """Target loss and general-corpus loss against trained examples, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for ax, key, title in ((axes[0], "target_loss", "held-out target (Hamlet, 2nd half)"),
                           (axes[1], "general_loss", "held-out general corpus")):
        for label, pts in curves.items():
            if pts and key in pts[0]:
                ax.plot([p["examples"] for p in pts], [p[key] for p in pts], marker="o",
                        label=label)
        ax.set_xlabel("trained examples")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Online selection vs uniform choice from the same candidates", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def report_rows(sel: list[dict], base: list[dict]) -> list[str]:
    """Markdown rows: step, examples, target and general loss of both runs, target gain."""
    def g(e: dict) -> str:
        return f"{e['general_loss']:.4f}" if "general_loss" in e else "-"
    return [f"| {e['step']} | {e['examples']} | {e['target_loss']:.4f} | "
            f"{b['target_loss']:.4f} | {b['target_loss'] - e['target_loss']:+.4f} | "
            f"{g(e)} | {g(b)} |" for e, b in zip(sel, base)]


#: The offline attribution recipe of step 4 (one place): TracIn on plain Kronecker k=256
#: rows of every checkpoint; the EK-FAC trajectory on rows whitened by each checkpoint's
#: exact factors, projected as the library's default (why not Kronecker k=256 there:
#: docs/main_job.md).
RECIPE = {"plain": ("kronecker", 256),
          "whitened": (ProjectionConfig().kind, ProjectionConfig().dim), "fit_docs": 256,
          "methods": ("tracin", "ekfac-trajectory")}


def attribute_offline(run: Path, out: Path, args) -> list[Path]:
    """Step 4: fit -> collect -> attribute (TracIn, EK-FAC trajectory) -> report, in-process,
    one timed phase each (``RECIPE``)."""
    corpus = str(ROOT / DEMO.corpus)
    queries = out / "data_queries.jsonl"  # held-out target passages (DemoData.write)
    tags = [c["tag"] for c in json.loads((run / "trajectory.json").read_text())["checkpoints"]]
    factors, plain, white = out / "factors", out / "grads", out / "grads_whitened"

    def proj(rows: str) -> list[str]:
        kind, dim = RECIPE[rows]
        return ["--projection", kind, "--projection-dim", str(dim)]

    fit_docs = min(args.attr_docs, RECIPE["fit_docs"])
    with phase("fit", f"exact EK-FAC factors of {len(tags)} checkpoints on {fit_docs} "
                      f"training documents"):
        fit.main(["--run", str(run), "--checkpoint", "all", "--data", corpus, "--max-docs",
                  str(fit_docs), "--out", str(factors), "--force"])
    with phase("collect", "{} k={} rows of {} documents x {} checkpoints (plain)".format(
            *RECIPE["plain"], args.attr_docs, len(tags))):
        collect.main(["--run", str(run), "--data", corpus, "--max-docs", str(args.attr_docs),
                      "--out", str(plain), *proj("plain")])
    with phase("collect whitened", "{} k={} rows whitened by each checkpoint's factors".format(
            *RECIPE["whitened"])):
        collect.main(["--run", str(run), "--data", corpus, "--max-docs", str(args.attr_docs),
                      "--out", str(white), *proj("whitened"), "--factors", str(factors)])
    reports = []
    for method, store in zip(RECIPE["methods"], (plain, white)):
        dest = out / f"attribution-{method}"
        curvature = ["--factors", str(factors)] if Recipe(method=method).curvature else []
        with phase(f"attribute {method}", f"{DEMO.queries} queries x {args.attr_docs} "
                                          f"documents x {len(tags)} checkpoints"):
            attribute.main(["--run", str(run), "--store", str(store), "--queries",
                            str(queries), "--method", method, *curvature, "--truncate",
                            "--out", str(dest), "--force"])
        with phase(f"report {method}"):
            reports.append(report.main(["--attribution", str(dest), "--train-data", corpus]))
    return reports


def top_sources(att: Path) -> str:
    """One line per query: the sources of its top-10 proponents."""
    corpus, lines = corpus_sources(), []
    for q in json.loads((att / "topk.json").read_text()):
        srcs = Counter(corpus.get(SampleId.parse(p["id"]).doc, "?")
                       for p in q["proponents"][:10])
        lines.append(f"  {q['query']}: top-10 proponents by source {dict(srcs.most_common())}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/main")
    p.add_argument("--config", default="configs/zero3_cpu.json")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--max-docs", type=int, default=3500)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--log-every", type=int, default=10,
                   help="print the training loss every N steps")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--candidate-multiple", type=float, default=4.0,
                   help="candidates scored per trained example")
    p.add_argument("--attr-docs", type=int, default=700,
                   help="training documents attributed offline (step 4)")
    p.add_argument("--quick", action="store_true", help="a 1-minute smoke version")
    args = p.parse_args()
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout)
    if args.quick:
        args.steps, args.max_docs, args.eval_every, args.save_every = 12, 400, 4, 6
        args.log_every = 4
        args.attr_docs = 64
    out = ROOT / args.out
    data = DEMO.write(out)
    args.max_docs = min(args.max_docs, data["max_docs"])
    print("== 0/4 the corpus, prepared once (tokenized into memory-mapped files)", flush=True)
    with phase("prepare", f"the first {args.max_docs} documents of {DEMO.corpus}"):
        args.data_path = prepare_corpus(out, args.max_docs)
    common = ["--target-data", str(data["score"]), "--eval-data", str(data["eval"]),
              "--general-eval-data", str(data["general"])]
    print("== 1/4 DeepSpeed ZeRO-3 training WITH online selection (+ gradient capture)",
          flush=True)
    with phase("train with selection", f"{args.steps} steps on {args.world} processes"):
        sel = run_training(out / "selection", args,
                           ["--online-selection", "--capture", *common])
    print("== 2/4 same candidates, uniform random choice (baseline)", flush=True)
    with phase("train random", f"{args.steps} steps on {args.world} processes"):
        base = run_training(out / "random", args,
                            ["--online-selection", "--random-selection", *common])
    print("== 3/4 selection report", flush=True)
    with phase("selection report"):
        curves = {"online selection": sel["eval"], "random (no selection)": base["eval"]}
        plot(curves, out / "target_loss.png")
        srcs = chosen_sources(out / "selection")
        total = sum(srcs.values()) or 1
        report = "\n".join([
            "# dattri-ds main job", "",
            f"DeepSpeed ZeRO-3, {sel['world']} processes, {sel['steps']} steps, "
            f"{sel['examples']} trained examples per run, {args.candidate_multiple:g}x "
            f"candidates; target: Hamlet (scoring: first half of {DEMO.target}; evaluation: "
            f"{DEMO.eval_docs} documents of its second half, never scored); general: the "
            f"corpus' last {DEMO.general_heldout} documents (never trained on).", "",
            "| step | examples | target loss, selection | target loss, random | target gain | "
            "general loss, selection | general loss, random |",
            "|---:|---:|---:|---:|---:|---:|---:|", *report_rows(sel["eval"], base["eval"]), "",
            "Sources of the tokens selection trained on:", "",
            *[f"- {s}: {c} ({100 * c / total:.1f}%)" for s, c in srcs.most_common()], "",
            f"Selection: {json.dumps(sel.get('selection', {}))}", "",
            "![target and general loss](target_loss.png)", ""])
        (out / "report.md").write_text(report)
        print(report)
        print(f"plot: {out / 'target_loss.png'}\nreport: {out / 'report.md'}")
    print("== 4/4 offline attribution of held-out Hamlet passages (TracIn, EK-FAC trajectory "
          "on whitened rows)", flush=True)
    reports = attribute_offline(out / "selection", out, args)
    for rep in reports:
        print(f"\n{rep.parent.name}:\n{top_sources(rep.parent)}")
        print("\n".join(rep.read_text().splitlines()[:14]))
        print(f"  ... full report: {rep} (and {rep.with_suffix('.html').name})")
    print_phases(out, time.perf_counter() - t0)


def print_phases(out: Path, wall: float) -> None:
    """The job's phases (wall and CPU seconds), printed and written to ``phases.json``."""
    rows = [{"phase": p.name, "wall_s": round(p.wall_s, 1),
             "cpu_s": round(p.cpu_s + p.child_cpu_s, 1)} for p in PHASES]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    (out / "phases.json").write_text(json.dumps(
        {"phases": rows, "wall_s": round(wall, 1), "cpus": os.cpu_count(),
         "load_at_end": load}, indent=1) + "\n")
    print(f"\n== phases (wall s / CPU s; {os.cpu_count()} CPUs, load {load} at the end)")
    for r in rows:
        print(f"  {r['phase']:<28s} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f}")
    print(f"  {'total':<28s} {wall:>8.1f}")


if __name__ == "__main__":
    main()
