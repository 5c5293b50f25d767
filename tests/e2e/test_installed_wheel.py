"""The product as a user installs it: sdist -> wheel -> a fresh virtualenv, used outside the tree.

Invariants: the sdist built from the checkout holds every module, and the wheel built from
that sdist installs, into a new virtualenv, every module of ``dattri_ds``, ``selection``,
``launch`` and ``tools`` (as ``dattri_ds.selection`` etc.); each imports from the installed
copy with the working directory outside the source tree (so nothing resolves through the
checkout); ``dattri-ds --help`` and every subcommand's ``--help`` exit 0; and a tiny
``collect -> attribute -> curate`` runs through the installed console command. A package
forgotten by setup.py (as ``dattri_ds.curate`` once was) fails here, not in a user's hands.

The new virtualenv sees the test environment's third-party packages (torch, transformers,
...) through a ``.pth`` entry pointing at a folder of links to them that leaves out every
trace of the editable dattri-ds, so pip resolves the wheel's own requirements against
them, installs dattri-ds itself from the wheel, and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "structure"))
from test_import_graph import modules  # noqa: E402  (module names as setup.py installs them)
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n" \
        f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _deps_view(into: Path) -> Path:
    """Links to this environment's site-packages entries, minus dattri-ds's own."""
    site = Path(sysconfig.get_paths()["purelib"])
    into.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("dattri_ds", "dattri-ds", "__editable__")) or name.endswith(".pth"):
            continue
        (into / entry.name).symlink_to(entry)
    return into


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, dattri-ds command, environment, work dir) of a fresh venv holding the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    build = tmp / "src"
    # the sdist from the committed tree (what a clean clone holds; the checkout stays
    # clean), then the wheel from the sdist: what `python -m build` does
    build.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(build)], input=archive, check=True)
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], build)
    sdist = next(dist.glob("*.tar.gz"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(dist), str(sdist)], tmp)
    wheel = next(dist.glob("*.whl"))
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   tmp).strip()
    Path(purelib, "test_deps.pth").write_text(str(_deps_view(tmp / "deps")) + "\n")
    # the venv's bundled setuptools would shadow the (newer) one torch requires
    _run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], tmp)
    _run([str(py), "-m", "pip", "install", "-q", "--no-index", str(wheel)], tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    work = tmp / "work"
    work.mkdir()
    return {"py": py, "cli": env_dir / "bin" / "dattri-ds", "env": env, "work": work,
            "wheel": wheel, "sdist": sdist, "modules": modules(build), "tree": build}


def test_wheel_and_sdist_hold_every_module(installed):
    """Every source module of the four folders is in the wheel, under its installed name."""
    import tarfile

    want = {name.replace(".", "/") + (
        "/__init__.py" if path.name == "__init__.py" else ".py") for name, path in
        installed["modules"].items()}
    in_wheel = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert not want - in_wheel, f"missing from the wheel: {sorted(want - in_wheel)}"
    with tarfile.open(installed["sdist"]) as tar:
        in_sdist = {"/".join(n.split("/")[1:]) for n in tar.getnames()}
    sources = {str(p.relative_to(installed["tree"])) for p in installed["modules"].values()}
    assert not sources - in_sdist, f"missing from the sdist: {sorted(sources - in_sdist)}"


def test_every_module_imports_from_the_installed_copy(installed):
    """Importing each module from outside the tree resolves to the venv, never the checkout."""
    names = sorted(installed["modules"])
    code = ("import importlib, json, sys\nbad = {}\n"
            f"for n in {names!r}:\n"
            "    try:\n"
            "        m = importlib.import_module(n)\n"
            f"        if not m.__file__.startswith({str(installed['py'].parents[1])!r}):\n"
            "            bad[n] = 'imported from ' + m.__file__\n"
            "    except Exception as e:\n"
            "        bad[n] = f'{type(e).__name__}: {e}'\n"
            "print(json.dumps(bad))\n")
    bad = json.loads(_run([str(installed["py"]), "-c", code], installed["work"],
                          installed["env"]).splitlines()[-1])
    assert not bad, bad


def test_every_subcommand_answers_help(installed):
    """``dattri-ds --help`` and each subcommand's ``--help`` exit 0 from the console script."""
    cli, env, work = str(installed["cli"]), installed["env"], installed["work"]
    assert "collect" in _run([cli, "--help"], work, env)
    subs = _run([str(installed["py"]), "-c", "from dattri_ds.tools.cli import COMMANDS; "
                 "print(' '.join(COMMANDS))"], work, env).split()
    assert {"collect", "fit", "attribute", "curate"} <= set(subs), subs
    for sub in subs:
        assert "usage" in _run([cli, sub, "--help"], work, env).lower(), sub


def test_collect_attribute_curate_from_the_installed_copy(installed):
    """A tiny save_pretrained GPT-2: collect its rows, attribute queries, curate a subset."""
    py, cli, env, work = (str(installed["py"]), str(installed["cli"]), installed["env"],
                          installed["work"])
    make = (
        "import json, torch\n"
        "from tokenizers import Tokenizer, models, pre_tokenizers\n"
        "from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast\n"
        "torch.manual_seed(0)\n"
        "GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=24, n_embd=32, n_layer=2, "
        "n_head=4)).save_pretrained('model')\n"
        "tk = Tokenizer(models.WordLevel({f'w{i}': i for i in range(64)}, unk_token='w1'))\n"
        "tk.pre_tokenizer = pre_tokenizers.Whitespace()\n"
        "PreTrainedTokenizerFast(tokenizer_object=tk, pad_token='w0', bos_token='w2', "
        "eos_token='w3').save_pretrained('model')\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for name, n in (('pool.jsonl', 8), ('queries.jsonl', 2)):\n"
        "    with open(name, 'w') as fh:\n"
        "        for i in range(n):\n"
        "            w = torch.randint(4, 64, (9,), generator=g).tolist()\n"
        "            fh.write(json.dumps({'id': f'{name[0]}{i}', 'source': 's', 'title': '', "
        "'text': ' '.join(f'w{x}' for x in w)}) + '\\n')\n")
    _run([py, "-c", make], work, env)
    _run([cli, "collect", "--model", "model", "--data", "pool.jsonl", "--projection-dim", "8",
          "--out", "grads"], work, env)
    _run([cli, "attribute", "--model", "model", "--store", "grads", "--queries",
          "queries.jsonl", "--method", "graddot", "--out", "attr"], work, env)
    _run([cli, "curate", "--model", "model", "--store", "grads", "--pool", "pool.jsonl",
          "--target", "queries.jsonl", "--examples", "3", "--out", "subset"], work, env)
    import numpy as np

    assert np.load(work / "attr" / "scores.npy").shape == (8, 2)
    chosen = (work / "subset" / "subset.jsonl").read_text().splitlines()
    assert len(chosen) == 3
