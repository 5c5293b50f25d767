"""Which score predicts what a candidate actually does to the target? One-step oracle.

    python benchmarks/selection_oracle.py --targets hamlet code trivia --seeds 2 \\
        --checkpoints 25 100 175 --candidates 160

The end-of-training benchmark (selection_effect.py) is the verdict, but its paired
differences carry ~0.05-0.08 nats of trajectory noise per seed. This diagnostic measures the
thing a per-example score is meant to predict, exactly and cheaply: from a checkpoint of a
random-choice run (the benchmark's model, AdamW and schedule, trained by the shipped loop
on ``--backend torch``; the model, optimizer and schedule restored from its checkpoint),
for each of ``--candidates``
pool examples ``b``, take the real next optimizer step (clipping 1.0, AdamW with the
checkpoint's moments and step count) on a micro-batch of 15 fixed random pool examples plus
``b``, and record the held-out target loss after it. The candidate's *benefit* is the drop
of that loss relative to the mean over candidates. Every score rule is computed from exact
per-example gradients (all parameters, autograd, one example at a time; per-token mean loss
as the selector uses by default) against the scoring half of the target, and reported by:

* Spearman correlation with the benefit (higher: the rule ranks candidates as the real
  step does);
* the mean benefit of the rule's top quarter (what top-k at 4x candidates would gain per
  step, in the same units) and of its top half;
* AUC for telling the target's own corpus source from the others (where the target has one).

Score rules (``g`` a candidate's gradient, ``t`` the target mean, ``p`` the mean of 64
random pool examples): ``dot`` <g,t>; ``cos`` <g,t>/|g|; ``orth`` <g, t - proj_p t>/|g|;
``layercos`` the mean over parameter tensors of the per-tensor cosine; ``loss`` the
candidate's own loss; ``adam`` <g, P t>/|g|_P with Adam's P. (The contrast and expected
step-cosine rules were removed with their selection scores after 0eb5305: no measurement
showed them ahead; git keeps them.)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from selection_effect import Setup, mean_loss, spearman  # noqa: E402

from benchmarks._common import loop_configs  # noqa: E402
from dattri_ds.launch.optimizer import make_optimizer  # noqa: E402
from dattri_ds.selection import SelectionConfig  # noqa: E402

#: The DeepSpeed dict of the runs (configs/zero3_cpu.json, micro-batch 8 x 2): optimizer,
#: schedule and clipping of the real steps measured here.
DS_CONFIG: dict = {}

IN_DOMAIN = {"hamlet": "shakespeare", "code": "python_code"}


def example_grads(model, data, rows, per_token: bool = True) -> tuple[torch.Tensor, list]:
    """``[N, D]`` flat per-example gradients over all parameters (and their token counts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out, counts = [], []
    for i in rows:
        b = data.batch([int(i)])
        model.zero_grad(set_to_none=True)
        loss = model(**b).loss  # token mean of this one example
        n = int((b["labels"][:, 1:] != -100).sum())
        (loss if per_token else loss * n).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in params]))
        counts.append(n)
    model.zero_grad(set_to_none=True)
    return torch.stack(out), counts


def adam_step_params(model, opt, grad: torch.Tensor, clip: float = 1.0) -> dict:
    """The parameters after one AdamW step on the flat gradient ``grad`` (the optimizer's
    moments and step count, clipping to ``clip``); nothing is modified."""
    g = grad * min(1.0, clip / (float(grad.norm()) + 1e-6))
    new, off = {}, 0
    group = opt.param_groups[0]
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    for name, p in model.named_parameters():
        gi = g[off:off + p.numel()].view_as(p)
        off += p.numel()
        st = opt.state.get(p, {})
        step = int(st.get("step", 0)) + 1
        m = b1 * st.get("exp_avg", torch.zeros_like(p)) + (1 - b1) * gi
        v = b2 * st.get("exp_avg_sq", torch.zeros_like(p)) + (1 - b2) * gi * gi
        mh, vh = m / (1 - b1 ** step), v / (1 - b2 ** step)
        new[name] = p.detach() * (1 - lr * wd) - lr * mh / (vh.sqrt() + eps)
    return new


