"""Where the offline tools get a trained model: one ``Source`` protocol, three sources.

* ``Run`` (``run.py``): a launch/train.py output folder (``--run-dir``);
* ``HFModelDir`` (``hf.py``): one Hugging Face ``save_pretrained`` folder (``--model``);
* ``HFCheckpoints`` (``hf_checkpoints.py``): Hugging Face checkpoint folders of one run
  (``--checkpoints DIR [DIR ...]``).

``base.py`` declares what a tool may ask of any of them; ``flags.py`` turns the source flags
into one (``open_source``) and chooses its checkpoints (``source_tags``).
"""

from __future__ import annotations

from dattri_ds.tools.sources.base import Source, check_checkpoints
from dattri_ds.tools.sources.flags import (
    add_checkpoint_args, add_source_args, checkpoint_tags, open_source, source_flags,
    source_tags, tag_choice,
)
from dattri_ds.tools.sources.hf import HFModelDir, HFTokenizer
from dattri_ds.tools.sources.hf_checkpoints import HFCheckpoints
from dattri_ds.tools.sources.run import Run

__all__ = ["Source", "Run", "HFModelDir", "HFCheckpoints", "HFTokenizer", "open_source",
           "add_source_args", "add_checkpoint_args", "source_tags", "checkpoint_tags",
           "tag_choice", "source_flags", "check_checkpoints"]
