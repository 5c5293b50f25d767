"""Tied weights: modules that share one parameter are reported as one layer of that parameter.

Same-kind modules, and an ``nn.Embedding`` tied to an output projection (GPT-2
``wte``/``lm_head``: the embedding enters as ``g' = onehot(idx)``, ``a' = h``), become one
factorized layer under the *primary* module's name by concatenating tokens (the maths:
docs/design.md, "Tied weights").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from dattri_ds.gradient import Factorized, LayerGrad
from dattri_ds.layers import LayerKind

__all__ = ["TiedGroup", "find_tied", "merge_tied"]


@dataclass(frozen=True)
class TiedGroup:
    """Modules sharing a weight: reported under ``primary``; ``members`` merge into it."""

    primary: str
    members: tuple[str, ...]


def find_tied(layers: dict[str, tuple[nn.Module, LayerKind]]
              ) -> tuple[list[TiedGroup], list[list[str]]]:
    """Supported tied groups, and the names of tied modules no rule covers."""
    owners: dict[int, list[str]] = defaultdict(list)
    for name, (module, _) in layers.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners[id(w)].append(name)
    groups, unsupported = [], []
    for names in owners.values():
        if len(names) < 2:
            continue
        kinds = {layers[n][1].name for n in names}
        outer = [n for n in names if layers[n][1].name != "embedding"]
        if len(kinds) == 1 and not layers[names[0]][1].dense_only:
            groups.append(TiedGroup(names[0], tuple(names[1:])))
        elif len(outer) == 1 and not layers[outer[0]][1].dense_only:
            groups.append(TiedGroup(outer[0], tuple(n for n in names if n != outer[0])))
        else:
            unsupported.append(names)
    return groups, unsupported


def _as_primary(member: LayerGrad, primary: LayerGrad) -> Factorized:
    f = member.data
    if member.kind_name != "embedding" or primary.kind_name == "embedding":
        return f
    vocab, width = primary.shape
    a = f.g
    if width == a.shape[-1] + 1:  # the primary's bias column: the embedding adds nothing
        a = torch.cat([a, a.new_zeros(a.shape[:-1] + (1,))], dim=-1)
    # one_hot(f.a, vocab) without its range check (a read of the indices' max: a host sync)
    onehot = f.g.new_zeros(f.a.shape + (vocab,)).scatter_(-1, f.a.unsqueeze(-1), 1.0)
    return Factorized(a, onehot)


def merge_tied(layers: dict[str, LayerGrad], groups: list[TiedGroup]) -> None:
    """Fold each group's members into its primary layer, in place (members are removed)."""
    for grp in groups:
        primary = layers.get(grp.primary)
        parts = [layers.pop(m) for m in grp.members if m in layers]
        if primary is None or not parts:
            continue
        fs = [primary.data] + [_as_primary(p, primary) for p in parts]
        layers[grp.primary] = primary.replace(data=Factorized(
            torch.cat([f.a for f in fs], 1), torch.cat([f.g for f in fs], 1)))
