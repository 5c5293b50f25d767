"""Count the kernel launches and host syncs that eager code would issue on a GPU, on any device.

A GPU step at small sizes waits on kernel launches and host syncs, not on flops; both are
properties of the op sequence, not of the device, so they can be counted on a CPU. Inside
``KernelCounter`` every aten op is classified once, at the Python dispatch level (below
autograd and composite decompositions, so backward ops are seen too):

* **kernel**: an op that computes on device tensors. Not counted: views and aliases (a
  return annotated as an alias that is not written, e.g. ``view``, ``detach``, ``permute``,
  ``transpose``, ``unsqueeze``, ``select``, ``slice``, ``expand``, ``split``; ops tagged
  ``inplace_view``; ``_unsafe_view``, ``_reshape_alias``, ``lift_fresh``), bare allocations
  (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ``resize_``, ``set_``),
  metadata queries (an op returning no tensor and writing nothing: ``sym_size``,
  ``is_same_size``), ops whose every output has zero elements (CUDA returns early), and
  ``_local_scalar_dense`` (a copy to the host, counted as a sync). A ``_foreach_*`` op counts
  the launches of CUDA's multi-tensor apply (one per 320 chunks of 64K elements or 110
  tensors; one per tensor off its fast path). ``equal`` and ``nonzero`` count as a kernel
  and a sync.
* **host sync**: the host waits for the device. ``_local_scalar_dense`` (``item()``,
  ``bool()``, ``float()``, ``int()``), ops tagged ``data_dependent_output`` (``equal``) or
  ``dynamic_output_shape`` (``nonzero``, ``masked_select``, ``unique``; ``index`` and
  ``index_put_`` only with a boolean mask; ``repeat_interleave`` only without
  ``output_size``), and copies across the host boundary: ``.cpu()``, ``.to("cpu")``,
  ``.tolist()``, ``.numpy()`` of a device tensor, and ``.to(device)`` or a factory with
  ``device=`` from host data without ``non_blocking=True`` (a pageable copy is synchronous).

Which tensors are "on the device": every tensor that exists when the counter starts
(parameters, the batch; declare exceptions with ``host=``) and every output of an op with a
device input. Host tensors are those made from Python or NumPy data (``torch.tensor``,
``as_tensor``, ``from_numpy``), by a factory called without ``device=`` (or with the string
``"cpu"``), by ``.cpu()`` / ``.to("cpu")``, and every output of an op whose inputs are all
host tensors: such ops are neither kernels nor syncs. On a CPU stand-in run every device is
``cpu``, so ``.to(torch.device(...))``, ``device=<a torch.device>`` and a string naming a
device index (``"cpu:0"``, ``"cuda:0"``) are read as "the compute device" and the string
``"cpu"`` as the host; the host-boundary methods and factories are
wrapped (and restored) while the counter is active, because a ``TorchFunctionMode`` does not
see the code that runs inside ``backward()`` (tensor hooks, queued callbacks).

The counts are an approximation of a CUDA run, by design and exactly reproducible: one aten
op is one launch (a cuBLAS call or a large reduction may launch two), and compiled code's
fused kernels are not modelled (a compiled region would be counted op by op).

Example:
    >>> with KernelCounter() as kc:
    ...     model(**batch).loss.backward()
    >>> kc.kernels, kc.syncs, kc.kernels_by_op.most_common(5)
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["KernelCounter", "NOT_KERNELS"]

#: Ops that launch nothing although their schema does not say so (``overloadpacket`` names).
NOT_KERNELS = frozenset({
    "_unsafe_view", "_reshape_alias", "lift_fresh", "lift", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_",
    "resize_as_", "set_", "_local_scalar_dense",
})
#: Ops that return nothing and write nothing, yet launch a kernel.
_VOID_KERNELS = frozenset({"_assert_async", "_assert_scalar"})
#: Ops tagged ``dynamic_output_shape`` that sync only with a boolean (mask) index.
_MASK_INDEX = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
#: torch factories wrapped while counting: ``device=`` decides host or device.
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "linspace", "logspace",
              "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
              "tril_indices", "triu_indices")
#: torch functions that make a tensor from Python or NumPy data (host unless ``device=``).
_FROM_DATA = ("tensor", "as_tensor", "asarray")


class _Op:
    """The classification of one aten overload, computed once per overload."""

    __slots__ = ("name", "kernel", "sync")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        schema = func._schema
        self.name = func.overloadpacket.__name__
        tags = set(func.tags)
        returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns) or torch.Tag.inplace_view in tags
        metadata = not returns_tensor and not schema.is_mutable
        #: when it syncs: "always", "mask" (a boolean index), "output_size" (none given)
        self.sync: str | None = None
        if self.name == "_local_scalar_dense" or torch.Tag.data_dependent_output in tags:
            self.sync = "always"
        elif torch.Tag.dynamic_output_shape in tags:
            self.sync = ("mask" if self.name in _MASK_INDEX else
                         "output_size" if self.name == "repeat_interleave" else "always")
        self.kernel = not (view or self.name in NOT_KERNELS or
                           (metadata and not self.sync and self.name not in _VOID_KERNELS))

    def syncs(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call waits for the device."""
        if self.sync == "mask":
            return _has_mask(args, kwargs)
        if self.sync == "output_size":
            return kwargs.get("output_size") is None
        return self.sync is not None


