"""Stores are attached by their spec: every consumer compares what it asks with the manifest.

Invariant: for every spec field (model weights, projection kind, dim and seed, dtype, layers,
capture semantics, whitening factors) mismatched between a store and a request, and for
every consumer that can request that field (``collect`` into an existing store, ``fit
--store``, ``attribute``, a selector's ``selection.target_store``), the command ends before
any work with exit 2 and exactly one error line that names the field and both values, no raw
exception type from outside dattri_ds, the debug switch off, and nothing written. A damaged
manifest read by ``fit --store`` is one line naming the file (never a doubled path), and
``collect --checkpoints ""`` is an error, not a run that writes nothing.

The model is a 1-layer GPT-2 of width 8 built in code; the "run" is a folder laid out as
launch/train.py lays one out (two checkpoints), so every case runs in well under a second.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch

import dattri_ds.errors as dattri_errors
from dattri_ds.cli.exits import run as cli_run

OURS = {n for n in dir(dattri_errors) if n.endswith("Error")}
RAW = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b")
CONFIG = dict(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=1,
              eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
BASE = ["--projection", "dense", "--projection-dim", "4", "--seed", "0", "--batch-size", "4"]


def _gpt2(seed: int, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{**CONFIG, **over})).eval()


def _token_file(path: Path, n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as fh:
        for i in range(n):
            ids = torch.randint(3, 32, (int(torch.randint(4, 9, (1,), generator=g)),),
                                generator=g).tolist()
            fh.write(json.dumps({"id": f"d{i}", "input_ids": ids}) + "\n")
    return str(path)


def _run_dir(root: Path, seeds: tuple[int, int]) -> Path:
    """A launch/train.py-shaped run: model/config.json, checkpoints s1, s2 (HF folders)."""
    for tag, seed in zip(("s1", "s2"), seeds):
        _gpt2(seed).save_pretrained(root / "checkpoints" / tag)
    (root / "model").mkdir(parents=True)
    shutil.copy(root / "checkpoints/s1/config.json", root / "model/config.json")
    (root / "trajectory.json").write_text(json.dumps({"run_id": "run:fuzz", "checkpoints": [
        {"tag": "s1", "step": 1, "lr": 0.1}, {"tag": "s2", "step": 2, "lr": 0.05}]}))
    (root / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {"seq_len": 8}}))
    return root


def _call(main, argv: list[str]) -> tuple[int, list[str]]:
    """Run ``main`` through the one CLI error path with the debug switch off."""
    err = io.StringIO()
    old = os.environ.pop("DATTRI_DS_DEBUG", None)
    try:
        with redirect_stderr(err):
            code = cli_run(main, argv)
    finally:
        if old is not None:
            os.environ["DATTRI_DS_DEBUG"] = old
    return code, [ln for ln in err.getvalue().splitlines() if ln.startswith("dattri-ds: error")]


def _library_store(out: Path, run: Path, data: str, tag: str, **capture) -> Path:
    """A store of ``run``'s checkpoint ``tag`` written through the library (same origin as
    ``collect`` records) with a CaptureConfig the tool cannot ask for (layers, semantics)."""
    from dattri_ds import CaptureConfig, ProjectionConfig
    from dattri_ds.store import (
        GradientStoreWriter, StoreConfig, StoreSpec, seal_store, weights_hash,
    )
    from dattri_ds.tools.gradients import gradients
    from dattri_ds.tools.sources import Run
    from dattri_ds.tools.texts import load_texts

    src = Run.open(run)
    model = src.model(tag)
    proj = ProjectionConfig(kind="dense", dim=4, seed=0)
    cfg = CaptureConfig(projection=proj, **capture)
    rows = load_texts(data, None, 8)
    path = out / tag
    writer = None
    for batch in gradients(model, rows, torch.arange(len(rows)), capture=cfg, batch_size=4):
        if writer is None:
            spec = StoreSpec.from_batch(batch, projection=proj, capture=cfg,
                                        fingerprint=f"{src.fingerprint()}@{tag}",
                                        run_id=src.run_id, checkpoint=tag,
                                        weights_hash=weights_hash(model))
            writer = GradientStoreWriter(StoreConfig(path=str(path)), spec)
        writer.append(batch)
    writer.close()
    seal_store(path)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Runs, data, stores and factors shared by every case (built once)."""
    from dattri_ds.tools import collect, fit

    tmp = tmp_path_factory.mktemp("door")
    w = {"tmp": tmp, "run": _run_dir(tmp / "run", (0, 1)), "data": _token_file(
        tmp / "train.jsonl", 4, 0), "queries": _token_file(tmp / "q.jsonl", 2, 1)}
    swapped = tmp / "swapped"  # same run id, tags and config; s1 holds other weights
    shutil.copytree(w["run"], swapped)
    shutil.rmtree(swapped / "checkpoints/s1")
    _gpt2(7).save_pretrained(swapped / "checkpoints/s1")
    w["swapped"] = swapped
    _gpt2(0, n_embd=16).save_pretrained(tmp / "wide")  # another model (layer shapes)
    w["wide"] = tmp / "wide"
    src = ["--run", str(w["run"]), "--data", w["data"]]

    def coll(out, *extra):
        assert _call(collect.main, [*src, "--out", str(tmp / out), *BASE, *extra])[0] == 0
        return tmp / out

    w["S"] = coll("S")
    w["K"] = coll("K", "--projection", "kronecker")
    for name, extra in (("Tdim", ["--projection-dim", "6"]), ("Tkind", ["--projection", "sparse"]),
                        ("Tseed", ["--seed", "3"])):
        coll(name, "--checkpoints", "s1")
        w[name] = coll(name, "--checkpoints", "s2", *extra)
    for name, extra in (("F1", []), ("F2", ["--power", "0.5"])):
        assert _call(fit.main, [*src, "--checkpoint", "all", "--out", str(tmp / name),
                                *extra])[0] == 0
        w[name] = tmp / name
    w["W"] = coll("W", "--factors", str(w["F1"]))
    w["L"] = _library_store(tmp / "L", w["run"], w["data"], "s1",
                            include=("transformer.h.0.mlp.*",))
    w["M"] = _library_store(tmp / "M", w["run"], w["data"], "s1", per_example_loss="mean")
    return w


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.endswith("_config.json")}


