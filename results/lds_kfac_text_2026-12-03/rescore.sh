#!/bin/bash
# Rescore the 16 LDS regimes with the K-FAC methods and their text-overlap hybrids (ground truth reused).
cd /work/main
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
H=/work/runs/lds_kfac
SCORE="--projections exact --powers 0.8 --methods kfac,kfac-trajectory,tfidf --hybrid-weights 0.1,0.25,0.5,1"
source results/lds_suite_2026-12-03/regimes.sh
rescore ${@:-A F G H I J K L M N O P Q R S T}
