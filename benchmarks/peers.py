"""Peer benchmark: dattri-ds vs dattri-llm, bergson, kronfluence, LogIX and torch.func vmap.

One seeded workload (``_peer_tasks.py``: GPT-2-style, 4 layers, T=128, 256 train / 16
query examples, the 16 attention/MLP linears, projection k=1024 = 32 x 32 per layer, each
library's own Kronecker/LoGra projection) and three tasks:

* ``collect``: per-example projected gradients of the 256 train examples;
* ``graddot``: grad-dot scores ``[256, 16]`` end to end (collect train and query, score);
  ``dattri-ds exact`` is the unprojected (ghost-routed) path;
* ``ekfac``: EK-FAC fit on the train set + scores (unprojected, damping 0.1 x mean
  eigenvalue, power 1 = the exact damped inverse, empirical Fisher) for dattri-ds and
  kronfluence;
* ``pekfac``: projected EK-FAC end to end (fit + collect + score, the same damping and
  power, k = 32 x 32 per layer, each library's own projection): dattri-ds LoGra (factors
  fitted in the Kronecker-projected space, ``Recipe(logra=True)``), ``dattri-ds whitened``
  (exact factors, rows whitened then projected: ``collect --factors``), LogIX (``add_lora``:
  its LoGra bottleneck, EK-FAC eigenvalues, damping 0.1 x mean eigenvalue by default);
  kronfluence has no projection, so its point is its unprojected EK-FAC.

Every (library, task, width, threads) runs in a FRESH process (``--worker``) and reports
CPU seconds (``time.process_time``, all threads) and wall seconds of its timed region and
the process's peak RSS. ``fp32 floor`` times what any exact collection must run: the
forward and the backward to the attributed layers' outputs, with nothing captured.
The scores are compared with exact unprojected grad-dot scores
computed once per width by per-example autograd (``exact``), so a fast wrong path cannot
win; EK-FAC is also compared with kronfluence's scores. ``plain`` is one SGD training step
per micro-batch: the memory and time floor for collection.

This script installs nothing. Peers come from the ``bench`` extra, installed into a
separate virtualenv (never over the project's torch), e.g.::

    cp -a .venv .venv-peers   # or python -m venv; then keep torch pinned:
    .venv-peers/bin/python -m pip install -c <(echo torch==2.13.0) -e .[bench]
    .venv-peers/bin/python -m pip uninstall -y torchvision torchaudio
    .venv-peers/bin/python benchmarks/peers.py --widths 64 256

A peer that is not importable is reported as "not installed". Ratios: examples per
CPU-second relative to vmap and to the fastest installed peer, per task and width.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

TASKS = ("collect", "graddot", "ekfac", "pekfac")


def installed(lib: str) -> bool:
    from _peer_tasks import LIBRARIES

    module = LIBRARIES[lib][0]
    return module is None or importlib.util.find_spec(module) is not None


# ---- worker -------------------------------------------------------------------------------
def worker(lib: str, task: str, width: int, threads: int, out: str, n_train: int) -> None:
    """Run one adapter in this (fresh) process; write ``out.json`` and ``out.pt``."""
    import torch

    torch.set_num_threads(threads)
    import warnings

    warnings.filterwarnings("ignore")
    from _peer_tasks import LIBRARIES, Clock, build

    wl = build(width, n_train=n_train)
    clock = Clock()
    scores = LIBRARIES[lib][1][task](wl, clock)
    if clock.entered != 1:
        raise RuntimeError(f"adapter {lib}/{task} timed {clock.entered} regions, not 1")
    if scores is not None:
        torch.save(scores.detach().float().cpu(), out + ".pt")
    Path(out + ".json").write_text(json.dumps({
        "lib": lib, "task": task, "width": width, "threads": threads, "cpu_s": clock.cpu,
        "wall_s": clock.wall, "rss_before_mb": clock.rss_before_mb,
        "peak_rss_mb": clock.peak_mb, "torch_threads": torch.get_num_threads()}))


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2**20


def wait_for_memory(min_gb: float, patience_s: float = 600) -> None:
    """Block until ``MemAvailable >= min_gb`` (a shared machine), at most ``patience_s``."""
    t0 = time.monotonic()
    while available_gb() < min_gb and time.monotonic() - t0 < patience_s:
        time.sleep(5)


def run_one(lib: str, task: str, width: int, threads: int, folder: Path, n_train: int,
            timeout: float, min_gb: float = 0.0) -> dict:
    """One fresh worker process; returns its record (``status`` ok / failed / timeout)."""
    wait_for_memory(min_gb)
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{lib.replace(' ', '_')}-{task}-w{width}-t{threads}"
    out = str(folder / tag)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", lib, task, str(width),
           "--threads", str(threads), "--out", out, "--n-train", str(n_train)]
    rec = {"lib": lib, "task": task, "width": width, "threads": threads}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**rec, "status": f"timeout after {timeout:.0f}s"}
    if proc.returncode != 0 or not os.path.exists(out + ".json"):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**rec, "status": "failed: " + " | ".join(tail)}
    rec.update(json.loads(Path(out + ".json").read_text()), status="ok")
    if os.path.exists(out + ".pt"):
        rec["scores"] = out + ".pt"
    return rec


# ---- driver -------------------------------------------------------------------------------
def pearson(x, y) -> float:

    x, y = x.flatten().double(), y.flatten().double()
    x, y = x - x.mean(), y - y.mean()
    return float((x @ y) / (x.norm() * y.norm()).clamp_min(1e-300))


def examples(task: str, n_train: int) -> int:
    """Examples processed by a task: train (+ query for the end-to-end scoring tasks)."""
    return n_train + (16 if task in ("graddot", "ekfac", "pekfac") else 0)


def plan(args) -> list[tuple[str, str]]:
    from _peer_tasks import LIBRARIES

    jobs = [(lib, t) for lib, (_, tasks) in LIBRARIES.items() for t in tasks
            if t in args.tasks and (args.libs is None or lib in args.libs)]
    if "memory" in args.tasks:
        jobs.append(("dattri-ds", "plain"))
    return jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tasks", nargs="+", default=[*TASKS, "memory"],
                   choices=[*TASKS, "memory"])
    p.add_argument("--libs", nargs="+", default=None, help="only these libraries")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="torch threads per worker; collection is repeated per value")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds; each round runs every job once (fresh processes), ratios "
                        "are paired within a round")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    p.add_argument("--min-available-gb", type=float, default=3.0,
                   help="wait (up to 10 min) for this much available memory before a worker")
    p.add_argument("--out", default=str(ROOT / "out" / "peers"))
    p.add_argument("--exact-max-width", type=int, default=None,
                   help="no exact grad-dot reference above this width (its per-example "
                        "rows need N x D floats); EK-FAC rows are then checked against "
                        "kronfluence only")
    p.add_argument("--json", default=None, help="also write every record here")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="print the report of saved records: --json files or the JSON lines "
                        "of a run's log (several files are merged)")
    p.add_argument("--worker", nargs=3, metavar=("LIB", "TASK", "WIDTH"), default=None)
    args = p.parse_args()
    if args.worker:
        lib, task, width = args.worker
        worker(lib, task, int(width), args.threads[0], args.out, args.n_train)
        return
    if args.from_json:
        records = [r for f in args.from_json for r in _load_records(Path(f))]
        print(report(records, args.n_train))
        return

    import torch

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"peers: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
          f"{torch.__version__}, python {sys.executable}, {os.cpu_count()} cpus, load "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    records: list[dict] = []
    for width in args.widths:
        exact = None
        if args.exact_max_width is None or width <= args.exact_max_width:
            ref = run_one("exact", "reference", width, 1, folder / "exact", args.n_train,
                          args.timeout, args.min_available_gb)
            if ref["status"] != "ok":
                raise SystemExit(f"exact reference failed at width {width}: {ref['status']}")
            exact = torch.load(ref["scores"])
        for rep in range(args.repeats):
            for lib, task in plan(args):
                for threads in (args.threads if task in ("collect", "plain") else [1]):
                    rec = {"lib": lib, "task": task, "width": width, "threads": threads,
                           "status": "not installed"}
                    if installed(lib):
                        rec = run_one(lib, task, width, threads, folder / f"r{rep}",
                                      args.n_train, args.timeout, args.min_available_gb)
                    if "scores" in rec and exact is not None:
                        rec["r_exact"] = pearson(torch.load(rec["scores"]), exact)
                    rec["rep"] = rep
                    records.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "scores"}),
                          flush=True)
            for task in ("ekfac", "pekfac"):  # kronfluence's unprojected EK-FAC: reference
                kf = [r for r in records if (r["width"], r["lib"], r["task"], r["rep"]) ==
                      (width, "kronfluence", task, rep) and r.get("scores")]
                for r in records:
                    if (r["width"], r["task"], r["rep"]) == (width, task, rep) and \
                            r.get("scores") and kf:
                        r["r_kronfluence"] = pearson(torch.load(r["scores"]),
                                                     torch.load(kf[0]["scores"]))
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1))
    print()
    print(report(records, args.n_train))


def _load_records(path: Path) -> list[dict]:
    """Records of a ``--json`` file, or the JSON lines a run printed (a partial run's log)."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, (var / len(xs)) ** 0.5


def _fmt(xs: list[float], digits: int = 2) -> str:
    m, se = _mean_se(xs)
    return f"{m:.{digits}f}" + (f" ± {se:.{digits}f}" if se == se else "")


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """Per-round throughput ratios ``a / b`` over the rounds both have."""
    return [a[k] / b[k] for k in a if k in b]


def report(records: list[dict], n_train: int) -> str:
    """Markdown tables: throughput ratios per task and width (mean ± s.e. over rounds of
    per-round paired ratios), threads scaling, memory."""
    from _peer_tasks import PEERS

    def tput(task: str, width: int, lib: str, threads: int = 1) -> dict[int, float]:
        return {r.get("rep", 0): examples(task, n_train) / r["cpu_s"] for r in records
                if (r["task"], r["width"], r["lib"], r.get("threads", 1)) ==
                (task, width, lib, threads) and r["status"] == "ok"}

    lines = ["| task | width | library | CPU s | wall s | ex / CPU-s | x vmap | "
             "x fastest peer | r vs exact | peak RSS MB |", "|---" * 10 + "|"]
    for task in TASKS:
        for width in sorted({r["width"] for r in records}):
            libs = dict.fromkeys(r["lib"] for r in records
                                 if (r["task"], r["width"]) == (task, width))
            got = {lib: tput(task, width, lib) for lib in libs}
            peers = {lib: t for lib, t in got.items() if lib in PEERS and t}
            best = max(peers, key=lambda k: _mean_se(list(peers[k].values()))[0],
                       default=None)
            for lib in libs:
                rs = [r for r in records if (r["task"], r["width"], r["lib"],
                                             r.get("threads", 1)) == (task, width, lib, 1)]
                ok = [r for r in rs if r["status"] == "ok"]
                if not ok:
                    lines.append(f"| {task} | {width} | {lib} | {rs[0]['status'][:120]} |"
                                 + " |" * 6)
                    continue
                vs_vmap = _fmt(_paired(got[lib], got["vmap"])) if got.get("vmap") else "-"
                vs_peer = _fmt(_paired(got[lib], peers[best])) if best else "-"
                r_ex = min((r["r_exact"] for r in ok if "r_exact" in r), default=None)
                r_ex = "-" if r_ex is None else f"{r_ex:.3f}"
                rk = [r["r_kronfluence"] for r in ok if "r_kronfluence" in r]
                rk = f" (r vs kronfluence {min(rk):.3f})" if rk and lib != "kronfluence" else ""
                lines.append(
                    f"| {task} | {width} | {lib} | {_fmt([r['cpu_s'] for r in ok], 1)} | "
                    f"{_fmt([r['wall_s'] for r in ok], 1)} | "
                    f"{_fmt(list(got[lib].values()), 1)} | {vs_vmap} | {vs_peer} | "
                    f"{r_ex}{rk} | {max(r['peak_rss_mb'] for r in ok):.0f} |")
    lines += _pekfac_table(records, n_train)
    lines += _threads_table(records)
    lines += _memory_table(records)
    lines.append(f"\n{len({r.get('rep', 0) for r in records})} round(s); fastest peer per "
                 f"row group = highest mean ex / CPU-s among {', '.join(PEERS)}")
    return "\n".join(lines)


def _pekfac_table(records: list[dict], n_train: int) -> list[str]:
    """Projected EK-FAC: dattri-ds's speed over each library's, per width (paired per round;
    > 1: dattri-ds faster), with the correlation of each one's scores with kronfluence's."""
    rows = [r for r in records if r["task"] == "pekfac" and r["status"] == "ok"]
    if not rows:
        return []
    libs = sorted(dict.fromkeys(r["lib"] for r in rows), key=lambda lib: lib != "dattri-ds")
    if libs[0] != "dattri-ds":
        return []
    lines = ["", "| pekfac | width | " + " | ".join(f"dattri-ds x {lib}" for lib in libs[1:])
             + " | " + " | ".join(f"r({lib}, kronfluence)" for lib in libs) + " |",
             "|---" * (2 + 2 * len(libs) - 1) + "|"]
    for width in sorted({r["width"] for r in rows}):
        cpu = {lib: {r.get("rep", 0): r["cpu_s"] for r in rows
                     if (r["lib"], r["width"]) == (lib, width)} for lib in libs}
        ratios = [_fmt(_paired(cpu[lib], cpu[libs[0]])) if cpu[lib] else "-"
                  for lib in libs[1:]]
        rk = [min((r["r_kronfluence"] for r in rows if (r["lib"], r["width"]) == (lib, width)
                   and "r_kronfluence" in r), default=float("nan")) for lib in libs]
        lines.append(f"| | {width} | " + " | ".join(ratios) + " | "
                     + " | ".join(f"{x:.3f}" for x in rk) + " |")
    return lines


def _threads_table(records: list[dict]) -> list[str]:
    threads = sorted({r.get("threads", 1) for r in records if r["task"] == "collect"})
    if len(threads) < 2:
        return []
    lines = ["", "| collect | width | library | " + " | ".join(
        f"wall s at {t} thr (CPU s)" for t in threads) + f" | wall speed-up 1 -> "
        f"{threads[-1]} thr |", "|---" * (4 + len(threads)) + "|"]
    for width in sorted({r["width"] for r in records}):
        for lib in dict.fromkeys(r["lib"] for r in records if r["task"] == "collect"):
            rs = {t: [r for r in records if (r["task"], r["lib"], r["width"],
                                              r.get("threads", 1)) ==
                      ("collect", lib, width, t) and r["status"] == "ok"] for t in threads}
            if not all(rs.values()):
                continue
            cells = " | ".join(f"{_fmt([r['wall_s'] for r in rs[t]], 1)} "
                               f"({_fmt([r['cpu_s'] for r in rs[t]], 1)})" for t in threads)
            w = {t: {r.get("rep", 0): r["wall_s"] for r in rs[t]} for t in threads}
            lines.append(f"| collect | {width} | {lib} | {cells} | "
                         f"{_fmt(_paired(w[threads[0]], w[threads[-1]]))} |")
    return lines


def _memory_table(records: list[dict]) -> list[str]:
    plain: dict[int, float] = {}
    for r in records:
        if r["task"] == "plain" and r["status"] == "ok" and r.get("threads", 1) == 1:
            plain[r["width"]] = max(plain.get(r["width"], 0.0), r["peak_rss_mb"])
    if not plain:
        return []
    lines = ["", "| memory (collect) | width | library | peak RSS MB | x plain SGD step |",
             "|---|---|---|---|---|"]
    seen = set()
    for r in records:
        key = (r["lib"], r["width"], r["task"])
        if r["task"] in ("collect", "plain") and r["status"] == "ok" and \
                r["width"] in plain and r.get("threads", 1) == 1 and key not in seen:
            seen.add(key)
            peak = max(x["peak_rss_mb"] for x in records if (x["lib"], x["width"], x["task"])
                       == key and x["status"] == "ok" and x.get("threads", 1) == 1)
            name = "plain SGD step" if r["task"] == "plain" else r["lib"]
            lines.append(f"| | {r['width']} | {name} | {peak:.0f} | "
                         f"{peak / plain[r['width']]:.2f} |")
    return lines


if __name__ == "__main__":
    main()