def _collect(w, store, *extra):
    from dattri_ds.tools import collect
    return collect.main, ["--run", str(w["run"]), "--data", w["data"], "--out", str(w[store]),
                          *BASE, *extra]


def _fit(w, store, *extra, run="run", sub="s1"):
    from dattri_ds.tools import fit
    return fit.main, ["--run", str(w[run]), "--data", w["data"], "--checkpoint", "s1",
                      "--store", str(w[store] / sub), "--out", str(w["tmp"] / "out/f.pt"),
                      *extra]


def _attribute(w, store, *extra, run="run"):
    from dattri_ds.tools import attribute
    return attribute.main, ["--run", str(w[run]), "--store", str(w[store]), "--queries",
                            w["queries"], "--out", str(w["tmp"] / "out/attr"), *extra]


def _target(w, store, *, model="run", kind="dense", dim=4, seed=0, sub="s1", **capture):
    """A selector on ``store`` built as launch builds it (``for_target_data``)."""
    def main(argv):
        from dattri_ds import CaptureConfig, ProjectionConfig
        from dattri_ds.selection import OnlineSelector, SelectionConfig
        from dattri_ds.tools.sources import Run
        from dattri_ds.tools.sources import HFModelDir

        net = Run.open(w[model]).model("s1") if model == "run" else \
            HFModelDir.open(w[model]).model(w[model].name)
        sc = SelectionConfig(score="alignment", target_store=str(w[store] / sub),
                             projection=ProjectionConfig(kind=kind, dim=dim, seed=seed))
        OnlineSelector.for_target_data(net, sc, None, capture=CaptureConfig(**capture)).close()
    return main, []


