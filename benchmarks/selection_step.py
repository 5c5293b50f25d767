"""A selection step of the shipped loop against a plain step, phase by phase (1 process, ZeRO-3).

    python benchmarks/selection_step.py [--world 2] [--steps 10] [--warmup 1] [--quick] \\
        --set score=content --set candidate_multiple=4 [--set shortlist=1.5 ...]

Two runs of the shipped training loop (``launch.loop.train``) from the same initialization
take turns, one optimizer step each: *plain* (online selection off: ``micro`` examples per
step) and *selection* (``SelectionConfig`` of ``enabled=True, candidate_multiple=2`` and the
``--set`` overrides; pass ``score`` explicitly, since the config's default score may change:
the header prints the resolved settings). ``--world 1`` runs ``--backend torch``
(launch/torch_backend.py, one process), ``--world 2`` ``--backend deepspeed`` with ZeRO-3 on
two gloo ranks (launch/deepspeed_backend.py); both on the optimizer, lr schedule and clipping
of configs/zero3_cpu.json, ``--micro`` examples per micro-batch, no accumulation. The
selector is built as launch/train.py builds it (``make_selector``, its target ``--target-docs``
texts, refreshed every ``refresh_every`` steps; its log in the run folder). Model: a random-
init GPT-2 (``--layers`` x ``--width``, 4 heads, vocab ``--vocab``, T=``--T``); data: random
tokens (the cost does not depend on the text), so the loop trains exactly what it would
train in ``launch/train.py`` on these examples (tests/unit/test_bench_selection_step.py).

The runs are driven in two threads of one process per rank that hand a baton over at every
optimizer step (the order alternates each step: plain-selection, selection-plain, ...), so
the two loops never run at once, their collectives come in the same order on every rank, and
each step is timed on the same machine state as its partner. Instrumentation wraps instance
attributes only (nothing in the library is patched): the backend's ``forward_backward``,
``backward_reused`` and ``optimizer_step`` (and the DeepSpeed engine's ``step``), and the
selector's stages.

CPU seconds (``time.process_time``, one thread per rank) per step, split into exclusive
phases: target refresh (its own probe passes included), probe forward, probe backward
(+ building the per-example factors), scoring, policy (the rest of ``select``: shortlist,
content prior, choice, log), training forward (none when the candidates' forward is reused),
training backward, optimizer step, and the loop itself (batching, the loss all-reduce, the
run log). Prints per-phase CPU-ms per step and the selection/plain ratio (mean over steps;
median of per-step ratios, paired per step), rank 0's view (ranks do the same work).
"""

from __future__ import annotations

import json
import math
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._common import base_parser, environment, loop_configs, table  # noqa: E402

PHASES = ("target refresh", "probe forward", "probe backward", "scoring", "policy",
          "train forward", "train backward", "optimizer step", "loop")
#: The SelectionConfig this benchmark starts from (then ``--set``).
BASE_SELECTION = {"enabled": True, "candidate_multiple": 2.0}


