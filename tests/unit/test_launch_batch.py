"""One batch rule for every backend: DeepSpeed's, checked at start; the torch backend honours the
DeepSpeed keys it can and names every key it ignores.

Invariants:

* ``resolve_batch`` resolves train_batch_size / train_micro_batch_size_per_gpu /
  gradient_accumulation_steps exactly as DeepSpeed's own ``DeepSpeedConfig`` does on the
  same data-parallel world (``_configure_train_batch_size`` run on it), over a grid of given and
  left-out keys: the same three values where DeepSpeed accepts, a refusal where DeepSpeed
  asserts. Breaks if a backend derives another accumulation than the DeepSpeed engine.
* A mismatch (``"train_batch_size": 64`` with 4 x 2 on one rank, the case that trained 8 per
  step on ``--backend torch`` with exit 0) is refused by ``launch/train.py`` on every
  backend with one line naming the file, the three keys with their values, the world size
  and the fix, before anything is written to ``--out``.
* ``--backend torch`` trains the resolved batch (64 = 4 x 16), takes DeepSpeed's clipping
  default and its ``Adam`` (AdamW unless ``adam_w_mode`` is false), and its notice names
  each ignored key of every configs/*.json.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from _deps import require

from dattri_ds.cli.exits import run
from dattri_ds.errors import ConfigError
from dattri_ds.launch.engine import BATCH_KEYS, resolve_batch

ROOT = Path(__file__).resolve().parents[2]


def _deepspeed_resolves(ds: dict, world: int):
    """DeepSpeed's own batch code (``DeepSpeedConfig._configure_train_batch_size``:
    ``_set_batch_related_parameters`` then ``_batch_assertion``) on ``world`` ranks: the
    resolved ``(train, micro, accumulation)``, or None where it asserts."""
    from deepspeed.runtime.config import DeepSpeedConfig

    conf = object.__new__(DeepSpeedConfig)  # its batch attributes only, no process group
    conf.world_size = world
    conf.train_batch_size, conf.train_micro_batch_size_per_gpu, \
        conf.gradient_accumulation_steps = (ds.get(k) for k in BATCH_KEYS)
    try:
        conf._configure_train_batch_size()
    except AssertionError:
        return None
    return (conf.train_batch_size, conf.train_micro_batch_size_per_gpu,
            conf.gradient_accumulation_steps)


def test_resolution_equals_deepspeeds_own():
    """Every combination of given / left-out batch keys on 1-3 ranks: resolve_batch equals
    DeepSpeedConfig (values, or both refuse)."""
    require("deepspeed", "deepspeed")
    checked = refused = 0
    for train, micro, gas, world in itertools.product(
            (None, 1, 6, 8, 64), (None, 1, 2, 4), (None, 1, 2, 3), (1, 2, 3)):
        ds = {k: v for k, v in zip(BATCH_KEYS, (train, micro, gas)) if v is not None}
        want = _deepspeed_resolves(ds, world)
        try:
            got = resolve_batch(ds, world, "ds.json")
        except ConfigError as e:
            assert want is None, (ds, world, str(e))
            assert str(e).startswith("ds.json") and "\n" not in str(e)
            refused += 1
            continue
        assert got == want, (ds, world)
        checked += 1
    assert checked > 50 and refused > 50, (checked, refused)


@pytest.mark.parametrize("backend", ["torch", "deepspeed", "megatron"])
def test_batch_mismatch_is_one_line_before_anything_is_written(tmp_path, capsys, backend):
    """train_batch_size 64 with micro 4 x accumulation 2 on one rank: one line with the
    file, the three keys and values, the world size and the fix; no --out."""
    cfg = json.loads((ROOT / "configs/zero0_cpu.json").read_text())
    cfg["train_batch_size"] = 64
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    from dattri_ds.launch.train import main

    code = run(main, ["--backend", backend, "--deepspeed_config", str(path), "--out",
                      str(tmp_path / "run"), "--train-data", str(ROOT / "data/tiny/train.jsonl")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dattri-ds:")]
    assert code == 2 and len(lines) == 1, lines
    for needle in (str(path), "train_batch_size 64", "train_micro_batch_size_per_gpu 4",
                   "gradient_accumulation_steps 2", "1 data-parallel rank",
                   "set train_batch_size to 8"):
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "run").exists()


def _torch_backend(ds: dict):
    from dattri_ds.launch.torch_backend import TorchBackend

    backend = object.__new__(TorchBackend)  # the JSON part of the constructor only
    backend.ctx = SimpleNamespace(dp_world=1)
    backend._from_json(ds, "torch")
    return backend


def test_torch_backend_honours_the_deepspeed_keys():
    """train_batch_size 64 with micro 4 trains 4 x 16 per step; gradient_clipping left out
    is DeepSpeed's default; optimizer "Adam" is AdamW unless adam_w_mode is false."""
    require("deepspeed", "deepspeed")
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from dattri_ds.launch.optimizer import optimizer_spec

    b = _torch_backend({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})
    assert (b.micro, b.gas, b.clip) == (4, 16, float(GRADIENT_CLIPPING_DEFAULT))
    adam = {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}
    assert optimizer_spec({"optimizer": adam})[0] == "adamw"
    off = {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False}}
    assert optimizer_spec({"optimizer": off}) == ("adam", {"lr": 0.1})


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("zero*.json")),
                         ids=lambda p: p.name)
def test_torch_notice_names_every_ignored_key(path, caplog):
    """The notice of --backend torch lists each key of the shipped config it does not
    honour, and none that it does."""
    from dattri_ds.launch.optimizer import USED_DS_KEYS

    ds = json.loads(path.read_text())
    ds.pop("dattri_ds")
    with caplog.at_level(logging.INFO, logger="dattri_ds.launch"):
        _torch_backend(ds)
    notice = [r.getMessage() for r in caplog.records if "ignores these" in r.getMessage()]
    assert len(notice) == 1
    listed = notice[0].split("DeepSpeed keys: ")[1].split(" (it honours")[0].split(", ")
    assert listed == sorted(set(ds) - set(USED_DS_KEYS)), (listed, sorted(ds))
