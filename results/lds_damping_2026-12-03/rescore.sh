#!/bin/bash
# Rescore saved seeds at four dampings (and the projected default), ground truth reused.
# Copies each regime's per-seed lds.json into /work/runs/lds_damp/<regime>/seed<s>/ (the
# originals stay untouched) and reruns tools/lds.py there with scoring settings only.
# Dampings are listed with the default 0.003 first: projected settings use the first damping
# and power (tools/lds.py score_all), so whitened-sparse:4096 runs at the default 0.003 / 0.8.
# Usage: SCORE="..." bash results/lds_damping_2026-12-03/rescore.sh REGIME...  (A F..O P..T)
cd /work/main
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
H=${H:-/work/runs/lds_damp}
SCORE=${SCORE:-"--projections exact,whitened-sparse:4096 --powers 0.8 --dampings 0.003,0.001,0.01,0.03 --methods ekfac,ekfac-trajectory,tfidf --hybrid-weights 0.25,0.5"}
source results/lds_suite_2026-12-03/regimes.sh
rescore "$@"
