"""A checkpoint is written all or nothing (launch/save.py), and a failed write is one line.

Invariants: ``write_checkpoint`` renames ``<tag>.tmp`` to ``<tag>`` and points ``latest`` at
it only after the write returned (temporaries of earlier saves are removed first, an
existing ``<tag>`` is replaced); a write that fails under a real file-size limit (torch.save's
errno-less ``inline_container`` error, safetensors' Rust io error) is one WriteError line
naming the partial file, "File too large" and the fix, with the temporary folder removed and
``latest`` untouched. Breaks if a partial folder could be taken for a checkpoint or the raw
torch text reached a user.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dattri_ds.errors import WriteError
from dattri_ds.launch.save import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_complete_write_is_renamed_then_latest(tmp_path):
    """step2 written: the folder holds what ``write`` wrote, ``latest`` names it, a stale
    ``step9.tmp`` is gone; writing step2 again replaces it."""
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step9.tmp").mkdir(parents=True)
    seen = []

    def write(folder: Path) -> None:
        seen.append(folder.name)
        assert not (ckpt / "step2").exists() and not (ckpt / "latest").exists()
        (folder / "a.txt").write_text("one")

    write_checkpoint(ckpt, "step2", 0, write, [])
    assert seen == ["step2.tmp"] and (ckpt / "latest").read_text() == "step2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step2"]
    write_checkpoint(ckpt, "step2", 0, lambda f: (f / "b.txt").write_text("two"), ["step2"])
    assert sorted(p.name for p in (ckpt / "step2").iterdir()) == ["b.txt"]


def test_other_errors_pass_through_and_leave_no_listing(tmp_path):
    """An error that is not a failed write is re-raised as it is; nothing is renamed."""
    ckpt = tmp_path / "checkpoints"

    def boom(folder: Path) -> None:
        raise KeyError("not a write")

    with pytest.raises(KeyError):
        write_checkpoint(ckpt, "step2", 0, boom, [])
    assert not (ckpt / "step2").exists() and not (ckpt / "latest").exists()


#: Under a 20 kB file-size limit, a checkpoint whose weights file is 400 kB.
_LIMITED = """
import resource, signal, sys, torch
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from dattri_ds.cli.exits import run
from dattri_ds.io.outputs import naming
from dattri_ds.launch.save import write_checkpoint
ckpt = Path(sys.argv[1]) / "checkpoints"
def write(folder):
    (folder / "meta.json").write_text("{}")
    if sys.argv[2] == "torch":
        torch.save({"w": torch.zeros(100000)}, folder / "weights.pt")
    else:
        from safetensors.torch import save_file
        with naming(folder / "model.safetensors"):
            save_file({"w": torch.zeros(100000)}, str(folder / "model.safetensors"))
sys.exit(run(lambda argv: write_checkpoint(ckpt, "step4", 0, write, ["step2"]), []))
"""


@pytest.mark.parametrize("writer,name", [("torch", "weights.pt"),
                                         ("safetensors", "model.safetensors")])
def test_file_size_limit_is_one_line_naming_the_file(tmp_path, writer, name):
    """A real RLIMIT_FSIZE in a subprocess: exit 1, one line naming step4.tmp/<file>, the
    cause and the fix; no step4, no step4.tmp, no latest."""
    (tmp_path / "checkpoints" / "step2").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", _LIMITED, str(tmp_path), writer], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "PYTHONDONTWRITEBYTECODE": "1"})  # no cut .pyc under the limit
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    line = lines[0]
    assert line.startswith("dattri-ds: error: writing ") and "inline_container" not in line
    assert f"checkpoints/step4.tmp/{name} failed: File too large" in line, line
    assert "complete checkpoints are ['step2']" in line and "--resume latest" in line, line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step2"]
    assert WriteError.__name__ not in line
