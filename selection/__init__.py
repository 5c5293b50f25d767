"""Online data selection: score candidates against a target gradient, train on the best.

Installed as ``dattri_ds.selection`` (the top-level name ``selection`` belongs to another
package on the index).
"""

from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.online import (
    OnlineSelector, Selection, check_engine_supported, check_target_compatible, log_file,
    read_selection_log,
)
from dattri_ds.selection.policy import POLICIES, choose, greats, threshold, top_fraction, top_k
from dattri_ds.selection.scorer import alignment_scores, redundancy_gram
from dattri_ds.selection.target import FixedTarget, TargetProvider, ValidationTarget

__all__ = [
    "SelectionConfig", "OnlineSelector", "Selection", "check_engine_supported",
    "check_target_compatible", "log_file", "read_selection_log",
    "POLICIES", "choose", "greats", "threshold", "top_fraction", "top_k",
    "alignment_scores", "redundancy_gram", "TargetProvider", "ValidationTarget", "FixedTarget",
]
