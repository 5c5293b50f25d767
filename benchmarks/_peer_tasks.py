"""The peer benchmark's workload and one adapter per (library, task), run in a worker process.

Workload (seeded, identical for every library): a random-init GPT-2 (4 layers, 4 heads,
vocab 4096, no dropout) whose ``Conv1D`` layers are swapped for equivalent bias-free
``nn.Linear`` (dattri, kronfluence and logix hook only ``nn.Linear``; the biases are zero at
GPT-2's init, and without them every library attributes the same 16 weight matrices);
256 train and 16 query sequences of
T = 128 random tokens; the 16 attention/MLP linears ``transformer.h.*.{attn,mlp}.*`` are
attributed; micro-batches of 16; per-example loss = the sum of the example's token losses.

An adapter is ``fn(wl, clock) -> scores [N, Q]`` (float32, train rows in dataset order):
it imports what it needs first, runs its timed region inside ``with clock:`` (CPU seconds
of this process and wall time), and may compute the scores of a collection-only task after
the timed region (untimed; they exist only for the correlation with exact scores).
"""

from __future__ import annotations

import math
import os
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

N_TRAIN, N_QUERY, SEQ, VOCAB, N_LAYER, BATCH, K = 256, 16, 128, 4096, 4, 16, 1024
SIDE = math.isqrt(K)  # per-side width of a Kronecker/LoGra projection: 32 x 32 = 1024
DAMPING = 0.1  # EK-FAC damping, relative: 0.1 x the layer's mean eigenvalue (kronfluence's)


@dataclass
class Workload:
    model: nn.Module
    train: torch.Tensor  # [N, T] token ids
    query: torch.Tensor  # [Q, T]
    layers: list[str]    # the 16 attributed nn.Linear names
    tmp: str             # scratch folder of this worker


def build(width: int, n_train: int = N_TRAIN, n_query: int = N_QUERY, seq: int = SEQ,
          seed: int = 0) -> Workload:
    """The seeded workload at ``n_embd = width`` (module docstring)."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=width, n_layer=N_LAYER,
                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).eval()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):  # Conv1D computes x @ W + b with W [I, O]
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1], bias=False)
                lin.weight.data.copy_(child.weight.data.T)
                setattr(parent, child_name, lin)  # GPT-2 initializes Conv1D biases to 0
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (n_train + n_query, seq), generator=g)
    layers = [f"transformer.h.{i}.{m}" for i in range(N_LAYER)
              for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    return Workload(model, ids[:n_train], ids[n_train:], layers, tempfile.mkdtemp(prefix="peers_"))


def sum_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum over the batch of every example's summed next-token loss."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                           reduction="sum")


def batches(ids: torch.Tensor, size: int = BATCH):
    return [ids[i:i + size] for i in range(0, len(ids), size)]


class Clock:
    """Times one region: CPU seconds of this process (all threads), wall, peak RSS."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.rss_before_mb = self.peak_mb = 0.0
        self.entered = 0

    def __enter__(self) -> Clock:
        self.entered += 1
        self.rss_before_mb = _rss_mb()
        self._c, self._w = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu += time.process_time() - self._c
        self.wall += time.perf_counter() - self._w
        self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---- exact reference ---------------------------------------------------------------------
def canonical_rows(model: nn.Module, ids: torch.Tensor, layers: list[str]) -> torch.Tensor:
    """``[B, D]`` exact per-example weight gradients of ``layers``, one autograd backward
    per example."""
    params = [p for n in layers for p in model.get_submodule(n).parameters()]
    rows = []
    for x in ids:
        gs = torch.autograd.grad(sum_loss(model, x[None]), params)
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    return torch.stack(rows)


def exact(wl: Workload, clock: Clock) -> torch.Tensor:
    """Exact unprojected grad-dot scores ``[N, Q]`` by per-example autograd (slow)."""
    with clock:
        q = canonical_rows(wl.model, wl.query, wl.layers)
        out = torch.cat([canonical_rows(wl.model, b, wl.layers) @ q.T
                         for b in batches(wl.train, 4)])
    return out


