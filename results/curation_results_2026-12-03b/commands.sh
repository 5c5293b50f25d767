#!/bin/bash
# The benchmark behind docs/curation.md ("Measured effect", pool of 2000), as run on
# 2026-12-03: one process at a time; every pass resumes main/ (runs already in
# main/runs.jsonl are skipped, warm-up checkpoints and stores under --work-dir are reused).
# main/invocations.jsonl records every invocation (arguments and start time).
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DS_ACCELERATOR=cpu
B="nice -n 5 .venv/bin/python benchmarks/curation_effect.py"
C="--name main --results-dir results/curation_results_2026-12-03b --work-dir /work/runs/curation2/work --pool-docs 2000 --warmup-steps 40 --steps 60 --order pool"
T4="--targets hamlet hamlet@noise0.3 code carve:python_docs"
T2="--targets hamlet hamlet@noise0.3"
# 1. sizing: seed 0 alone, end to end (full pool; random, DSIR and combined at 5% and 10%)
$B $C --seeds 0 $T4 --fractions 0.05 0.1 --methods combined
# 2. the same for seeds 1-4 (seed 0 is skipped: already recorded)
$B $C --seeds 0 1 2 3 4 $T4 --fractions 0.05 0.1 --methods combined
# 3a. plain cosine (the tool's default method before this run) and adam-cosine (LESS) at 10%
$B $C --seeds 0 1 2 3 4 $T2 --fractions 0.1 --methods cosine adam-cosine
# 4. screening of gradient variants (3 seeds, 10%, hamlet and the noisy pool): the cascade
#    (content-prior shortlist of 2 budgets re-ranked by gradient cosine), combined with
#    --content-weight 2, combined with --aggregate max
$B $C --seeds 0 1 2 $T2 --fractions 0.1 --methods cascade
$B $C --seeds 0 1 2 $T2 --fractions 0.1 --methods combined --tag cw2 --select-args --content-weight 2
$B $C --seeds 0 1 2 $T2 --fractions 0.1 --methods combined --tag max --select-args --aggregate max
# 3b. cosine and adam-cosine at 10% on the other two targets
$B $C --seeds 0 1 2 3 4 --targets code carve:python_docs --fractions 0.1 --methods cosine adam-cosine
# 5. confirmation of the screened variant that led DSIR on the noisy pool (combined with
#    --content-weight 2): 5 seeds, every target, 5% and 10% (code and the carved target
#    and seeds 3-4 were not screened)
$B $C --seeds 0 1 2 3 4 $T4 --fractions 0.05 0.1 --methods combined --tag cw2 --select-args --content-weight 2
# 6. screening of a longer warm-up (200 steps instead of 40: new checkpoints and stores, its
#    own folder warm200/; full, random and DSIR do not depend on the warm-up and repeat
#    main/'s numbers exactly): combined and cosine at 10%, 3 seeds, hamlet and the noisy pool
$B --name warm200 --results-dir results/curation_results_2026-12-03b --work-dir /work/runs/curation2/work200 --pool-docs 2000 --warmup-steps 200 --steps 60 --order pool --seeds 0 1 2 $T2 --fractions 0.1 --methods combined cosine
# tables
$B $C --methods combined cosine adam-cosine combined+cw2 --summarize > results/curation_results_2026-12-03b/summary.md
$B --name warm200 --results-dir results/curation_results_2026-12-03b --methods combined cosine --summarize > results/curation_results_2026-12-03b/summary_warm200.md
