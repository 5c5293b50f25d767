#!/bin/bash
# The LDS suite's 16 regimes (A, F-T) of benchmarks/lds.py: each one's flags and seed count,
# `run REGIME...` (train, retrain and score from scratch into $OUT/<regime>/seed<s>/) and
# `rescore REGIME...` (copy each seed's lds.json into $H/<regime>/seed<s>/ and rerun the
# benchmark there with the scoring settings $SCORE only: the saved ground truth is reused,
# no subset is retrained). docs/attribution_fidelity.md cites the commands that use it:
#
#   source benchmarks/lds_suite/regimes.sh
#   OUT=runs/lds_suite run A F G H I J K L M N O P Q R S T          # ~10-25 min a regime
#   H=runs/lds_hybrid SCORE="--projections exact --methods ekfac,ekfac-trajectory,tfidf \
#     --hybrid-weights 0.1,0.25,0.5,1,2" rescore A F G ...           # ~2-5 min a regime
#   python benchmarks/lds_suite/hybrid.py A=runs/lds_hybrid/A/lds.json F=...   # tables, folds
#
# Regimes: A the default GPT-2 2x64 BPE preset (data/tiny); F-O other architectures,
# tokenizers, optimizers and query sets on the same pool; P-T a second pool (data/corpus
# minus data/tiny and every query, drawn round-robin over its sources).
OUT=${OUT:-runs/lds_suite}
H=${H:-runs/lds_rescore}
RUN="--projections exact --powers 0.8,1.0 --methods ekfac,ekfac-trajectory,kfac,kfac-trajectory,tfidf"
CHAR="--tokenizer char --batch-size 8 --epochs 8"
LLAMA="--model-config configs/model_llama_lds.json"
G4="--model-config configs/model_gpt2_4x64_lds.json"
CORPUS="--train-data data/corpus/train.jsonl --exclude-data data/tiny/train.jsonl"
declare -A FLAGS REP
FLAGS[A]="";                                       REP[A]=3
FLAGS[F]="$CHAR";                                  REP[F]=3
FLAGS[G]="$CHAR $LLAMA";                           REP[G]=3
FLAGS[H]="$CHAR $LLAMA --queries heldout";         REP[H]=3
FLAGS[I]="$CHAR $LLAMA --optimizer sgd";           REP[I]=3
FLAGS[J]="$CHAR --queries heldout";                REP[J]=3
FLAGS[K]="$LLAMA --optimizer sgd";                 REP[K]=3
FLAGS[L]="$G4";                                    REP[L]=3
FLAGS[M]="$G4 --optimizer sgd";                    REP[M]=3
FLAGS[N]="$CHAR $G4";                              REP[N]=5
FLAGS[O]="--queries heldout --optimizer sgd";      REP[O]=3
FLAGS[P]="$CORPUS";                                REP[P]=3
FLAGS[Q]="$CORPUS $LLAMA";                         REP[Q]=3
FLAGS[R]="$CORPUS --optimizer sgd --queries heldout"; REP[R]=3
FLAGS[S]="$CORPUS --queries heldout";              REP[S]=3
FLAGS[T]="$CORPUS $CHAR";                          REP[T]=3
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
PY=${PY:-.venv/bin/python}

run() {
  for r in "$@"; do
    mkdir -p "$OUT"
    start=$(date +%s)
    $PY benchmarks/lds.py --out "$OUT/$r" --repeats ${REP[$r]} $RUN ${FLAGS[$r]} > "$OUT/$r.log" 2>&1
    echo "$r rc $? wall $(( $(date +%s) - start )) s"
  done
}

rescore() {
  for r in "$@"; do
    for s in $(seq 0 $((REP[$r] - 1))); do
      [ -f "$H/$r/seed$s/lds.json" ] || { mkdir -p "$H/$r/seed$s"; cp "$OUT/$r/seed$s/lds.json" "$H/$r/seed$s/"; }
    done
    start=$(date +%s)
    $PY benchmarks/lds.py --out "$H/$r" --repeats ${REP[$r]} $SCORE ${FLAGS[$r]} > "$H/$r.log" 2>&1
    echo "$r rc $? wall $(( $(date +%s) - start )) s"
    grep -c "retrained subset" "$H/$r.log" | sed "s/^/$r retrained subsets (must be 0): /"
  done
}