#: (consumer, field, the two values a clear message shows, command). Fields a consumer
#: cannot ask for are absent: attribute and fit take the projection's other settings, the
#: dtype and the semantics from the store; a selector's model is the one it trains.
CASES = [
    ("collect", "weights", ("weights",), lambda w: _collect_swapped(w)),
    ("collect", "projection kind", ("kind", "dense", "sparse"),
     lambda w: _collect(w, "S", "--projection", "sparse")),
    ("collect", "projection dim", ("dim", "4", "12"),
     lambda w: _collect(w, "S", "--projection-dim", "12")),
    ("collect", "seed", ("seed", "0", "5"), lambda w: _collect(w, "S", "--seed", "5")),
    ("collect", "dtype", ("dtype", "float32", "float16"),
     lambda w: _collect(w, "S", "--dtype", "float16")),
    ("collect", "layers", ("layers", "transformer.h.0.attn.c_attn"),
     lambda w: _collect(w, "L", "--checkpoints", "s1")),
    ("collect", "semantics", ("per_example_loss", "mean", "sum"),
     lambda w: _collect(w, "M", "--checkpoints", "s1")),
    ("collect", "whitened_by", ("whitened_by",),
     lambda w: _collect(w, "W", "--factors", str(w["F2"]))),
    ("collect", "whitened", ("whitened", "ekfac", "None"), lambda w: _collect(w, "W")),
    ("fit", "weights", ("weights",), lambda w: _fit(w, "S", run="swapped")),
    ("fit", "checkpoint", ("checkpoint", "s1", "s2"), lambda w: _fit(w, "S", sub="s2")),
    ("fit", "projection kind", ("kind", "dense", "kronecker"),
     lambda w: _fit(w, "S", "--projection-dim", "4")),
    ("fit", "projection dim", ("dim", "4", "12"), lambda w: _fit(w, "K", "--projection-dim",
                                                                 "12")),
    ("fit", "seed", ("seed", "0", "5"), lambda w: _fit(w, "K", "--seed", "5")),
    ("fit", "layers", ("layers", "transformer.h.0.attn.c_attn"), lambda w: _fit(w, "L")),
    ("fit", "whitened", ("whitened", "ekfac", "None"), lambda w: _fit(w, "W")),
    ("attribute", "weights", ("weights",),
     lambda w: _attribute(w, "S", "--method", "tracin", run="swapped")),
    ("attribute", "projection kind", ("kind", "dense", "sparse"),
     lambda w: _attribute(w, "Tkind", "--method", "tracin")),
    ("attribute", "projection dim", ("dim", "4", "6"),
     lambda w: _attribute(w, "Tdim", "--method", "tracin")),
    ("attribute", "seed", ("seed", "0", "3"),
     lambda w: _attribute(w, "Tseed", "--method", "tracin")),
    ("attribute", "layers", ("layers", "transformer.h.0.attn.c_attn"),
     lambda w: _attribute(w, "L", "--method", "graddot", "--checkpoints", "s1")),
    ("attribute", "whitened_by", ("whitened_by",),
     lambda w: _attribute(w, "W", "--factors", str(w["F2"]))),
    ("target_store", "projection kind", ("kind", "dense", "sparse"),
     lambda w: _target(w, "S", kind="sparse")),
    ("target_store", "projection dim", ("dim", "4", "12"), lambda w: _target(w, "S", dim=12)),
    ("target_store", "seed", ("seed", "0", "5"), lambda w: _target(w, "S", seed=5)),
    ("target_store", "layers", ("layers", "(24, 9)", "(48, 17)"),
     lambda w: _target(w, "S", model="wide")),
    ("target_store", "semantics", ("label_shift", "1", "0"),
     lambda w: _target(w, "S", label_shift=0)),
    ("target_store", "whitened", ("whitened", "ekfac", "None"), lambda w: _target(w, "W")),
]


def _collect_swapped(w):
    from dattri_ds.tools import collect
    return collect.main, ["--run", str(w["swapped"]), "--data", w["data"], "--out",
                          str(w["S"]), *BASE, "--checkpoints", "s1"]


