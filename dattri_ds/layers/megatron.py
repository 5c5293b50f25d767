"""Megatron-core tensor-parallel layers: Column/RowParallelLinear, VocabParallelEmbedding.

Matched by class name (``type(m).__mro__``), so ``import dattri_ds`` never imports megatron.
Activations are sequence-first ``[S, B, H]``: every kind turns them batch-first, and
``batch_dim`` tells capture where B is for the per-example scale. Each rank captures the
factors of its own weight shard (``shard_info``); sequence-parallel sides are all-gathered.
What each kind captures, and why (the bias column of a row-parallel layer belongs to the
last rank, ``skip_bias_add``, sequence-first norms): docs/integrations.md, "Megatron-core
tensor parallelism".

Refused at start (``check``): expert layers (tokens are permuted), Transformer Engine
modules, a weight supplied at call time, pipeline parallelism, sizes that the
tensor-parallel size does not divide.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from dattri_ds.errors import CaptureError, ConfigError, UnsupportedLayerError
from dattri_ds.gradient import Factorized, ShardInfo
from dattri_ds.layers.base import MARK_PREFIX, LayerKind, get_kind
from dattri_ds.layers.embedding import EmbeddingKind
from dattri_ds.layers.norm import DenseKind
from dattri_ds.layers.outer import OuterProductKind, with_bias_column

__all__ = ["ColumnParallelLinearKind", "RowParallelLinearKind", "VocabParallelEmbeddingKind",
           "SequenceFirstNormKind", "UnsupportedMegatronKind", "SEQUENCE_FIRST_ATTR",
           "UNSUPPORTED_ATTR", "tp_of", "split_even", "gather_sequence"]

#: Set by ``prepare_model`` on norms in a Megatron decoder: ``(sp_group, sp_world)``.
SEQUENCE_FIRST_ATTR = MARK_PREFIX + "sequence_first"
#: Set by ``prepare_model`` on modules dattri-ds would capture wrongly: the reason.
UNSUPPORTED_ATTR = MARK_PREFIX + "unsupported"

#: Megatron / Transformer Engine classes with trainable parameters that are not supported.
_UNSUPPORTED_CLASSES = {
    "TELinear": "a Transformer Engine linear",
    "TEColumnParallelLinear": "a Transformer Engine linear",
    "TERowParallelLinear": "a Transformer Engine linear",
    "TELayerNormColumnParallelLinear": "a Transformer Engine linear with a fused layer norm",
    "TEGroupedLinear": "a grouped expert linear",
    "TEColumnParallelGroupedLinear": "a grouped expert linear",
    "TERowParallelGroupedLinear": "a grouped expert linear",
    "GroupedMLP": "a grouped expert MLP",
    "TENorm": "a Transformer Engine norm",
    "FusedLayerNorm": "an Apex fused layer norm",
    "TopKRouter": "an MoE router",
}
_LINEARS = {"ColumnParallelLinear", "RowParallelLinear"}
_NAMES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _megatron_class(cls: type, names: set[str] | str) -> str | None:
    """The first class of ``cls``'s MRO named in ``names`` and defined by megatron/TE."""
    names = {names} if isinstance(names, str) else names
    for c in cls.__mro__:
        if c.__name__ in names and c.__module__.startswith(("megatron.", "transformer_engine.")):
            return c.__name__
    return None


def _name(module: nn.Module) -> str:
    return _NAMES.get(module, type(module).__name__)


def tp_of(module: nn.Module) -> tuple[Any, int, int]:
    """``(group, rank, world)`` of the module's tensor-parallel group (world 1 if none).

    Megatron >= 0.13 keeps the group on the module (``tp_group``); older versions use the
    global one of ``parallel_state``.
    """
    group = getattr(module, "tp_group", None)
    if group is None and not hasattr(module, "tp_group"):
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            group = ps.get_tensor_model_parallel_group()
    if group is None:
        return None, 0, 1
    return group, group.rank(), group.size()


def split_even(name: str, what: str, size: int, world: int) -> int:
    """``size / world``, or ConfigError naming the layer when the split is uneven."""
    if world < 1 or size % world:
        raise ConfigError(
            f"Layer '{name}': {what} = {size} is not divisible by the tensor-parallel size "
            f"{world}; choose sizes divisible by tensor_model_parallel_size")
    return size // world


