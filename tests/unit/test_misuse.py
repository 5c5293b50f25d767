"""Bad input and misuse of GradientCapture: correct results or a clear error naming the module.

Invariants: capture never yields a half-captured batch, never keeps an evaluation forward's
activations alive, never counts a recomputed (checkpointed) forward twice.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from dattri_ds import (
    CaptureConfig, CaptureError, GradientCapture, ProjectionConfig, UnsupportedLayerError,
    materialize,
)
from reference import reference_grads, rel_err, tiny_gpt2


def test_model_without_supported_layer():
    """A model with only unsupported layers is an error naming what is supported."""
    net = nn.Sequential(nn.Conv2d(1, 2, 3))
    with pytest.raises(UnsupportedLayerError, match="no layer that dattri-ds can capture"):
        with pytest.warns(UserWarning):
            GradientCapture(net).attach()


def test_unsupported_trainable_layer_warns_or_raises_by_name():
    """An uncovered trainable module is listed by name (warning), or raises under strict;
    excluding it by name silences the warning (checked: any warning is an error there)."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1))
    with pytest.warns(UserWarning, match=r"1 \(Conv1d\)"):
        GradientCapture(net).attach().detach()
    with pytest.raises(UnsupportedLayerError, match=r"1 \(Conv1d\).*strict"):
        GradientCapture(net, CaptureConfig(strict=True)).attach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # excluded layers are not reported as unsupported
        GradientCapture(net, CaptureConfig(exclude=("1",))).attach().detach()


def test_attach_twice_is_refused():
    """Two captures on one model would double-record every layer: refused."""
    model = tiny_gpt2()
    with GradientCapture(model):
        with pytest.raises(CaptureError, match="already attached"):
            GradientCapture(model).attach()
    with GradientCapture(model):  # detached cleanly: attaching again works
        pass


def test_forward_without_backward_yields_nothing_and_frees_memory():
    """Evaluation forwards (with or without grad) produce no batch and keep nothing alive."""
    model = tiny_gpt2()
    ids = torch.randint(0, 97, (2, 8))
    with GradientCapture(model) as cap:
        with torch.no_grad():
            model(input_ids=ids)
        out = model(input_ids=ids, labels=ids)
        ref = weakref.ref(out.logits)
        del out
        gc.collect()
        assert ref() is None
        model(input_ids=ids, labels=ids).loss.backward()  # next real step still works
        batches = cap.drain()
        assert len(batches) == 1
        assert cap._open == []
    model.zero_grad(set_to_none=True)
    assert rel_err(materialize(batches[0].layers["lm_head"]),
                   reference_grads(model, ids)["lm_head"]) <= 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_not_double_counted(reentrant):
    """Checkpointed layers re-run their forward in backward; gradients are counted once."""
    model = tiny_gpt2()
    ids = torch.randint(0, 97, (3, 8))
    ref = reference_grads(model, ids)
    model.train()
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with GradientCapture(model) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
        batches = cap.drain()
    assert len(batches) == 1
    for name, lg in batches[0].layers.items():
        assert rel_err(materialize(lg), ref[name]) <= 1e-6, name


def test_nonfinite_gradients_skip_or_raise_naming_layer():
    """NaN/inf output-grads: the micro-batch is dropped with a warning naming the layer, or
    raises CaptureError under on_nonfinite='raise'."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    cfg = CaptureConfig(loss_reduction="sum", label_shift=0)
    with GradientCapture(net, cfg) as cap:
        with pytest.warns(UserWarning, match=r"Layer '\d' has a NaN"):
            (net(x).sum() * float("nan")).backward()
        assert cap.pop() is None and cap.skipped == 1
    with GradientCapture(net, CaptureConfig(loss_reduction="sum", label_shift=0,
                                            on_nonfinite="raise")):
        with pytest.raises(CaptureError, match=r"Layer '\d' has a NaN"):
            (net(x).sum() * float("inf")).backward()


@pytest.mark.parametrize("proj", [None, ProjectionConfig(dim=4)])
def test_nonfinite_example_drops_only_that_example(proj):
    """An inf in one example's output-grads drops only that example, named by its sample id
    (with a projection the check runs on the projected rows, through which NaN/inf
    propagate): the kept rows equal those of the same examples captured cleanly. Breaks if
    the whole micro-batch is dropped or a poisoned row is kept."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11))
    x = torch.randint(0, 11, (3, 5))
    cfg = CaptureConfig(loss_reduction="sum", label_shift=0, projection=proj)

    def run(poison: bool):
        with GradientCapture(net, cfg) as cap:
            cap.tag(["a", "b", "c"])
            out = net(x)
            if poison:
                out.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
            out.sum().backward()
            net.zero_grad(set_to_none=True)
            return cap.pop(), cap

    clean, _ = run(False)
    with pytest.warns(UserWarning, match=r"Layer '\d' has a NaN.*1 example\(s\) \['b#"
                                         r"[0-9a-f]+'\].*only those are dropped, the other 2"):
        got, cap = run(True)
    assert cap.skipped == 0 and cap.skipped_examples == 1
    assert got.sample_ids == (clean.sample_ids[0], clean.sample_ids[2])
    assert got.kept.tolist() == [0, 2] and clean.kept is None  # returned with the batch
    for name, lg in got.layers.items():
        want = clean.layers[name].index(torch.tensor([0, 2]))
        if proj is None:
            torch.testing.assert_close(materialize(lg), materialize(want))
        else:
            torch.testing.assert_close(lg.data.values, want.data.values)


