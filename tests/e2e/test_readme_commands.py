"""Every shell command of README.md, in order, as a user runs them after the main job.

Invariant: each command of the README's ```bash blocks (parsed from README.md, continuation
lines joined, comments dropped), then the library tour it names in prose, runs from a folder
laid out like a clone (``launch/``, ``configs/``, ``data/``, ``tools/`` linked) in the order
written, exits 0 and prints no warning line (a line a user would have to decode). The
README's text is kept; only sizes shrink (``SIZES``: fewer steps and examples), the main job
runs ``--quick`` (the README's own smoke size) into this folder, ``deepspeed`` gets a free
``--master_port``, and the placeholder ``truth.json`` is written from the attribution (losses
exactly linear in its scores, so ``dattri-ds lds`` must print an LDS of 1.000). Not run
here: ``tools/run_tests.sh`` (it runs this test) and ``tools/demo.py --quick``
(tests/unit/test_data.py runs it, checks its outputs and that it prints no warning).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import require

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow
require("deepspeed", "deepspeed")
require("megatron.core", "megatron")

#: (pattern, replacement) applied to every command: sizes only. Each must match a command.
SIZES = (
    (r"--steps (200|40|120)\b", "--steps 2"),
    (r"(dattri-ds collect --run runs/warm .*?--checkpoints last)", r"\1 --max-docs 48"),
    (r"--max-docs 256\b", "--max-docs 24"),
    (r"--max-docs 700\b", "--max-docs 32"),
)
#: Commands replaced as a whole (README text -> what runs, and why).
WHOLE = {
    # run_demo.sh = tools/setup_env.sh (this venv) + tools/main_job.py "$@"; --quick is the
    # README's smoke size; --out: main_job.py writes relative to the repository, not the cwd
    "bash tools/run_demo.sh": "python tools/main_job.py --quick --out {cwd}/runs/main",
}
NOT_RUN = {"bash tools/run_tests.sh",  # the suite this test belongs to
           # run by tests/unit/test_data.py::test_demo_quick_end_to_end, which checks its
           # outputs and that it prints no warning line (WARNING, the same rule as here)
           "python tools/demo.py [--quick]"}
#: Lines with these words are findings, but for ``ALLOWED`` (text -> why a user needs no
#: decoding).
WARNING = re.compile(r"warn|deprecat", re.I)
ALLOWED = {
    "Unable to find hostfile, will proceed with training with local resources only":
        "the deepspeed launcher's own line, printed before launch/train.py starts; it says "
        "what it does (one node), which is what --num_gpus 2 asks for",
}


def readme_commands() -> list[str]:
    """The README's shell commands in order: every ```bash block, then the prose tour."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                cmds.append(re.sub(r"\s+", " ", line))
    cmds += [c for c in ("python tools/demo.py [--quick]",) if f"`{c}`" in text]
    return cmds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_run(cmd: str, cwd: Path, used: set[int]) -> list[str] | None:
    """The argv that runs ``cmd`` here (None: not run), sizes shrunk (``SIZES``)."""
    if cmd in NOT_RUN:
        return None
    cmd = WHOLE.get(cmd, cmd).format(cwd=cwd)
    for i, (pattern, repl) in enumerate(SIZES):
        cmd, n = re.subn(pattern, repl, cmd)
        used.update([i] if n else [])
    argv = shlex.split(cmd)
    if argv[0] in ("python", "dattri-ds", "deepspeed", "torchrun"):
        argv[0] = sys.executable if argv[0] == "python" else str(BIN / argv[0])
    if argv[0].endswith("deepspeed"):
        argv[1:1] = ["--master_port", str(_free_port())]
    return argv


def write_truth(cwd: Path, argv: list[str]) -> None:
    """``truth.json`` for ``dattri-ds lds``: 4 subsets of the attributed documents, losses
    exactly the attribution's linear prediction (so its LDS is 1)."""
    import numpy as np
    import torch

    from dattri_ds.eval import predicted
    from dattri_ds.sample_id import SampleId

    att = cwd / argv[argv.index("--attribution") + 1]
    ids = json.loads((att / "train_ids.json").read_text())
    docs = sorted({SampleId.parse(i).doc for i in ids})
    subsets = [docs[k::2] + docs[:k] for k in range(4)]
    masks = torch.tensor([[SampleId.parse(i).doc in set(s) for i in ids] for s in subsets])
    scores = torch.as_tensor(np.load(att / "scores.npy")).double()
    losses = predicted(scores, masks).tolist()
    (cwd / "truth.json").write_text(json.dumps({"subsets": subsets, "losses": losses}))


def test_every_readme_command_runs_in_order(tmp_path):
    cwd = tmp_path / "clone"
    cwd.mkdir()
    for name in ("launch", "configs", "data", "tools", "benchmarks"):
        (cwd / name).symlink_to(ROOT / name)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
           "PATH": f"{BIN}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    used: set[int] = set()
    ran, warned = [], []
    commands = readme_commands()
    assert "bash tools/run_demo.sh" in commands and any("--backend megatron" in c
                                                        for c in commands)
    for cmd in commands:
        argv = as_run(cmd, cwd, used)
        if argv is None:
            continue
        if argv[1:2] == ["lds"]:
            write_truth(cwd, argv)
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd}\n-> exit {proc.returncode}:\n{out[-3000:]}"
        warned += [f"{cmd[:60]}: {ln}" for ln in out.splitlines() if WARNING.search(ln)
                   and not any(a in ln for a in ALLOWED)]
        ran.append((cmd, out))
        if argv[1:2] == ["lds"]:
            assert "LDS of ekfac-trajectory" in out and ": 1.000 +- 0.000" in out, out
    assert used == set(range(len(SIZES))), "a size substitution no longer matches the README"
    assert len(ran) == len(commands) - len(NOT_RUN)
    assert not warned, "\n".join(warned)