def gather_sequence(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``[S/R, ...] -> [S, ...]``: all-gather a sequence-parallel shard along dim 0 (rank order)."""
    if world == 1:
        return t
    import torch.distributed as dist

    t = t.detach().contiguous()
    bufs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs, t, group=group)
    return torch.cat(bufs, 0)


def _batch_first(module: nn.Module, t: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """``[S, B, F] -> [B, S, F]`` (``F + 1`` with ``bias``), refusing inputs without a batch
    dimension.

    A view, not a copy: the factor keeps Megatron's memory layout and the projections
    multiply it in place (``outer.rows_matmul``); the bias column, when asked for, is
    appended in that layout too (one copy instead of transpose-copy plus cat).
    """
    if t.dim() != 3:
        raise CaptureError(
            f"Layer '{_name(module)}' ({type(module).__name__}) saw a tensor of shape "
            f"{tuple(t.shape)}; per-example gradients need sequence-first [S, B, H] "
            f"activations (token-flattened inputs such as MoE experts lose the example)")
    if bias:
        t = with_bias_column(t)
    return t.transpose(0, 1)


def _check_parallel(module: nn.Module, name: str) -> None:
    """Refuse pipeline parallelism (start-up check shared by the Megatron kinds)."""
    pp = getattr(getattr(module, "config", None), "pipeline_model_parallel_size", 1) or 1
    if pp == 1:
        try:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                pp = ps.get_pipeline_model_parallel_world_size()
        except ImportError:  # pragma: no cover - a megatron module implies megatron
            pass
    if pp > 1:
        raise ConfigError(
            f"Layer '{name}': pipeline parallelism (pipeline_model_parallel_size={pp}) is not "
            f"supported: the per-example losses are computed on another stage than this "
            f"layer. Use tensor and data parallelism only (pipeline_model_parallel_size=1)")


class _MegatronLinear(OuterProductKind):
    """Shared capture rules of Column/RowParallelLinear (outputs are ``(output, bias)``)."""

    cls_name: str = ""
    #: The weight dimension split over the tensor-parallel group: 0 (``output_size``) for
    #: column-parallel, 1 (``input_size``) for row-parallel; it is also the canonical
    #: ``(O, I')`` dimension of the shard.
    shard_dim: int = 0

    def matches(self, module: nn.Module) -> bool:
        return self.match_class(type(module))

    def match_class(self, cls: type) -> bool:
        return _megatron_class(cls, self.cls_name) is not None

    def batch_dim(self, module: nn.Module) -> int:
        return 1

    def output(self, module: nn.Module, output):
        return output[0] if isinstance(output, tuple) else output

    def check(self, module: nn.Module, name: str) -> None:
        _NAMES[module] = name
        _check_parallel(module, name)
        if getattr(module, "weight", None) is None:
            raise UnsupportedLayerError(
                f"Layer '{name}' ({type(module).__name__}) gets its weight at call time "
                f"(skip_weight_param_allocation, e.g. an output layer tied to the embedding); "
                f"build the model with share_embeddings_and_output_weights=False or exclude "
                f"it with capture.exclude=['{name}']")
        _, _, world = tp_of(module)
        size, per = self._split_sizes(module)
        want = split_even(name, self._split_attr, size, world)
        if per != want:
            raise ConfigError(f"Layer '{name}': {self._split_attr}_per_partition = {per}, "
                              f"expected {want}")

    @property
    def _split_attr(self) -> str:
        return ("output_size", "input_size")[self.shard_dim]

    def _split_sizes(self, module: nn.Module) -> tuple[int, int]:
        """``(full size, this rank's size)`` of the split dimension."""
        return (getattr(module, self._split_attr),
                getattr(module, f"{self._split_attr}_per_partition"))

    @staticmethod
    def _bias(module: nn.Module) -> int:
        return int(getattr(module, "bias", None) is not None)

    def _bias_column(self, module: nn.Module) -> int:
        """1 when this rank's block carries the bias column of the canonical layout."""
        return self._bias(module)

    def shard_info(self, module):
        group, rank, world = tp_of(module)
        if world == 1:
            return None
        full = (module.output_size, module.input_size + self._bias(module))
        return ShardInfo(self.shard_dim, rank, world, full,
                         offset=rank * self._split_sizes(module)[1], group=group)

    def canonical(self, module, grads):
        w = grads["weight"]
        if "bias" in grads and self._bias_column(module):
            w = torch.cat([w, grads["bias"].unsqueeze(-1)], dim=-1)
        return w.flatten(-2)


class ColumnParallelLinearKind(_MegatronLinear, name="megatron_column"):
    """ColumnParallelLinear: shard of the output dimension (canonical dim 0)."""

    cls_name = "ColumnParallelLinear"
    shard_dim = 0

    def layer_shape(self, module):
        return module.output_size_per_partition, module.input_size + self._bias(module)

    def activation(self, module, args):
        a = args[0]
        group, _, world = tp_of(module)
        if getattr(module, "sequence_parallel", False) and world > 1:
            a = gather_sequence(a, group, world)  # Megatron gathers it too, inside the matmul
        return a

    def build(self, module, a, g):
        per = module.output_size_per_partition
        if g.shape[-1] != per:  # gather_output: the hooked output holds every shard
            _, rank, _ = tp_of(module)
            g = g.narrow(-1, rank * per, per)
        return Factorized(_batch_first(module, a, bias=bool(self._bias(module))),
                          _batch_first(module, g))


class RowParallelLinearKind(_MegatronLinear, name="megatron_row"):
    """RowParallelLinear: shard of the input dimension (canonical dim 1); bias on the last rank."""

    cls_name = "RowParallelLinear"
    shard_dim = 1

    def _bias_column(self, module: nn.Module) -> int:
        """The replicated bias is added once, after the reduction: the last rank owns it."""
        _, rank, world = tp_of(module)
        return self._bias(module) if rank == world - 1 else 0

    def layer_shape(self, module):
        return module.output_size, module.input_size_per_partition + self._bias_column(module)

    def activation(self, module, args):
        a = args[0]
        _, rank, world = tp_of(module)
        if not module.input_is_parallel and world > 1:  # Megatron scatters it the same way
            per = module.input_size_per_partition
            a = a.narrow(-1, rank * per, per)
        return a

    def build(self, module, a, g):
        group, _, world = tp_of(module)
        if getattr(module, "sequence_parallel", False):
            g = gather_sequence(g, group, world)  # the output was reduce-scattered along S
        return Factorized(_batch_first(module, a, bias=bool(self._bias_column(module))),
                          _batch_first(module, g))


class VocabParallelEmbeddingKind(EmbeddingKind, name="megatron_vocab_embedding"):
    """VocabParallelEmbedding: canonical ``[H, V]`` sharded on V (dim 1) at ``vocab_start_index``.

    Input ids are batch-first ``[B, S]``; the output is ``[B, S, H]`` after the all-reduce, or
    ``[S/R, B, H]`` with ``reduce_scatter_embeddings`` (sequence parallelism).
    """

    def matches(self, module):
        return self.match_class(type(module))

    def match_class(self, cls):
        return _megatron_class(cls, "VocabParallelEmbedding") is not None

    def check(self, module, name):
        _NAMES[module] = name
        _check_parallel(module, name)
        w = module.weight
        if getattr(w, "shared_embedding", False) or getattr(w, "zero_out_wgrad", False):
            raise UnsupportedLayerError(
                f"Layer '{name}' shares its weight with the output layer "
                f"(share_embeddings_and_output_weights=True), which gets the weight at call "
                f"time and is not captured; untie them or exclude it with "
                f"capture.exclude=['{name}']")
        _, _, world = tp_of(module)
        split_even(name, "num_embeddings", module.num_embeddings, world)

    def batch_dim(self, module):
        return 1 if getattr(module, "reduce_scatter_embeddings", False) else 0

    def layer_shape(self, module):
        return module.embedding_dim, module.num_embeddings_per_partition

    def shard_info(self, module):
        group, rank, world = tp_of(module)
        if world == 1:
            return None
        return ShardInfo(1, rank, world, (module.embedding_dim, module.num_embeddings),
                         offset=module.vocab_start_index, group=group)

    def activation(self, module, args):
        ids = args[0]
        return ids.t() if self.batch_dim(module) == 1 else ids  # same layout as the output

    def build(self, module, a, g):
        if self.batch_dim(module) == 1:
            group, _, world = tp_of(module)
            a, g = a.t(), gather_sequence(g, group, world).transpose(0, 1)
        idx = a.long() - module.vocab_start_index
        valid = (idx >= 0) & (idx < module.num_embeddings_per_partition)
        idx = torch.where(valid, idx, torch.zeros_like(idx))
        g = g * valid.unsqueeze(-1).to(g.dtype)
        return Factorized(idx.reshape(idx.shape[0], -1).contiguous(),
                          g.reshape(g.shape[0], -1, g.shape[-1]).contiguous())


def _base_norm(module: nn.Module) -> LayerKind | None:
    for n in ("layernorm", "rmsnorm"):
        kind = get_kind(n)
        if kind.matches(module):
            return kind
    return None


class SequenceFirstNormKind(DenseKind, name="megatron_norm"):
    """A LayerNorm/RMSNorm marked by ``prepare_model``: ``[S, B, H]`` (or ``[S/R, B, H]``).

    The maths is the plain norm kind's, summed over the token dim 0 in place; with sequence
    parallelism each rank holds a partial sum over its tokens (the weight is replicated),
    so the small per-example sums are all-reduced over the group.
    """

    def matches(self, module):
        return getattr(module, SEQUENCE_FIRST_ATTR, None) is not None and \
            _base_norm(module) is not None

    def match_class(self, cls):
        return False  # only marked modules, which kind_for matches one by one

    def check(self, module, name):
        _NAMES[module] = name
        _base_norm(module).check(module, name)

    def batch_dim(self, module):
        return 1

    def layer_shape(self, module):
        return _base_norm(module).layer_shape(module)

    def build(self, module, a, g):
        """Per-example ``[B, (1 + bias) D]`` sums over this rank's tokens; with sequence
        parallelism the partial sums are all-reduced over the group (``B (1 + bias) D``
        floats instead of gathering both ``[S/R, B, D]`` sides)."""
        group, world = getattr(module, SEQUENCE_FIRST_ATTR)
        dense = self._dense(module, _base_norm(module).normalized(module, a), g, token_dim=0)
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(dense.values, group=group)
        return dense

    def canonical(self, module, grads):
        return _base_norm(module).canonical(module, grads)


class UnsupportedMegatronKind(LayerKind, name="megatron_unsupported"):
    """Megatron/TE modules dattri-ds cannot capture: ``check`` raises, naming the layer."""

    def matches(self, module):
        return self._reason(module) is not None

    def match_class(self, cls):
        """Marked modules aside: the unsupported classes all match, Megatron linears are
        asked one by one (expert layers), others never match."""
        if _megatron_class(cls, set(_UNSUPPORTED_CLASSES)):
            return True
        return None if _megatron_class(cls, _LINEARS) else False

    @staticmethod
    def _reason(module: nn.Module) -> str | None:
        marked = getattr(module, UNSUPPORTED_ATTR, None)
        if marked is not None:
            return marked
        cls = _megatron_class(type(module), set(_UNSUPPORTED_CLASSES))
        if cls is not None:
            return _UNSUPPORTED_CLASSES[cls]
        expert = getattr(module, "is_expert", False) or getattr(module, "explicit_expert_comm",
                                                                False)
        if expert and _megatron_class(type(module), _LINEARS):
            return "an expert (MoE) layer, whose tokens are permuted across experts and ranks"
        return None

    def check(self, module, name):
        marked = getattr(module, UNSUPPORTED_ATTR, None) is not None
        fix = "" if marked else ("build the model with the local spec "
                                 "(get_gpt_layer_local_spec, no experts) or ")
        raise UnsupportedLayerError(
            f"Layer '{name}' ({type(module).__name__}) is {self._reason(module)}, which "
            f"dattri-ds cannot capture per example; {fix}exclude it with "
            f"capture.exclude=['{name}']")

    def _unsupported(self, *_args, **_kwargs):
        raise UnsupportedLayerError(f"LayerKind '{self.name}' captures nothing")

    layer_shape = build = materialize = cross_gram = cross_dense = _unsupported
    project_kron = canonical = _unsupported
