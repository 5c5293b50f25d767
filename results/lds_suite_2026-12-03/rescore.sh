#!/bin/bash
# Rescore saved seeds with hybrid rows (ground truth reused: no subset retraining).
# Usage: bash results/lds_suite_2026-12-03/rescore.sh REGIME...   (REGIME in A F..O P..T)
cd /work/main
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
H=/work/runs/lds_suite/hybrid
SCORE="--projections exact --methods ekfac,ekfac-trajectory,tfidf --hybrid-weights 0.1,0.25,0.5,1,2"
source results/lds_suite_2026-12-03/regimes.sh
rescore "$@"
