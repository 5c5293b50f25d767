#!/bin/bash
# The benchmark behind docs/curation.md ("Measured effect"), as run on 2026-12-03: one
# process at a time; every pass resumes (runs already in main/runs.jsonl are skipped), so
# the passes add variants and fractions to the same seeds, stores and subsets.
# main/invocations.jsonl records every invocation (arguments and start time).
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DS_ACCELERATOR=cpu
B="nice -n 5 .venv/bin/python benchmarks/curation_effect.py"
C="--name main --results-dir results/curation_results_2026-12-03 --work-dir /tmp/curation-work --seeds 0 1 2 3 4 --pool-docs 400 --warmup-steps 40 --steps 60 --order pool"
T3="--targets hamlet code carve:python_docs"
T4="--targets hamlet code carve:python_docs hamlet@noise0.3"
# 1. full pool, random and DSIR at 10%, combined at 5% and 10%
$B $C $T3 --fractions 0.05 0.1 --baselines-at 0.1 --methods combined
# 2. oracle: train on the target's own scored documents (32, or 64 for the carved target)
$B $C $T4 --fractions 0.05 0.1 --baselines-at 0.1 --methods combined --oracle-only
# 3. the noisy pool (30% of the pool's texts word-shuffled, per seed)
$B $C $T4 --fractions 0.05 0.1 --baselines-at 0.1 --methods combined
# 4. oracle of the 5% size: the first 20 scored documents
$B $C $T3 --fractions 0.05 --oracle-only --oracle-docs 20
# 5. adam-cosine (LESS) at 5% and 10%
$B $C $T4 --fractions 0.05 0.1 --baselines-at 0.1 --methods adam-cosine
# 6. 25%: random, DSIR, combined, then adam-cosine
$B $C $T4 --fractions 0.25 --methods combined
$B $C $T4 --fractions 0.25 --methods adam-cosine
# 7. plain cosine (the tool's default method) at 10%
$B $C $T4 --fractions 0.1 --methods cosine
$B $C --methods combined adam-cosine cosine --summarize > results/curation_results_2026-12-03/summary.md