_OPS: dict[torch._ops.OpOverload, _Op] = {}


def _op(func: torch._ops.OpOverload) -> _Op:
    op = _OPS.get(func)
    if op is None:
        op = _OPS[func] = _Op(func)
    return op


def _tensors(x) -> Iterable[torch.Tensor]:
    """The tensors in an op's (nested) arguments or outputs."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class KernelCounter(TorchDispatchMode):
    """Counts kernel launches and host syncs while active (module docstring: definitions).

    Args:
        host: tensors that exist before counting and live on the host (every other
            pre-existing tensor is a device tensor).
        where: record the code location (file:line outside torch) of every host sync in
            ``sync_sites``; slower, for debugging.

    Attributes:
        kernels: kernel launches counted.
        syncs: host syncs counted.
        kernels_by_op: aten op name -> kernel launches.
        syncs_by_op: op or method name -> host syncs.
        sync_sites: ``"file:line reason"`` -> host syncs (with ``where=True``).
    """

    _local = threading.local()

    def __init__(self, host: Iterable[torch.Tensor] = (), *, where: bool = False) -> None:
        super().__init__()
        self.where = where
        self.kernels = 0
        self.syncs = 0
        self.kernels_by_op: Counter[str] = Counter()
        self.syncs_by_op: Counter[str] = Counter()
        self.sync_sites: Counter[str] = Counter()
        self._host = WeakTensorKeyDictionary()
        for t in host:
            self._host[t] = True
        self._saved: list[tuple[object, str, object]] = []

    # ---- classification ---------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host tensor (see the module docstring)."""
        return t in self._host

    def _mark_host(self, out) -> None:
        for t in _tensors(out):
            self._host[t] = True

    def _sync(self, reason: str) -> None:
        self.syncs += 1
        self.syncs_by_op[reason] += 1
        if self.where:
            self.sync_sites[f"{_site()} {reason}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        host = getattr(self._local, "host_factory", False)
        if not host:  # a factory (no input) is device work unless its wrapper said host
            inputs = list(_tensors((args, kwargs)))
            host = bool(inputs) and all(t in self._host for t in inputs)
        if host:
            self._mark_host(out)
            return out
        op = _op(func)
        outs = list(_tensors(out))
        if op.kernel and (not outs or any(t.numel() for t in outs)):
            n = _foreach_launches(op.name, args) if op.name.startswith("_foreach_") else 1
            self.kernels += n
            self.kernels_by_op[op.name] += n
        if op.sync is not None and op.syncs(args, kwargs):
            self._sync(op.name)
        return out

    # ---- the host boundary: wrapped Tensor methods and factories ----------------------
    def __enter__(self) -> KernelCounter:
        self._wrap_boundary()
        try:
            return super().__enter__()
        except BaseException:
            self._unwrap()
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unwrap()

    def _patch(self, owner: object, name: str, make) -> None:
        orig = getattr(owner, name)
        self._saved.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def _unwrap(self) -> None:
        while self._saved:
            owner, name, orig = self._saved.pop()
            setattr(owner, name, orig)

    def _wrap_boundary(self) -> None:
        for name in ("tolist", "numpy"):
            self._patch(torch.Tensor, name, self._reader(name))
        self._patch(torch.Tensor, "cpu", self._mover("cpu", lambda a, k: True))
        self._patch(torch.Tensor, "cuda", self._mover("cuda", lambda a, k: False))
        self._patch(torch.Tensor, "to", self._mover("to", self._to_host))
        for name in _FACTORIES:
            self._patch(torch, name, self._factory(from_data=False))
        for name in _FROM_DATA:
            self._patch(torch, name, self._factory(from_data=True))
        self._patch(torch, "from_numpy", self._factory(from_data=True, always_host=True))

    def _reader(self, name: str):
        def make(orig):
            def read(t, *args, **kwargs):
                if t not in self._host:
                    self._sync(name)
                with self._host_scope():
                    return orig(t, *args, **kwargs)
            return read
        return make

    def _to_host(self, args: tuple, kwargs: dict) -> bool | None:
        """Where ``Tensor.to(*args, **kwargs)`` puts its result: True host, False device,
        None unchanged (a dtype-only cast)."""
        target = kwargs.get("device")
        if target is None:
            target = next((a for a in args if isinstance(a, (str, torch.device, torch.Tensor))
                           and not isinstance(a, torch.dtype)), None)
        if target is None:
            return None
        if isinstance(target, torch.Tensor):
            return target in self._host
        if isinstance(target, str):
            return target == "cpu"
        return False  # a torch.device object: the compute device (module docstring)

    def _mover(self, name: str, to_host):
        def make(orig):
            def move(t, *args, **kwargs):
                dest = to_host(args, kwargs)
                src_host = t in self._host
                if dest is not None and dest != src_host and not (
                        not dest and kwargs.get("non_blocking", False)):
                    self._sync(f"{name}({'host' if dest else 'device'})")
                if dest is None or dest == src_host:
                    return orig(t, *args, **kwargs)
                with self._host_scope():  # the copy itself: a sync, not a kernel
                    out = orig(t, *args, **kwargs)
                    if out is t:  # a CPU stand-in returns the tensor itself: keep t's side
                        out = out.view_as(out)
                if dest:
                    self._host[out] = True
                else:
                    self._host.pop(out, None)
                return out
            return move
        return make

    def _factory(self, from_data: bool, always_host: bool = False):
        def make(orig):
            def create(*args, **kwargs):
                device = kwargs.get("device")
                host = always_host or device is None or device == "cpu"
                with self._host_scope(host):
                    out = orig(*args, **kwargs)
                if (from_data and not host and isinstance(out, torch.Tensor) and out.numel()
                        and not (args and isinstance(args[0], torch.Tensor))):
                    self._sync(f"{getattr(orig, '__name__', 'tensor')}(device)")  # H2D copy
                if host and isinstance(out, torch.Tensor) and not (
                        args and isinstance(args[0], torch.Tensor) and args[0] is out):
                    self._host[out] = True
                return out
            return create
        return make

    class _Scope:
        def __init__(self, local: threading.local, value: bool) -> None:
            self.local, self.value = local, value

        def __enter__(self) -> None:
            self.prev = getattr(self.local, "host_factory", False)
            self.local.host_factory = self.value

        def __exit__(self, *exc) -> None:
            self.local.host_factory = self.prev

    def _host_scope(self, value: bool = True) -> KernelCounter._Scope:
        return self._Scope(self._local, value)

    # ---- reporting --------------------------------------------------------------------
    def summary(self, top: int = 10) -> str:
        """One line of totals and the ``top`` ops by kernels, then the syncs by reason."""
        ops = ", ".join(f"{n} {c}" for n, c in self.kernels_by_op.most_common(top))
        syncs = ", ".join(f"{n} {c}" for n, c in self.syncs_by_op.most_common())
        return f"{self.kernels} kernels ({ops}); {self.syncs} host syncs ({syncs or '-'})"


#: CUDA's multi_tensor_apply: elements per block, blocks and tensors per launch.
_CHUNK, _BLOCKS, _TENSORS = 65536, 320, 110


def _foreach_launches(name: str, args: tuple) -> int:
    """Launches of a ``_foreach_*`` op as CUDA issues them: its fast path (contiguous
    tensors of one dtype) one kernel per ``_BLOCKS`` chunks of ``_CHUNK`` elements or
    ``_TENSORS`` tensors, whichever fills first (``_foreach_norm`` adds its clean-up kernel);
    otherwise one kernel per tensor."""
    ts = [t for t in (args[0] if args and isinstance(args[0], (list, tuple)) else ())
          if isinstance(t, torch.Tensor)]
    if not ts:
        return 1
    if len({t.dtype for t in ts}) > 1 or not all(t.is_contiguous() for t in ts):
        return len(ts)
    chunks = sum(-(-t.numel() // _CHUNK) for t in ts)
    launches = max(1, -(-chunks // _BLOCKS), -(-len(ts) // _TENSORS))
    return launches + (1 if name == "_foreach_norm" else 0)


def _has_mask(args: tuple, kwargs: dict) -> bool:
    """Whether an ``index``/``index_put_`` call indexes with a boolean (or uint8) mask."""
    indices = kwargs.get("indices", args[1] if len(args) > 1 else ())
    return any(t is not None and t.dtype in (torch.bool, torch.uint8)
               for t in (indices or ()) if isinstance(t, torch.Tensor) or t is None)


def _site() -> str:
    """``file:line`` of the innermost caller outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torch/" not in f and not f.endswith("eval/kernels.py"):
            return f"{'/'.join(f.split('/')[-2:])}:{frame.lineno}"
    return "?"