def test_nonfinite_every_example_drops_the_batch():
    """NaN in every example drops the micro-batch (counted in ``skipped``); a finite batch
    afterwards is captured."""
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(3, 8)
    cfg = CaptureConfig(loss_reduction="sum", label_shift=0, projection=ProjectionConfig(dim=4))
    with GradientCapture(net, cfg) as cap:
        with pytest.warns(UserWarning, match=r"3 example\(s\).*the micro-batch is dropped"):
            (net(x).sum() * float("nan")).backward()
        assert cap.pop() is None and cap.skipped == 1 and cap.skipped_examples == 3
        net(x).sum().backward()
        assert cap.pop() is not None


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


def test_shared_module_needs_allow_shared_and_then_sums():
    """A module called twice per forward is an error by default; allowed, its per-example
    gradient is the sum over both calls (tokens concatenate)."""
    net = _Twice()
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="without integer"):
        with GradientCapture(net, CaptureConfig(loss_reduction="sum", label_shift=0)):
            with pytest.raises(CaptureError, match="'fc' ran 2 times"):
                net(x).pow(2).sum().backward()
    net.zero_grad()
    cfg = CaptureConfig(loss_reduction="sum", label_shift=0, allow_shared=True)
    with pytest.warns(UserWarning, match="without integer"):
        with GradientCapture(net, cfg) as cap:
            net(x).pow(2).sum().backward()
            got = materialize(cap.pop().layers["fc"])
    ref = []
    for b in range(3):
        net.zero_grad()
        net(x[b:b + 1]).pow(2).sum().backward()
        ref.append(torch.cat([net.fc.weight.grad, net.fc.bias.grad[:, None]], 1).flatten())
    assert rel_err(got, torch.stack(ref)) <= 1e-6


def test_layer_without_gradient_gets_exact_zero():
    """A layer that ran but did not influence the loss yields zero gradients, not a gap."""
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            self.unused(x)
            return self.used(x)

    net = Branch()
    with pytest.warns(UserWarning, match="without integer"):
        with GradientCapture(net, CaptureConfig(loss_reduction="sum", label_shift=0)) as cap:
            net(torch.randn(4, 3)).sum().backward()
            batch = cap.pop()
    assert set(batch.layers) == {"used", "unused"}
    assert torch.count_nonzero(materialize(batch.layers["unused"])) == 0
    assert materialize(batch.layers["unused"]).shape == (4, 8)


def test_config_rejects_unknown_keys_and_values():
    """from_dict rejects unknown keys listing the allowed ones; bad values name the field."""
    from dattri_ds import ConfigError
    with pytest.raises(ConfigError, match="allowed keys"):
        CaptureConfig.from_dict({"projecton": {}})
    with pytest.raises(ConfigError, match="loss_reduction"):
        CaptureConfig(loss_reduction="avg")
    cfg = CaptureConfig.from_dict({"projection": {"dim": 64}, "exclude": ["lm_head"]})
    assert cfg.projection.dim == 64 and cfg.exclude == ("lm_head",)


def test_capture_config_choices_mirror_semantics():
    """CaptureConfig's Literal hints (checked by the schema) are exactly semantics.py's."""
    import typing

    from dattri_ds.capture.semantics import LOSS_REDUCTIONS, PER_EXAMPLE_LOSSES
    hints = typing.get_type_hints(CaptureConfig)
    assert typing.get_args(hints["loss_reduction"]) == LOSS_REDUCTIONS
    assert typing.get_args(hints["per_example_loss"]) == PER_EXAMPLE_LOSSES


def test_tied_embeddings_are_one_exact_layer():
    """GPT-2 with tied wte/lm_head: one 'lm_head' layer whose per-example gradient is the
    whole shared weight's (both uses summed), and ghost grams include the cross terms."""
    from dattri_ds import cross_gram
    model = tiny_gpt2(tie=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 97, (3, 8))
    with GradientCapture(model) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
        batch = cap.pop()
    model.zero_grad(set_to_none=True)
    assert "transformer.wte" not in batch.layers
    ref = reference_grads(model, ids)  # p.grad of a tied weight is the total
    got = materialize(batch.layers["lm_head"])
    assert rel_err(got, ref["lm_head"]) <= 1e-6
    gram = cross_gram(batch, batch, layers=["lm_head"], path="ghost")
    assert rel_err(gram, ref["lm_head"] @ ref["lm_head"].T) <= 1e-6


def test_untied_shared_kinds_warn():
    """A tie no rule covers (LayerNorm weight shared with a Linear) is named in a warning."""
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 4, bias=False)
            self.fc.weight = nn.Parameter(torch.ones(4, 4))
            self.ln.weight = nn.Parameter(torch.ones(4))
            self.ln2 = nn.LayerNorm(4)
            self.ln2.weight = self.ln.weight
            self.fc2 = nn.Linear(4, 4, bias=False)
            self.fc2.weight = self.fc.weight

        def forward(self, x):
            return self.fc2(self.ln2(self.fc(self.ln(x))))

    with pytest.warns(UserWarning, match="share a parameter"):
        GradientCapture(Odd()).attach().detach()