def _damage(name: str, info: Path) -> None:
    body = info.read_bytes()
    if name == "deleted":
        info.unlink()
    elif name == "empty":
        info.write_bytes(b"")
    elif name == "garbage":
        info.write_bytes(b"\x00\xffnot json\x9c")
    elif name == "truncated":
        info.write_bytes(body[: len(body) // 2])
    elif name == "list":
        info.write_text("[]")
    elif name == "edited":
        info.write_text(body.decode().replace('"float32"', '"float16"'))
    elif name == "no spec":  # valid checksum, malformed content
        from dattri_ds.store.format import json_checksum
        obj = json.loads(body)
        del obj["spec"]
        obj["checksum"] = json_checksum(obj)
        info.write_text(json.dumps(obj))


DAMAGE = ("deleted", "empty", "garbage", "truncated", "list", "edited", "no spec")


def classify(code: int, lines: list[str], expect: tuple[str, ...], unchanged: bool,
             codes: tuple[int, ...] = (2,)) -> str:
    """``silent`` (exit 0), ``clear`` (an allowed exit code, one line naming every
    expected part, no foreign exception type, nothing written) or ``raw``."""
    if code == 0:
        return "silent"
    foreign = [m for ln in lines for m in RAW.findall(ln) if m not in OURS]
    ok = (code in codes and len(lines) == 1 and not foreign and unchanged
          and all(e in lines[0] for e in expect))
    return "clear" if ok else "raw"


def _tally(results: list[tuple[str, str, str]]) -> str:
    n = {k: sum(r[2] == k for r in results) for k in ("clear", "raw", "silent")}
    return (f"{len(results)} cases, {n['clear']} clear, {n['raw']} raw, {n['silent']} silent")


def test_every_spec_mismatch_is_refused_at_start_in_one_line(world):
    """Every (consumer, field) mismatch: exit 2, one line naming the field and both values,
    nothing written. Breaks if a consumer opens a store without comparing the request (a
    silent '0 to go', a ShapeError at the first scoring step, a raw traceback)."""
    results, detail = [], []
    for consumer, field, expect, make in CASES:
        main, argv = make(world)
        before = {k: _snapshot(world[k]) for k in ("S", "K", "L", "M", "W")}
        code, lines = _call(main, argv)
        out = world["tmp"] / "out"
        unchanged = before == {k: _snapshot(world[k]) for k in before} and not (
            out.exists() and any(p.is_file() for p in out.rglob("*")))  # (checked folders ok)
        kind = classify(code, lines, expect, unchanged)
        results.append((consumer, field, kind))
        written = sorted(str(p) for p in out.rglob("*") if p.is_file()) if out.exists() else []
        detail.append(f"{kind:6} {consumer:12} {field:16} exit {code} "
                      f"{'written ' if not unchanged else ''}{written} {lines}")
        shutil.rmtree(out, ignore_errors=True)
    summary = _tally(results)
    print("\n" + "\n".join(detail) + "\nspec mismatches: " + summary)
    assert all(r[2] == "clear" for r in results), summary + "\n" + "\n".join(
        d for d in detail if not d.startswith("clear"))


def test_damaged_manifest_through_fit_store_is_one_line_naming_the_file(world):
    """fit --store on a damaged info.json (deleted, empty, garbage, truncated, not an
    object, edited, malformed): one line naming that file once, exit 1 or 2, no raw type.
    Breaks if fit reads the manifest around the store reader."""
    from dattri_ds.tools import fit

    results, detail = [], []
    for name in DAMAGE:
        for form in ("store", "root"):
            dst = world["tmp"] / f"dmg-{name.replace(' ', '_')}-{form}"
            shutil.copytree(world["S"], dst)
            _damage(name, dst / "s1/info.json")
            store = dst / "s1" if form == "store" else dst
            code, lines = _call(fit.main, ["--run", str(world["run"]), "--data", world["data"],
                                           "--checkpoint", "s1", "--store", str(store),
                                           "--out", str(dst / "f.pt")])
            named = str(dst / "s1/info.json")
            ok_path = bool(lines) and named in lines[0] and "s1/s1" not in lines[0]
            kind = classify(code, lines, (named,) if ok_path else ("<path>",),
                            not (dst / "f.pt").exists(), codes=(1, 2))
            results.append(("fit", f"{name}/{form}", kind))
            detail.append(f"{kind:6} {name:10} --store {form:5} exit {code} {lines}")
    summary = _tally(results)
    print("\n" + "\n".join(detail) + "\ndamaged manifests: " + summary)
    assert all(r[2] == "clear" for r in results), summary + "\n" + "\n".join(
        d for d in detail if not d.startswith("clear"))


def test_collect_with_no_checkpoints_is_an_error(world):
    """``collect --checkpoints ""`` (or only commas) names the flag instead of exiting 0
    having written nothing."""
    from dattri_ds.tools import collect

    for value in ("", ",", " , "):
        out = world["tmp"] / "none"
        code, lines = _call(collect.main, ["--run", str(world["run"]), "--data",
                                           world["data"], "--out", str(out),
                                           "--checkpoints", value])
        assert code == 2 and len(lines) == 1 and "--checkpoints" in lines[0], (code, lines)
        assert not (out.exists() and any(out.rglob("shard-*")))


def test_matching_requests_are_accepted(world):
    """The door refuses only differences: the same requests with the store's own settings
    run (collect resumes with nothing to go, fit --store fits in the Kronecker store's
    space, attribute scores plain and whitened stores through the recipe, a selector is
    built on the store). Breaks if a field is compared that the consumer does not fix."""
    from dattri_ds.tools import collect, fit

    out = world["tmp"] / "ok"
    for name, main, argv in (
            ("collect", *(_collect(world, "S"))),
            ("fit --store", fit.main, ["--run", str(world["run"]), "--data", world["data"],
                                       "--checkpoint", "s1", "--store", str(world["K"]),
                                       "--out", str(out / "f.pt")]),
            ("attribute", *(_attribute(world, "S", "--method", "tracin"))),
            ("attribute whitened", *(_attribute(world, "W", "--factors", str(world["F1"])))),
            ("target_store", *(_target(world, "S")))):
        code, lines = _call(main, argv)
        assert code == 0 and not lines, (name, code, lines)
        shutil.rmtree(world["tmp"] / "out", ignore_errors=True)
    assert collect.main(_collect(world, "S")[1]) == {"s1": 0, "s2": 0}  # nothing to go