# ---- torch.func vmap baseline -------------------------------------------------------------
def _vmap_rows(wl: Workload, ids: torch.Tensor, projector) -> torch.Tensor:
    """Per-example gradients of the attributed layers by vmap(grad), Kronecker-projected
    with dattri-ds's seeded matrices (``vec(P_out G P_in^T)`` per layer)."""
    from torch.func import functional_call, grad, vmap

    from dattri_ds import kind_for
    from dattri_ds.ops.projection import kron_dims

    model = wl.model
    names = {f"{n}.weight" for n in wl.layers}
    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in names}
    frozen.update(dict(model.named_buffers()))
    own = {k: v.detach() for k, v in model.named_parameters() if k in names}

    def loss_one(p, x):
        return sum_loss(lambda input_ids: functional_call(model, ({**frozen, **p},),
                                                          kwargs={"input_ids": input_ids}),
                        x.unsqueeze(0))

    per_ex = vmap(grad(loss_one), in_dims=(None, 0))
    out = []
    for b in batches(ids):
        g = per_ex(own, b)
        cols = []
        for n in wl.layers:
            mod = model.get_submodule(n)
            kind = kind_for(mod)
            c = kind.canonical(mod, {"weight": g[f"{n}.weight"]})
            o, i = kind.layer_shape(mod)
            if o * i <= K:  # small layers stay exact, as dattri-ds keeps them
                cols.append(c)
                continue
            ko, ki = kron_dims(K, o, i)
            p_out = projector.side(n, "out", ko, o, c.device)
            p_in = projector.side(n, "in", ki, i, c.device)
            cols.append((p_out @ c.view(-1, o, i) @ p_in.T).flatten(1))
        out.append(torch.cat(cols, 1))
    return torch.cat(out)


def _vmap_projector():
    from dattri_ds import ProjectionConfig, Projector
    return Projector(ProjectionConfig(kind="kronecker", dim=K))


def vmap_collect(wl: Workload, clock: Clock) -> torch.Tensor:
    proj = _vmap_projector()
    with clock:
        tr = _vmap_rows(wl, wl.train, proj)
    return tr @ _vmap_rows(wl, wl.query, proj).T


def vmap_graddot(wl: Workload, clock: Clock) -> torch.Tensor:
    proj = _vmap_projector()
    with clock:
        s = _vmap_rows(wl, wl.train, proj) @ _vmap_rows(wl, wl.query, proj).T
    return s


# ---- dattri-ds ----------------------------------------------------------------------------
def _ds_config(projected: bool):
    from dattri_ds import CaptureConfig, ProjectionConfig
    proj = ProjectionConfig(kind="kronecker", dim=K) if projected else None
    return CaptureConfig(include=tuple(_layers_pattern()), projection=proj)


def _layers_pattern() -> list[str]:
    return ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
            "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]


def _ds_batches(ids: torch.Tensor):
    return ({"input_ids": b, "labels": b} for b in batches(ids))


def ds_collect(wl: Workload, clock: Clock) -> torch.Tensor:
    from dattri_ds import GradBatch, collect, make_attributor

    cfg = _ds_config(projected=True)
    with clock:
        train = GradBatch.cat(list(collect(wl.model, _ds_batches(wl.train), cfg)))
    query = GradBatch.cat(list(collect(wl.model, _ds_batches(wl.query), cfg)))
    return make_attributor("graddot").scores([train], query).values


def _ds_graddot(wl: Workload, clock: Clock, projected: bool) -> torch.Tensor:
    from dattri_ds import GradBatch, collect, make_attributor

    cfg = _ds_config(projected)
    with clock:
        query = GradBatch.cat(list(collect(wl.model, _ds_batches(wl.query), cfg)))
        s = make_attributor("graddot").scores(collect(wl.model, _ds_batches(wl.train), cfg),
                                              query).values
    return s


def ds_graddot(wl: Workload, clock: Clock) -> torch.Tensor:
    return _ds_graddot(wl, clock, projected=True)


def ds_graddot_exact(wl: Workload, clock: Clock) -> torch.Tensor:
    return _ds_graddot(wl, clock, projected=False)


def ds_ekfac(wl: Workload, clock: Clock) -> torch.Tensor:
    """One capture of the training set (``Spill``): factor sums, EK-FAC pass and scoring
    read it from disk (kronfluence runs forward + backward for each of the three)."""
    from dattri_ds import GradBatch, KFACConfig, Spill, collect, fit_factors, make_attributor

    cfg = _ds_config(projected=False)
    with clock:
        with Spill(collect(wl.model, _ds_batches(wl.train), cfg), dir=wl.tmp) as train:
            # kronfluence's estimator: the exact damped inverse (power 1, not our default)
            factors = fit_factors(train, config=KFACConfig(damping=DAMPING, power=1.0))
            query = GradBatch.cat(list(collect(wl.model, _ds_batches(wl.query), cfg)))
            s = make_attributor("ekfac", factors=factors).scores(train, query).values
    return s


