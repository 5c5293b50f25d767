"""Evaluation of attribution scores against retrained models (Linear Datamodeling Score).

Not imported by ``import dattri_ds``; needs only torch.
"""

from dattri_ds.eval.lds import (
    LDSResult, lds, predicted, rankdata, retrain_losses, spearman, subset_masks,
)
from dattri_ds.eval.text_overlap import char_ngrams, tfidf_scores, with_text_prior, zscore

__all__ = ["char_ngrams", "tfidf_scores", "with_text_prior", "zscore", "LDSResult",
           "subset_masks", "retrain_losses", "predicted", "rankdata", "spearman", "lds"]
