"""Each misuse raises the error class that names it, and that class keeps its builtin base.

Invariant: a caller can catch the specific dattri-ds class (``FactorStateError``,
``FactorFileError``, ``ClosedError``, ...), ``DattriDSError``, or the builtin it derives
from (``except RuntimeError`` / ``ValueError`` / ``TypeError`` keep working), and the
message names the value and the fix. Breaks when a site goes back to a bare
``DattriDSError`` or a builtin, or a class loses its builtin base.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import KFACFactors, Spill, collect
from dattri_ds.errors import (
    CheckpointMismatchError, ClosedError, ConfigError, DattriDSError, FactorFileError,
    FactorStateError, StreamItemError, StreamStateError, UnsupportedEngineError,
)
from dattri_ds.capture.engine import adapter_for
from dattri_ds.methods import EKFAC, KFAC
from reference import tiny_gpt2

BASES = [(FactorStateError, RuntimeError), (FactorFileError, ValueError),
         (ClosedError, ValueError), (StreamStateError, RuntimeError),
         (StreamItemError, TypeError), (UnsupportedEngineError, TypeError),
         (CheckpointMismatchError, RuntimeError)]


@pytest.mark.parametrize("cls,base", BASES, ids=[c.__name__ for c, _ in BASES])
def test_every_class_keeps_its_builtin_base(cls, base):
    """``except <builtin>`` callers written before the class existed still catch it."""
    assert issubclass(cls, DattriDSError) and issubclass(cls, base)


@pytest.fixture(scope="module")
def batches():
    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=31, n_positions=16)
    ids = torch.randint(1, 31, (4, 6), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": ids[i:i + 2], "labels": ids[i:i + 2]} for i in (0, 2)]
    return list(collect(model, rows))


def test_factors_used_out_of_order(batches):
    """Each phase of KFACFactors refuses the call that would skip or repeat it."""
    f = KFACFactors()
    with pytest.raises(FactorStateError, match=r"no batch was added \(update\(\)\)"):
        f.eigendecompose()
    with pytest.raises(FactorStateError, match="needs eigendecompose"):
        f.fingerprint()
    with pytest.raises(RuntimeError, match="needs eigendecompose"):  # the builtin still catches
        f.update_correction(batches[0])
    with pytest.raises(FactorStateError, match="eigendecomposed factors"):
        KFAC(factors=f)
    for b in batches:
        f.update(b)
    f.reduce()
    with pytest.raises(FactorStateError, match="twice"):
        f.reduce()
    f.eigendecompose()
    with pytest.raises(FactorStateError, match="sums are final"):
        f.update(batches[0])
    with pytest.raises(FactorStateError, match="corrected eigenvalues"):
        EKFAC(factors=f)


def test_a_file_that_is_not_a_factor_file(tmp_path):
    """KFACFactors.load names the file and the format it found."""
    path = tmp_path / "not_factors.pt"
    torch.save({"format": "something-else"}, path)
    with pytest.raises(FactorFileError, match=r"not_factors\.pt is not a K-FAC factor file"):
        KFACFactors.load(path)


def test_spill_misuse_names_its_failure(batches, tmp_path):
    """A second pass too early, a pass after close, a foreign item, a negative budget."""
    s = Spill(iter(batches), dir=str(tmp_path))
    first = iter(s)
    next(first)
    with pytest.raises(StreamStateError, match="before the first one finished"):
        next(iter(s))
    s.close()
    with pytest.raises(ClosedError, match="closed"):
        iter(s)
    with pytest.raises(StreamItemError, match="item 0 .* not a GradBatch"):
        with Spill([torch.zeros(2)], dir=str(tmp_path)) as bad:
            list(bad)
    with pytest.raises(ConfigError, match="memory_bytes=-1"):
        Spill([], dir=str(tmp_path), memory_bytes=-1)


def test_no_adapter_for_a_non_module():
    """adapter_for names the type it got and what it accepts."""
    with pytest.raises(UnsupportedEngineError, match="adapter for int: pass an nn.Module"):
        adapter_for(3)
