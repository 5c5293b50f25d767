"""Attribution methods sharing one train x query scoring loop; importing registers them.

``graddot``, ``gradcos``, ``tracin``, ``kfac``, ``ekfac``, ``kfac-trajectory``,
``ekfac-trajectory``: ``make_attributor(name, ...)``.
"""

from dattri_ds.methods.base import (
    Attributor, Scores, get_attributor, make_attributor, registered_attributors,
)
from dattri_ds.methods.curvature import EKFAC, KFAC, fit_factors
from dattri_ds.methods.graddot import GradCos, GradDot
from dattri_ds.methods.tracin import (
    Checkpoint, EKFACTrajectory, KFACTrajectory, TracIn, Trajectory,
)

__all__ = [
    "Attributor", "Scores", "get_attributor", "make_attributor", "registered_attributors",
    "GradDot", "GradCos", "TracIn", "Trajectory", "EKFACTrajectory", "KFACTrajectory",
    "Checkpoint", "KFAC", "EKFAC", "fit_factors",
]