class PhaseClock:
    """Exclusive CPU seconds per phase: nested phases are charged to the innermost one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._t = time.process_time()

    def _switch(self) -> None:
        now = time.process_time()
        if self._stack:
            self.total[self._stack[-1]] += now - self._t
        self._t = now

    def wrap(self, phase: str, fn):
        def timed(*a, **kw):
            self._switch()
            # the target refresh's own probe passes belong to the refresh
            refresh = bool(self._stack) and self._stack[-1] == "target refresh"
            self._stack.append("target refresh" if refresh else phase)
            try:
                return fn(*a, **kw)
            finally:
                self._switch()
                self._stack.pop()
        return timed

    def take(self) -> dict[str, float]:
        out, self.total = dict(self.total), defaultdict(float)
        return out


class Turns:
    """Two training loops in two threads take turns, one optimizer step each.

    ``schedule`` is the order of turns (0, 1, 1, 0, 0, 1, ..., then 0, 1): after each of its
    optimizer steps a run hands over (``step_done``: the turn's CPU seconds and phases are
    recorded) and waits for its next turn; its last turn (the run's end: final checkpoint,
    summary) ends with ``finish``, after which it drops out of the schedule. So the two runs'
    collectives never interleave and come in the same order on every rank.
    """

    def __init__(self, clock: PhaseClock, steps: int) -> None:
        self.clock, self.cond = clock, threading.Condition()
        self.schedule = [r for s in range(steps) for r in ((0, 1) if s % 2 == 0 else (1, 0))]
        self.schedule += [0, 1]
        self.pos, self.done = 0, [False, False]
        self.turns: list[list[tuple[float, dict[str, float]]]] = [[], []]
        self._t0 = 0.0

    def _owner(self) -> int | None:
        while self.pos < len(self.schedule) and self.done[self.schedule[self.pos]]:
            self.pos += 1
        return self.schedule[self.pos] if self.pos < len(self.schedule) else None

    def wait(self, run: int) -> None:
        """Block until it is ``run``'s turn; start its clock."""
        with self.cond:
            self.cond.wait_for(lambda: self._owner() in (run, None))
        self.clock.take()
        self._t0 = time.process_time()

    def step_done(self, run: int) -> None:
        """``run`` ended an optimizer step: record the turn, hand over, wait for the next."""
        cpu = time.process_time() - self._t0
        self.turns[run].append((cpu, self.clock.take()))
        with self.cond:
            self.pos += 1
            self.cond.notify_all()
        self.wait(run)

    def finish(self, run: int) -> None:
        """``run`` returned (or failed): the other continues alone."""
        with self.cond:
            self.done[run] = True
            self.cond.notify_all()


@dataclass(frozen=True)
class RandomTokens:
    """The tokenizer stand-in of random-token data: what the loop reads of a tokenizer."""

    vocab_size: int
    fingerprint: str