def _ds_pekfac(wl: Workload, clock: Clock, whitened: bool) -> torch.Tensor:
    """Projected EK-FAC through ``Recipe`` (what ``benchmarks/lds.py`` scores): one capture
    of the training set (``Spill``; LoGra keeps only its Kronecker-projected sides,
    ``Spill(projector=)``), the factors fitted from it (LoGra: in the projected space;
    ``whitened``: exact factors, rows whitened, then projected), the projected rows, the
    query and the scores, all inside the clock."""
    from dattri_ds import Checkpoint, GradBatch, KFACConfig, ProjectionConfig, Spill, collect
    from dattri_ds.methods.recipe import Recipe

    recipe = Recipe(method="ekfac", projection=ProjectionConfig(kind="kronecker", dim=K),
                    logra=not whitened, whitened=whitened)
    cfg = _ds_config(projected=False)
    with clock:
        with Spill(collect(wl.model, _ds_batches(wl.train), cfg), dir=wl.tmp,
                   projector=recipe.projector if recipe.logra else None) as train:
            factors = recipe.fit(train, KFACConfig(damping=DAMPING, power=1.0))
            rows = recipe.rows(train, factors)
        query = recipe.query(GradBatch.cat(list(collect(wl.model, _ds_batches(wl.query),
                                                        recipe.query_capture(cfg)))))
        s = recipe.score([Checkpoint(rows, query, 1.0, factors)]).values
    return s


def ds_pekfac(wl: Workload, clock: Clock) -> torch.Tensor:
    """LoGra: Kronecker-projected rows (k = 32 x 32 per layer), factors fitted in that space."""
    return _ds_pekfac(wl, clock, whitened=False)


def ds_pekfac_whitened(wl: Workload, clock: Clock) -> torch.Tensor:
    """The library's faithful recipe at the same k: exact EK-FAC factors, rows whitened by
    them, then Kronecker-projected (``collect --factors``)."""
    return _ds_pekfac(wl, clock, whitened=True)


def floor(wl: Workload, clock: Clock) -> None:
    """The fp32 floor of collection: forward + backward to the attributed layers' outputs
    only (``autograd.grad``, no weight-gradient GEMMs, nothing captured or projected)."""
    model, outs = wl.model, []
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o: outs.append(o))
             for n in wl.layers]
    with clock:
        for b in batches(wl.train):
            outs.clear()
            torch.autograd.grad(model(input_ids=b, labels=b).loss, outs)
    for h in hooks:
        h.remove()
    return None


def plain_step(wl: Workload, clock: Clock) -> None:
    """Memory/time floor: one SGD training step per micro-batch (forward, backward, update)."""
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.0)
    with clock:
        for b in batches(wl.train):
            opt.zero_grad(set_to_none=True)
            wl.model(input_ids=b, labels=b).loss.backward()
            opt.step()
    return None


# ---- dattri-llm ---------------------------------------------------------------------------
def _dl_setup(wl: Workload):
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.hooks import HookManagerConfig

    proj = {"__default__": {"style": "logra", "proj_dim": SIDE, "proj_seed": 0,
                             "proj_max_batch_size": 32}}
    # invasive: the library's fastest capture (skips the weight-gradient GEMMs)
    hook = HookManagerConfig(invasive_linear_io=[f"^{n}$" for n in wl.layers],
                             projection_kwargs=proj, capture_style="auto")
    args = AttributionArguments(output_dir=os.path.join(wl.tmp, "dl"),
                                per_device_train_batch_size=BATCH,
                                per_device_eval_batch_size=N_QUERY,
                                dataloader_pin_memory=False)
    return hook, args


def _dl_loss(model, batch):
    return sum_loss(model, batch["input_ids"])


def _dl_rows(wl: Workload, ids: torch.Tensor, hook, args) -> list:
    from dattri_llm.gradient.streaming import GradientStreamer

    ds = [{"input_ids": x} for x in ids]
    with GradientStreamer(wl.model, ds, args, batch_size=BATCH, loss_fn=_dl_loss,
                          config=hook) as src:
        return [g for _, g, _ in src]


