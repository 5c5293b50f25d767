"""Truncated scoring: the module-name patterns of a model's top ``N`` repeated blocks (the
children of its longest ``nn.ModuleList`` of one type: ``transformer.h`` in GPT-2,
``model.layers`` in Llama). Scoring only them stops the probe backward at the lowest scored
block (``probe_share``)."""

from __future__ import annotations

from torch import nn

from dattri_ds.errors import ConfigError

__all__ = ["find_blocks", "top_block_patterns", "probe_share"]


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """``(prefix, count)`` of the model's repeated blocks (``("transformer.h", 12)``).

    Raises:
        ConfigError: the model has no ``nn.ModuleList`` of same-type modules.
    """
    best: tuple[str, int] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        if best is None or len(module) > best[1]:
            best = (name, len(module))
    if best is None:
        raise ConfigError(f"selection.top_blocks needs repeated blocks (an nn.ModuleList of "
                          f"same-type modules), but {type(model).__name__} has none; set "
                          f"selection.include to the layers to score instead")
    return best


def top_block_patterns(model: nn.Module, n: int) -> tuple[str, ...]:
    """``include`` patterns of the last ``n`` blocks: ``("transformer.h.3", "transformer.h.3.*")``.

    Raises:
        ConfigError: ``n`` exceeds the number of blocks.
    """
    prefix, count = find_blocks(model)
    if n > count:
        raise ConfigError(f"selection.top_blocks={n} but {type(model).__name__} has {count} "
                          f"blocks ('{prefix}'); set top_blocks to at most {count}, or None "
                          f"to score every layer")
    pre = f"{prefix}." if prefix else ""
    return tuple(p for i in range(count - n, count) for p in (f"{pre}{i}", f"{pre}{i}.*"))


def probe_share(model: nn.Module, scored: list[str]) -> float:
    """Share ``s`` of the model's blocks a probe backward runs through when the layers
    ``scored`` are captured: ``(L - i) / L`` with ``i`` the lowest block holding a scored
    layer; 1 when a scored layer sits before the blocks (the embeddings) or the model has
    no blocks; ``1 / L`` when only layers after the blocks (the head) are scored, counting
    the head like one block."""
    try:
        prefix, count = find_blocks(model)
    except ConfigError:
        return 1.0
    pre = f"{prefix}." if prefix else ""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first_block = order.get(f"{pre}0", 0)
    lowest = count
    for name in scored:
        if name.startswith(pre) and name[len(pre):].split(".")[0].isdigit():
            lowest = min(lowest, int(name[len(pre):].split(".")[0]))
        elif order.get(name, 0) < first_block:
            return 1.0
    return max(count - lowest, 1) / count