def _coerce(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def overrides(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as SelectionConfig fields."""
    return {kv.split("=", 1)[0]: _coerce(kv.split("=", 1)[1]) for kv in pairs}


def run_inputs(args, world: int, out: Path):
    """``(ds_config, plain RunConfig, selection RunConfig, data, tok, target)`` of one
    measurement: the shipped loop's config (configs/zero3_cpu.json via ``loop_configs``) on a
    GPT-2 of the benchmark's size and random tokens."""
    from dattri_ds.data import Document, TokenizedDocuments
    from dattri_ds.launch.engine import EngineConfig
    from dattri_ds.selection import SelectionConfig

    sc = SelectionConfig.from_dict({**BASE_SELECTION, **overrides(args.set)})
    model = out / "model_config.json"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_text(json.dumps({
        "model_type": "gpt2", "n_layer": args.layers, "n_head": 4, "n_embd": args.width,
        "n_positions": args.T, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": False}))
    steps = args.warmup + args.steps
    ds, cfg = loop_configs(steps=steps, seed=0, seq_len=args.T, eval_every=0, selection=sc,
                           micro=args.micro, gas=1, model_config=str(model))
    if world > 1:
        cfg = replace(cfg, engine=EngineConfig(backend="deepspeed"))
    plain = replace(cfg, selection=replace(sc, enabled=False))
    tok = RandomTokens(args.vocab, f"random-tokens-{args.vocab}")

    def tokens(n: int, seed: int, name: str) -> TokenizedDocuments:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, args.vocab, (n, args.T), generator=gen)
        docs = tuple(Document(id=f"{name}{i}", source=name, title=name, text="") for i in range(n))
        return TokenizedDocuments(ids, torch.ones_like(ids), ids.clone(), docs,
                                  torch.zeros(n, dtype=torch.bool), tok.fingerprint)

    n_cand = math.ceil(sc.candidate_multiple * args.micro - 1e-9)
    data = tokens(n_cand * world * steps, 1000, "random")
    target = tokens(args.target_docs, 7, "target").batch(slice(None))
    return ds, plain, cfg, data, tok, target


def build_run(backend_cls, ds, cfg, data, tok, target, out: Path):
    """A backend and its selector (None without selection), as launch/train.py builds them."""
    from dattri_ds.launch.train import make_selector

    backend = backend_cls(ds, cfg, tok, data)
    if not cfg.selection.enabled:
        return backend, None
    backend.check_selection()
    selector = make_selector(backend.model, cfg, data, tok, backend.ctx, backend.device,
                             backend.selection_log(out), target=target)
    return backend, selector




def instrument_selector(selector, clock: PhaseClock) -> None:
    """Wrap the selector's stages (instance attributes only: nothing global is patched)."""
    probe = selector.probe
    from dattri_ds.selection.target import ValidationTarget

    if isinstance(selector.target, ValidationTarget):
        selector.target._compute = clock.wrap("target refresh", selector.target._compute)
    raw_probe = probe.probe

    def probe_timed(forward, **kw):
        return raw_probe(clock.wrap("probe forward", forward), **kw)
    probe.probe = clock.wrap("probe backward", probe_timed)
    from dattri_ds.selection.stages import Probe, TextScore

    for stage in selector.stages:  # the score stage's rule
        if isinstance(stage, (Probe, TextScore)):
            stage.rule = clock.wrap("scoring", stage.rule)
    selector.select = clock.wrap("policy", selector.select)


def instrument_backend(backend, clock: PhaseClock, turns: Turns, run: int) -> None:
    """Wrap the backend's training calls; its optimizer step ends the run's turn."""
    backend.forward_backward = clock.wrap("train forward", backend.forward_backward)
    backend.backward_reused = clock.wrap("train backward", backend.backward_reused)
    engine = getattr(backend, "engine", None)
    if engine is not None:  # DeepSpeed steps inside backward_reused (engine.step)
        engine.step = clock.wrap("optimizer step", engine.step)
    step = clock.wrap("optimizer step", backend.optimizer_step)

    def step_and_hand_over() -> None:
        step()
        turns.step_done(run)
    backend.optimizer_step = step_and_hand_over


def measure(rank: int, world: int, args, out: Path) -> dict:
    """Both runs on this rank (after ``Backend.setup``); per-step CPU seconds and phases of
    the measured steps, the selector's plan line and the resolved selection settings."""
    from dattri_ds.launch.backend import backend_class
    from dattri_ds.launch.loop import train

    ds, plain_cfg, sel_cfg, data, tok, target = run_inputs(args, world, out)
    backend_cls = backend_class(sel_cfg.engine.backend)
    backend_cls.setup(ds, sel_cfg)
    clock = PhaseClock()
    turns = Turns(clock, args.warmup + args.steps)
    runs = []
    for i, (name, cfg) in enumerate((("plain", plain_cfg), ("selection", sel_cfg))):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        backend, selector = build_run(backend_cls, ds, cfg, data, tok, target, folder)
        instrument_backend(backend, clock, turns, i)
        if selector is not None:
            instrument_selector(selector, clock)
        runs.append((backend, cfg, folder, selector))
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        backend, cfg, folder, selector = runs[i]
        try:
            turns.wait(i)
            train(backend, cfg, data, folder, tok, rank, selector)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
        finally:
            turns.finish(i)

    threads = [threading.Thread(target=loop, args=(i,), name=f"run{i}") for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    selector = runs[1][3]
    plan = selector.plan
    note = None if plan is None else (
        f"selection/stepcost.py predicts {plan.ratio():.2f}x (floor of this path "
        f"{plan.bound():.2f}x): {plan.units()}")
    steps = [[_phases(cpu, ph) for cpu, ph in turns.turns[i][args.warmup:]] for i in (0, 1)]
    sc = sel_cfg.selection
    resolved = {"score": sc.score, "candidate_multiple": sc.candidate_multiple,
                "shortlist": sc.shortlist, "top_blocks": sc.top_blocks,
                "refresh_every": sc.refresh_every,
                "reuse_forward": selector.scorer is not None and selector.scorer.reuse}
    return {"plain": steps[0], "selection": steps[1], "note": note, "resolved": resolved}


def _phases(cpu: float, phases: dict[str, float]) -> dict[str, float]:
    """A turn's phases with the rest of its CPU seconds charged to ``loop``."""
    return {**phases, "loop": max(cpu - sum(phases.values()), 0.0)}


def _worker(rank: int, world: int, port: int, args, out: str, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import logging
    import warnings

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    for name in ("DeepSpeed", "dattri_ds", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:  # DeepSpeed's logger sets its own level on import
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except ImportError:
        pass
    try:
        q.put((rank, measure(rank, world, args, Path(out) / f"rank{rank}")))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(args, out: Path) -> dict:
    """``measure`` on ``args.world`` spawned ranks; rank 0's result."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, str(out), q))
             for r in range(args.world)]
    for pr in procs:
        pr.start()
    results = {}
    while len(results) < len(procs):
        try:
            r, got = q.get(timeout=10)
            results[r] = got
        except queue.Empty:
            if any(pr.exitcode not in (None, 0) for pr in procs):
                for pr in procs:
                    pr.kill()
                raise SystemExit("a benchmark rank failed (traceback above)") from None
    for pr in procs:
        pr.join()
    return results[0]


def report(args, result: dict) -> str:
    """The printed report: header, plan line, phase table, ratio line, JSON line."""
    plain, sel = result["plain"], result["selection"]
    mode = ("launch/loop.py train, --backend torch (1 process)" if args.world == 1 else
            "launch/loop.py train, --backend deepspeed ZeRO-3, 2 gloo ranks")
    r = result["resolved"]
    lines = [f"{mode}; GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, T={args.T}, "
             f"micro-batch {args.micro}, {r['candidate_multiple']:g}x candidates, "
             f"{args.target_docs} target docs, selection overrides {args.set or 'none'} "
             f"(resolved: {', '.join(f'{k}={v}' for k, v in r.items())}); optimizer, lr "
             f"schedule and clipping of configs/zero3_cpu.json; {args.steps} steps after "
             f"{args.warmup} warm-up; {environment()}"]
    if result["note"]:
        lines.append(result["note"])
    tot_plain = [sum(s.values()) for s in plain]
    tot_sel = [sum(s.values()) for s in sel]
    mean_plain = statistics.mean(tot_plain)
    rows = []
    for ph in PHASES:
        a = statistics.mean(s.get(ph, 0.0) for s in plain)
        b = statistics.mean(s.get(ph, 0.0) for s in sel)
        rows.append([ph, a * 1e3, b * 1e3, b / mean_plain])
    ratio_mean = statistics.mean(tot_sel) / mean_plain
    rows.append(["total", mean_plain * 1e3, statistics.mean(tot_sel) * 1e3, ratio_mean])
    lines.append(table(["phase", "plain CPU-ms/step", "selection CPU-ms/step", "x plain step"],
                       rows))
    ratio_med = statistics.median(b / a for a, b in zip(tot_plain, tot_sel))
    lines.append(f"selection step / plain step (CPU s, mean over steps incl. refreshes): "
                 f"{ratio_mean:.2f}x; median paired per step: {ratio_med:.2f}x (goal <= 1.5x)")
    lines.append(json.dumps({"ratio_mean": ratio_mean, "ratio_median": ratio_med,
                             "resolved": r}))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    p = base_parser(__doc__)
    p.add_argument("--world", type=int, default=1, choices=(1, 2))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--target-docs", type=int, default=64,
                   help="target texts (SelectionConfig.target_max_docs' default: 64)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (20; --quick: 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="steps not measured (at least 1: the first holds the loop's set-up)")
    p.add_argument("--set", action="append", default=[],
                   help="SelectionConfig override KEY=VALUE (repeatable; pass score=...)")
    p.add_argument("--keep", default=None,
                   help="keep the runs' folders here (rank<R>/plain, rank<R>/selection: "
                        "selection.jsonl, trajectory.json, checkpoints)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.vocab, args.T, args.micro = 2, 64, 512, 32, 4
        args.target_docs = 16
    if args.steps is None:
        args.steps = 6 if args.quick else 20
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.keep:
        result = run_ranks(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="selection_step_") as out:
            result = run_ranks(args, Path(out))
    print(report(args, result))


if __name__ == "__main__":
    main()