def _dl_scores(train: list, query: list) -> torch.Tensor:
    q = query[0]
    for extra in query[1:]:
        q = q.concatenate(extra)
    return torch.cat([g.similarity(q, reduce="all") for g in train]).float()


def dl_collect(wl: Workload, clock: Clock) -> torch.Tensor:
    hook, args = _dl_setup(wl)
    with clock:
        train = _dl_rows(wl, wl.train, hook, args)
    return _dl_scores(train, _dl_rows(wl, wl.query, hook, args))


def dl_graddot(wl: Workload, clock: Clock) -> torch.Tensor:
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor
    from dattri_llm.task import AttributionTask

    hook, args = _dl_setup(wl)
    train = [{"input_ids": x} for x in wl.train]
    query = [{"input_ids": x} for x in wl.query]
    task = AttributionTask(_dl_loss, wl.model)
    with clock:
        score = TracInAttributor(args, task=task).attribute(train, query, hook_config=hook)
    return _dl_matrix(score, wl)


def _dl_matrix(score, wl: Workload) -> torch.Tensor:
    """The ``[N, Q]`` matrix in dataset order (rows are keyed by content hash)."""
    from dattri_llm.utils.hashing import hash_sample

    train_ids, matrix = score.agnostic_matrix()
    matrix = matrix.float().cpu()
    if matrix.shape[0] != len(train_ids):
        matrix = matrix.T
    where = {h: i for i, h in enumerate(train_ids)}
    order = [where[hash_sample({"input_ids": x})] for x in wl.train]
    return matrix[order]


# ---- bergson ------------------------------------------------------------------------------
def _bg_rows(wl: Workload, ids: torch.Tensor, tag: str) -> torch.Tensor:
    from datasets import Dataset

    from bergson import GradientProcessor, IndexConfig, InMemoryCollector
    from bergson.collector.collector import CollectorComputer

    run = os.path.join(wl.tmp, f"bergson_{tag}")
    os.makedirs(run + ".part", exist_ok=True)
    cfg = IndexConfig(run_path=run, projection_dim=SIDE, loss_reduction="sum",
                      token_batch_size=BATCH * SEQ, max_batch_size=BATCH)
    proc = GradientProcessor(projection_dim=SIDE, projection_type=cfg.projection_type)
    data = Dataset.from_dict({"input_ids": ids.tolist()})
    prefix = "transformer."  # bergson hooks the base model (names without the prefix)
    coll = InMemoryCollector(model=wl.model.base_model, data=data, cfg=cfg, processor=proc,
                             target_modules={n.removeprefix(prefix) for n in wl.layers})
    CollectorComputer(model=wl.model, data=data, collector=coll, cfg=cfg,
                      batches=[list(range(i, min(i + BATCH, len(ids))))
                               for i in range(0, len(ids), BATCH)]).run_with_collector_hooks()
    return torch.cat([coll.gradients[n.removeprefix(prefix)].float() for n in wl.layers], 1)


def bg_collect(wl: Workload, clock: Clock) -> torch.Tensor:
    import bergson  # noqa: F401  (imported before the clock starts)

    with clock:
        tr = _bg_rows(wl, wl.train, "train")
    return tr @ _bg_rows(wl, wl.query, "query").T


def bg_graddot(wl: Workload, clock: Clock) -> torch.Tensor:
    import bergson  # noqa: F401

    with clock:
        s = _bg_rows(wl, wl.train, "train") @ _bg_rows(wl, wl.query, "query").T
    return s


# ---- kronfluence --------------------------------------------------------------------------
def kf_ekfac(wl: Workload, clock: Clock) -> torch.Tensor:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return sum_loss(model, batch["input_ids"])

        def compute_measurement(self, batch, model):
            return sum_loss(model, batch["input_ids"])

        def get_influence_tracked_modules(self):
            return list(wl.layers)

        def get_attention_mask(self, batch):
            return None

    task = LMTask()
    train = [{"input_ids": x} for x in wl.train]
    query = [{"input_ids": x} for x in wl.query]
    with clock:
        model = prepare_model(wl.model, task)
        an = Analyzer(analysis_name="peers", model=model, task=task,
                      output_dir=os.path.join(wl.tmp, "kf"), disable_tqdm=True,
                      disable_model_save=True)
        an.fit_all_factors(factors_name="ekfac", dataset=train, per_device_batch_size=BATCH,
                           factor_args=FactorArguments(strategy="ekfac",
                                                       use_empirical_fisher=True),
                           overwrite_output_dir=True)
        an.compute_pairwise_scores(scores_name="s", factors_name="ekfac", query_dataset=query,
                                   train_dataset=train, per_device_query_batch_size=N_QUERY,
                                   per_device_train_batch_size=BATCH,
                                   score_args=ScoreArguments(damping_factor=None),
                                   overwrite_output_dir=True)
        s = an.load_pairwise_scores("s")["all_modules"]
    return s.T.float().cpu()


