#!/bin/bash
# The saved seed folders and flags of every tools/lds.py regime with per-seed records (A, F-T),
# and `rescore REGIME...`: copy each regime's per-seed lds.json into $H/<regime>/seed<s>/ (the
# originals stay untouched) and rerun tools/lds.py there with the scoring settings $SCORE only
# (ground truth reused: no subset retraining). Sourced by this folder's rescore.sh and by
# ../lds_damping_2026-12-03/rescore.sh, which set H and SCORE.
CHAR="--tokenizer char --batch-size 8 --epochs 8"
LLAMA="--model-config configs/model_llama_lds.json"
G4="--model-config results/lds_regimes_2026-12-03/model_gpt2_4x64.json"
CORPUS="--train-data data/corpus/train.jsonl --exclude-data data/tiny/train.jsonl"
declare -A SRC FLAGS REP
SRC[A]=/work/runs/lds_source;                         FLAGS[A]="";                                REP[A]=3
SRC[F]=/work/runs/lds_regimes/F_char;                 FLAGS[F]="$CHAR";                           REP[F]=3
SRC[G]=/work/runs/lds_regimes/G_char_llama;           FLAGS[G]="$CHAR $LLAMA";                    REP[G]=3
SRC[H]=/work/runs/lds_regimes/H_char_llama_heldout;   FLAGS[H]="$CHAR $LLAMA --queries heldout";  REP[H]=3
SRC[I]=/work/runs/lds_regimes/I_char_llama_sgd;       FLAGS[I]="$CHAR $LLAMA --optimizer sgd";    REP[I]=3
SRC[J]=/work/runs/lds_regimes/J_char_heldout;         FLAGS[J]="$CHAR --queries heldout";         REP[J]=3
SRC[K]=/work/runs/lds_regimes/K_llama_sgd;            FLAGS[K]="$LLAMA --optimizer sgd";          REP[K]=3
SRC[L]=/work/runs/lds_regimes/L_gpt2_4x64;            FLAGS[L]="$G4";                             REP[L]=3
SRC[M]=/work/runs/lds_regimes/M_gpt2_4x64_sgd;        FLAGS[M]="$G4 --optimizer sgd";             REP[M]=3
SRC[N]=/work/runs/lds_regimes/N_gpt2_4x64_char;       FLAGS[N]="$CHAR $G4";                       REP[N]=5
SRC[O]=/work/runs/lds_regimes/O_gpt2_heldout_sgd;     FLAGS[O]="--queries heldout --optimizer sgd"; REP[O]=3
SRC[P]=/work/runs/lds_suite/P_corpus;                 FLAGS[P]="$CORPUS";                         REP[P]=3
SRC[Q]=/work/runs/lds_suite/Q_corpus_llama;           FLAGS[Q]="$CORPUS $LLAMA";                  REP[Q]=3
SRC[R]=/work/runs/lds_suite/R_corpus_heldout_sgd;     FLAGS[R]="$CORPUS --optimizer sgd --queries heldout"; REP[R]=3
SRC[S]=/work/runs/lds_suite/S_corpus_heldout;         FLAGS[S]="$CORPUS --queries heldout";       REP[S]=3
SRC[T]=/work/runs/lds_suite/T_corpus_char;            FLAGS[T]="$CORPUS $CHAR";                   REP[T]=3
rescore() {
for r in "$@"; do
  mkdir -p $H/$r
  for s in $(seq 0 $((REP[$r] - 1))); do
    [ -f $H/$r/seed$s/lds.json ] || { mkdir -p $H/$r/seed$s; cp ${SRC[$r]}/seed$s/lds.json $H/$r/seed$s/; }
  done
  start=$(date +%s)
  nice -n 5 .venv/bin/python tools/lds.py --out $H/$r --repeats ${REP[$r]} $SCORE ${FLAGS[$r]} > $H/$r.log 2>&1
  echo "$r rc $? wall $(( $(date +%s) - start )) s"
  grep -c "retraining skipped" $H/$r.log | sed "s/^/$r reused seeds: /"
  grep -c "retrained subset" $H/$r.log | sed "s/^/$r retrained subsets (must be 0): /"
done
}
