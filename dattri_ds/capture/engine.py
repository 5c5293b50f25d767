"""EngineAdapter: what capture needs to know from a training engine, one file per engine.

Capture knows engines only through this protocol. An adapter for a wrapping engine
(``integrations/deepspeed.py``) registers itself with ``class X(EngineAdapter,
engine="deepspeed")`` and answers ``matches(engine)``; :func:`adapter_for` asks the registered
adapters in turn and falls back to :class:`PlainAdapter` for any ``nn.Module``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from torch import nn

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import UnsupportedEngineError
from dattri_ds.registry import Registry

__all__ = ["EngineAdapter", "PlainAdapter", "SteppedAdapter", "adapter_for", "ENGINES"]

#: wrapping engines (name -> adapter class) that :func:`adapter_for` recognises
ENGINES: Registry[type["EngineAdapter"]] = Registry(
    "engine adapter", error=UnsupportedEngineError,
    hint="register one with class X(EngineAdapter, engine='name') and a matches() classmethod")


class EngineAdapter(ABC):
    """Bridges one engine (DeepSpeed, Megatron, plain torch) to GradientCapture.

    * ``unwrap()``: the module whose forward the loop calls (hooks go there).
    * ``parallel_context()``: data/tensor-parallel groups.
    * ``backward_scale()``: the factor ``c`` the engine multiplies the loop's loss by
      before backward (loss scale / gradient-accumulation steps), read at backward time.
    * ``global_step()``: the optimizer step the current micro-batch belongs to.
    * ``on_step(fn)``: call ``fn()`` after every optimizer step (accumulation boundary);
      returns a function that removes the hook.
    * ``counts_steps``: whether ``global_step()`` advances by itself (else the loop marks
      steps with ``GradientCapture.next_step()``).
    """

    counts_steps: bool = True

    def __init_subclass__(cls, engine: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        ENGINES.register_class(cls, engine)

    @classmethod
    def matches(cls, engine: object) -> bool:
        """Whether ``engine`` is one this adapter wraps (registered adapters answer it)."""
        return False

    @abstractmethod
    def unwrap(self) -> nn.Module: ...

    @abstractmethod
    def parallel_context(self) -> ParallelContext: ...

    @abstractmethod
    def backward_scale(self) -> float: ...

    @abstractmethod
    def global_step(self) -> int: ...

    @abstractmethod
    def on_step(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class SteppedAdapter(EngineAdapter):
    """An adapter whose loop reports each optimizer step by calling ``step_done()``: it keeps
    the step count and the ``on_step`` hooks (shared by the plain-torch launch backend and
    Megatron)."""

    counts_steps = True

    def __init__(self, start_step: int = 0) -> None:
        self._step = start_step
        self._hooks: list[Callable[[], None]] = []

    def global_step(self) -> int:
        return self._step

    def on_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._hooks.append(fn)
        return lambda: self._hooks.remove(fn) if fn in self._hooks else None

    def step_done(self) -> None:
        """Call after every optimizer step: advances the step and notifies captures."""
        self._step += 1
        for fn in list(self._hooks):
            fn()


class PlainAdapter(EngineAdapter):
    """A plain ``nn.Module`` (or DDP/FSDP2-wrapped module) driven by the user's own loop.

    Args:
        model: the module (or its DDP/FSDP2 wrapper).
        optimizer: when given, every ``optimizer.step()`` is an optimizer-step boundary
            (a post-step hook); without it the loop calls ``GradientCapture.next_step()``.
    """

    def __init__(self, model: nn.Module, optimizer=None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.counts_steps = optimizer is not None
        self._step = 0

    def unwrap(self) -> nn.Module:
        return getattr(self.model, "module", self.model)

    def parallel_context(self) -> ParallelContext:
        return ParallelContext.from_default_group()

    def backward_scale(self) -> float:
        return 1.0

    def global_step(self) -> int:
        return self._step

    def on_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        if self.optimizer is None:
            return lambda: None

        def hook(*_) -> None:
            self._step += 1
            fn()
        return self.optimizer.register_step_post_hook(hook).remove


def adapter_for(engine: object, optimizer=None) -> EngineAdapter:
    """The registered adapter whose ``matches(engine)`` is true (e.g. a DeepSpeed engine), or
    a PlainAdapter for any nn.Module (whose ``optimizer``, if given, marks the optimizer steps).

    Raises:
        UnsupportedEngineError: neither a registered engine nor an nn.Module.
    """
    for cls in ENGINES.values():
        if cls.matches(engine):
            return cls(engine)
    if isinstance(engine, nn.Module):
        return PlainAdapter(engine, optimizer)
    raise UnsupportedEngineError(
        f"No dattri-ds adapter for {type(engine).__name__}: pass an nn.Module or an engine of "
        f"a registered adapter ({ENGINES.names()})")
