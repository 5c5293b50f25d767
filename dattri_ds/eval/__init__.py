"""Evaluation of attribution scores against retrained models (Linear Datamodeling Score).

Not imported by ``import dattri_ds``; needs only torch.
"""

from dattri_ds.eval.lds import (
    LDSResult, lds, predicted, rankdata, retrain_losses, spearman, subset_masks,
)

__all__ = ["LDSResult", "subset_masks", "retrain_losses", "predicted", "rankdata", "spearman",
           "lds"]
