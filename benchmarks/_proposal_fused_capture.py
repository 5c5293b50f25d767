"""Prototype of a proposed capture change, used only by ``capture_overhead.py --proposal``.

NOT library code: it overrides private methods of ``GradientCapture`` to measure what the
proposal would save, and it covers only what the benchmark model needs (one call per layer,
no ``capture.dtype``). The proposal, for ``CaptureConfig(projection=...)``:

1. Project straight from the saved ``(a, g)``: for outer-product kinds with a bias, use
   ``P_in a'_t = P_in[:, :I] a_t + P_in[:, I]`` (one ``addmm``) instead of concatenating a
   ones column onto every activation (``with_bias_column`` copies ``[B, T, I+1]``).
2. Apply the per-example loss scale to the projected rows ``[B, P]`` (projection is linear
   per example) instead of writing a scaled copy of every output-grad (``_scaled``).
3. Check NaN/inf on the projected rows (IEEE NaN/inf propagate through the projection)
   instead of ``torch.isfinite(g).all()`` on every output-grad (``_nonfinite``).

Without projection, item 3 alone becomes ``torch.isfinite(g.sum())``: one reduction pass
without a ``[B, T, O]`` bool temporary (see ``cheap_nonfinite``).
"""

from __future__ import annotations

import torch

from dattri_ds import GradientCapture
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad
from dattri_ds.layers.embedding import EmbeddingKind
from dattri_ds.layers.outer import OuterProductKind
from dattri_ds.ops.projection import kron_dims
from dattri_ds.semantics import example_scale


def cheap_nonfinite(data: Factorized | Dense) -> bool:
    """Drop-in for ``capture._nonfinite``: a sum is NaN/inf when any element is (or on
    fp32 overflow of the sum, which is a gradient worth flagging anyway)."""
    t = data.g if isinstance(data, Factorized) else data.values
    return not bool(torch.isfinite(t.sum()))


class FusedProjectCapture(GradientCapture):
    """GradientCapture whose end-of-backward step projects without intermediate copies."""

    def _finalize(self, rec) -> None:  # noqa: C901 - prototype
        rec.done = True
        self._in_backward = None
        if rec in self._open:
            self._open.remove(rec)
        if self._projector is None:
            raise RuntimeError("FusedProjectCapture needs CaptureConfig(projection=...)")
        cfg, proj = self.config, self._projector
        some_a = next(iter(rec.pairs.values()))[0][0]
        info = self._info(rec, some_a.shape[0])
        scale_c = cfg.backward_scale * (self.scale_fn() if self.scale_fn else 1.0)
        scale = example_scale(info.token_counts, loss_reduction=cfg.loss_reduction,
                              per_example_loss=cfg.per_example_loss,
                              backward_scale=scale_c).float()
        k, tag = proj.config.dim, proj.config.tag
        layers = {}
        for name, (module, kind) in self.layers.items():
            pairs = rec.pairs.get(name)
            if not pairs:
                continue
            (a, g), = pairs
            o, i = kind.layer_shape(module)
            if o * i > k and isinstance(kind, (OuterProductKind, EmbeddingKind)):
                ko, ki = kron_dims(k, o, i)
                p_out = proj.side(name, "out", ko, o, g.device)
                p_in = proj.side(name, "in", ki, i, g.device)
                if isinstance(kind, EmbeddingKind):
                    vals = kind.project_kron(kind.build(module, a, g), p_out, p_in)
                else:
                    g3 = g.reshape(g.shape[0], -1, o)
                    a3 = a.reshape(a.shape[0], -1, a.shape[-1])
                    if a3.shape[-1] == i - 1:  # bias column folded into P_in
                        aa = torch.addmm(p_in[:, -1], a3.reshape(-1, i - 1), p_in[:, :-1].T)
                        aa = aa.view(*a3.shape[:2], ki)
                    else:
                        aa = a3 @ p_in.T
                    vals = torch.bmm((g3 @ p_out.T).transpose(1, 2), aa).reshape(g3.shape[0], -1)
                label = tag
            else:
                data = kind.build(module, a, g)
                vals = data.values if isinstance(data, Dense) else kind.materialize(data, (o, i))
                label = f"identity:{tag}"
            layers[name] = LayerGrad(name, kind.name, Dense(vals * scale[:, None]), (o, i), label)
        rec.pairs.clear()
        if not all(bool(torch.isfinite(lg.data.values).all()) for lg in layers.values()):
            self._nonfinite(next(iter(layers)), rec)
            return
        self._deliver(GradBatch(rec.step, info.sample_ids, layers, rec.index, info.token_counts))