def persistent_after(model, opt, sched, first: dict, later: list[dict], data) -> float:
    """Target loss after the real step on ``first`` (model inputs) and ``len(later)`` more
    ordinary steps on the fixed batches ``later``, from copies of model, optimizer and lr
    schedule (the run's DeepSpeed schedule class, advanced after each step as the loop
    does)."""
    import copy

    m = copy.deepcopy(model)
    o, s = make_optimizer(DS_CONFIG, m.parameters())
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    s.load_state_dict(copy.deepcopy(sched.state_dict()))
    for b in [first, *later]:
        m(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), DS_CONFIG["gradient_clipping"])
        o.step()
        s.step()
        o.zero_grad(set_to_none=True)
    return mean_loss(m, data)


def checkpoints_of_run(setup: Setup, seed: int, steps: list[int], out: Path):
    """Train the random-choice run with the shipped loop (``train_in_process``, no
    selection, checkpoints at every multiple of the steps' gcd); yield ``(step, model,
    optimizer, schedule)`` restored from checkpoint ``step<s>`` of each step in ``steps``."""
    from dattri_ds.launch.torch_backend import TorchBackend
    from dattri_ds.launch.train import train_in_process

    global DS_CONFIG
    every = math.gcd(*steps)
    DS_CONFIG, cfg = loop_configs(steps=max(steps), seed=seed, seq_len=setup.seq_len,
                                  eval_every=0, selection=SelectionConfig())
    cfg = replace(cfg, train=replace(cfg.train, save_every=every))
    _, backend = train_in_process(DS_CONFIG, cfg, setup.pool, setup.tok, out)
    for step in sorted(steps):
        back = TorchBackend(DS_CONFIG, cfg, setup.tok, setup.pool)
        back.load(out / "checkpoints", f"step{step}")
        yield step, back.model, back.optimizer, back.sched


def preconditioner(model, opt) -> torch.Tensor:
    group = opt.param_groups[0]
    b2, eps = group["betas"][1], group["eps"]
    parts = []
    for p in model.parameters():
        st = opt.state.get(p)
        if st is None:
            parts.append(torch.ones(p.numel()))
            continue
        vh = st["exp_avg_sq"] / (1 - b2 ** int(st["step"]))
        parts.append((1 / (vh.sqrt() + eps)).reshape(-1))
    return torch.cat(parts)


def rules(g, t, p, sizes, losses, pre) -> dict[str, torch.Tensor]:
    """Every score rule on flat gradients ``g [N, D]``."""
    gn = g.norm(dim=1).clamp_min(1e-30)
    pu = p / p.norm()
    orth = t - (t @ pu) * pu
    out = {"dot": g @ t, "cos": g @ t / gn, "orth": g @ orth / gn,
           "loss": losses,
           "adam": g @ (pre * t) / ((g * g * pre).sum(1).sqrt().clamp_min(1e-30))}
    cos_layers, off = [], 0
    for n in sizes:
        gi, ti = g[:, off:off + n], t[off:off + n]
        off += n
        cos_layers.append(gi @ ti / (gi.norm(dim=1).clamp_min(1e-30) * ti.norm().clamp_min(1e-30)))
    out["layercos"] = torch.stack(cos_layers).mean(0)
    return out