# ---- logix (LoGra) -----------------------------------------------------------------------
def lx_pekfac(wl: Workload, clock: Clock) -> torch.Tensor:
    """LogIX's projected EK-FAC: ``add_lora`` puts a random rank-32 encoder / zero
    bottleneck / decoder on every attributed linear (LoGra: the bottleneck's gradient is the
    Kronecker-projected gradient, 32 x 32 = k per layer); pass 1 fits the activation and
    output-gradient covariances in that space, pass 2 logs the projected per-example
    gradients (to its memory-mapped log) and their EK-FAC eigenvalues, then the query's
    projected gradients are preconditioned (damping 0.1 x mean eigenvalue, LogIX's default)
    and dotted with the logged training rows."""
    from logix import LogIX

    folder = os.path.join(wl.tmp, "logix")
    cfg_path = os.path.join(wl.tmp, "logix.yaml")
    with open(cfg_path, "w") as f:
        f.write(f"root_dir: {folder}\nlora:\n  rank: {SIDE}\n  init: random\n")
    model = wl.model

    def backward(run, ids: torch.Tensor, tags: list[str]) -> None:
        with run(data_id=tags):
            model.zero_grad(set_to_none=True)
            sum_loss(model, ids).backward()

    train_tags = [f"t{i}" for i in range(len(wl.train))]
    with clock:
        run = LogIX("peers", config=cfg_path)
        run.watch(model, name_filter=list(wl.layers))
        run.add_lora()
        run.setup({"forward": ["covariance"], "backward": ["covariance"]})
        for s, b in zip(range(0, len(wl.train), BATCH), batches(wl.train)):
            backward(run, b, train_tags[s:s + BATCH])
        run.setup({"grad": ["log", "corrected_eigval"]})
        run.save(True)
        for s, b in zip(range(0, len(wl.train), BATCH), batches(wl.train)):
            backward(run, b, train_tags[s:s + BATCH])
        run.finalize()
        run.eval()
        run.setup({"grad": ["log"]})
        backward(run, wl.query, [f"q{i}" for i in range(len(wl.query))])
        result = run.compute_influence_all(run.get_log(), run.build_log_dataloader(BATCH))
    where = {t: i for i, t in enumerate(result["tgt_ids"])}
    return result["influence"].T[[where[t] for t in train_tags]].float()


# ---- the registry -------------------------------------------------------------------------
Adapter = Callable[[Workload, Clock], torch.Tensor | None]

#: library -> (module whose presence means "installed", {task: adapter})
LIBRARIES: dict[str, tuple[str | None, dict[str, Adapter]]] = {
    "vmap": (None, {"collect": vmap_collect, "graddot": vmap_graddot}),
    "dattri-ds": (None, {"collect": ds_collect, "graddot": ds_graddot, "ekfac": ds_ekfac,
                         "pekfac": ds_pekfac, "plain": plain_step}),
    "dattri-ds whitened": (None, {"pekfac": ds_pekfac_whitened}),
    "dattri-ds exact": (None, {"graddot": ds_graddot_exact, "pekfac": ds_ekfac}),
    "dattri-llm": ("dattri_llm", {"collect": dl_collect, "graddot": dl_graddot}),
    "bergson": ("bergson", {"collect": bg_collect, "graddot": bg_graddot}),
    # kronfluence has no projection: its unprojected EK-FAC is its projected-EK-FAC point
    "kronfluence": ("kronfluence", {"ekfac": kf_ekfac, "pekfac": kf_ekfac}),
    "logix": ("logix", {"pekfac": lx_pekfac}),
    "fp32 floor": (None, {"collect": floor}),
    "exact": (None, {"reference": exact}),
}
PEERS = ("dattri-llm", "bergson", "kronfluence", "logix")
