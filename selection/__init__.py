"""Online data selection: score candidates against a target gradient, train on the best.

A step is a list of stages (selection/stages.py) folding a ``StepState``. Extension
points: ``Score`` (a registered class, selection/scorer.py, ``SCORES``) and ``Ranker``
stages (selection/rank.py); the target is built in one place, ``build_target``
(selection/target.py).

Installed as ``dattri_ds.selection`` (the top-level name ``selection`` belongs to another
package on the index).
"""

from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.checks import check_engine_supported, check_target_compatible
from dattri_ds.selection.log import log_file, read_selection_log
from dattri_ds.selection.online import OnlineSelector
from dattri_ds.selection.stages import Selection, StepState
from dattri_ds.selection.policy import top_k
from dattri_ds.selection.rank import Ranker
from dattri_ds.selection.scorer import SCORES, Score, alignment_scores
from dattri_ds.selection.target import (
    FixedTarget, Target, TargetProvider, ValidationTarget, build_target,
)

__all__ = [
    "SelectionConfig", "OnlineSelector", "Selection", "StepState", "check_engine_supported",
    "check_target_compatible", "log_file", "read_selection_log",
    "top_k", "SCORES", "Score", "Ranker", "alignment_scores",
    "Target", "TargetProvider", "ValidationTarget", "FixedTarget", "build_target",
]