def auc(score: torch.Tensor, pos: torch.Tensor) -> float:
    if pos.all() or not pos.any():
        return float("nan")
    r = score.argsort().argsort().double() + 1
    n1, n0 = float(pos.sum()), float((~pos).sum())
    return float((r[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def checkpoint_report(setup: Setup, model, opt, sched, step: int, seed: int, n_cand: int,
                      target: str, horizon: int = 0) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    perm = torch.randperm(len(setup.pool), generator=gen)
    base, cand, pool_rows = perm[:15], perm[15:15 + n_cand], perm[-64:]
    sizes = [p.numel() for p in model.parameters()]
    t = example_grads(model, setup.score, range(len(setup.score)))[0].mean(0)
    p = example_grads(model, setup.pool, pool_rows.tolist())[0].mean(0)
    g, _ = example_grads(model, setup.pool, cand.tolist())
    gsum, cnt = example_grads(model, setup.pool, cand.tolist(), per_token=False)
    bsum, bcnt = example_grads(model, setup.pool, base.tolist(), per_token=False)
    base_sum, base_n = bsum.sum(0), sum(bcnt)
    losses = []
    with torch.no_grad():
        for i in cand.tolist():
            losses.append(float(model(**setup.pool.batch([i])).loss))
    if horizon:  # the benefit that is still there ``horizon`` ordinary steps later
        later = [setup.pool.batch(perm[15 + n_cand + 16 * h:15 + n_cand + 16 * (h + 1)])
                 for h in range(horizon)]
        after = torch.tensor([
            persistent_after(model, opt, sched,
                             setup.pool.batch(torch.cat([base, cand[j:j + 1]])), later,
                             setup.eval) for j in range(len(cand))])
    else:  # right after the candidate's step
        after = torch.tensor([mean_loss(model, setup.eval, params=adam_step_params(
                                  model, opt, (base_sum + gsum[j]) / (base_n + cnt[j])))
                              for j in range(len(cand))])
    benefit = -(after - after.mean())
    scores = rules(g, t, p, sizes, torch.tensor(losses), preconditioner(model, opt))
    src = IN_DOMAIN.get(target, target.split(":", 1)[1] if target.startswith("carve:") else None)
    pos = torch.tensor([setup.sources[i] == src for i in cand.tolist()])
    q = max(1, len(cand) // 4)
    rep = {}
    for name, s in scores.items():
        order = torch.argsort(-s.double())
        rep[name] = {"rho": spearman(s.double(), benefit.double()),
                     "top_quarter": float(benefit[order[:q]].mean()),
                     "top_half": float(benefit[order[:2 * q]].mean()),
                     "auc": auc(s.double(), pos)}
    rep["oracle"] = {"rho": 1.0, "top_quarter": float(benefit.sort(descending=True)[0][:q].mean()),
                     "top_half": float(benefit.sort(descending=True)[0][:2 * q].mean()),
                     "auc": auc(benefit.double(), pos)}
    return rep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=["hamlet", "trivia", "code"])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--checkpoints", nargs="+", type=int, default=[25, 100, 175])
    ap.add_argument("--candidates", type=int, default=160)
    ap.add_argument("--horizon", type=int, default=0,
                    help="measure the benefit N ordinary steps after the candidate's step "
                    "(fixed random batches, the same for every candidate); 0: right after")
    args = ap.parse_args(argv)
    if min(args.checkpoints) < 1:
        ap.error(f"--checkpoints {args.checkpoints}: optimizer steps >= 1 (checkpoints "
                 f"step<N> of the shipped loop)")
    torch.set_num_threads(1)
    table: dict[str, dict[str, list]] = {}
    for target in args.targets:
        setup = Setup(target, 64, 64)
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory(prefix="selection_oracle_") as out:
                for step, model, opt, sched in checkpoints_of_run(setup, seed,
                                                                  args.checkpoints, Path(out)):
                    rep = checkpoint_report(setup, model, opt, sched, step, seed,
                                            args.candidates, target, args.horizon)
                    line = " ".join(f"{k} {v['rho']:+.2f}/{v['top_quarter']*1e3:+.2f}"
                                    for k, v in rep.items())
                    print(f"{target} seed {seed} step {step} (rho / top-quarter benefit "
                          f"x1e-3 nats): {line}", flush=True)
                    for k, v in rep.items():
                        for key, x in v.items():
                            table.setdefault(f"{target}|{k}", {}).setdefault(key, []).append(x)
    print("\n| target | rule | Spearman with benefit | top-quarter benefit (1e-3 nats) | "
          "top-half | in-domain AUC |\n|---|---|---|---|---|---|")
    for key, v in table.items():
        target, rule = key.split("|")
        def ms(xs):
            xs = [x for x in xs if not math.isnan(x)]
            if not xs:
                return "-"
            s = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
            return f"{statistics.mean(xs):+.3f} +- {s:.3f}"
        print(f"| {target} | {rule} | {ms(v['rho'])} | {ms([x * 1e3 for x in v['top_quarter']])}"
              f" | {ms([x * 1e3 for x in v['top_half']])} | {ms(v['auc'])} |")


if __name__ == "__main__":
    main()
