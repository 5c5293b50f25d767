#!/usr/bin/env bash
# One short GPU check (about 6-10 min on one H200; the device budget is 15 min in all):
#   1. the CUDA tests (tests/gpu: Megatron's optimizer + DDP on NCCL, bf16): none may skip;
#   2. with >= 2 GPUs, NCCL runs of launch/train.py on 2 ranks: DeepSpeed ZeRO-3 bf16 and
#      Megatron TP=2, each with --capture --online-selection (3 steps, finite loss, a store);
#   3. throughput at a Qwen-like size ladder (0.5B, 1.5B, 7B; bf16; B=4, T=512) with the
#      planner's prediction next to each measurement.
# Every step's status and time go to $OUT/summary.md; the script exits non-zero if any failed.
#
#   tools/gpu_check.sh              # on the GPU machine, from the repository root
#   tools/gpu_check.sh --dry-run    # here, without a GPU: checks the script, the imports,
#                                   # test collection and the throughput code on a tiny CPU model
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
SIZES=${SIZES:-0.5b,1.5b,7b}
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONWARNINGS=ignore
rm -rf "$OUT" && mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
printf '| step | status | seconds |\n|---|---|---|\n' > "$SUMMARY"
FAILED=0

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record status and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS status=ok
  echo "== $name: $*"
  if ! timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then status=FAILED; FAILED=1; fi
  printf '| %s | %s | %d |\n' "$name" "$status" $((SECONDS - t0)) >> "$SUMMARY"
  tail -n 5 "$OUT/$name.log"
  [[ $status == ok ]] || echo "!! $name FAILED (full log: $OUT/$name.log)" >&2
}

# The CUDA tests; a test that skips on a GPU machine is a failure, not a pass.
GPU_TESTS='set -o pipefail; "$0" -m pytest tests/gpu -q -x -p no:cacheprovider -rs 2>&1 |
  tee /dev/stderr | { ! grep -E "^SKIPPED|[0-9]+ skipped"; }'

if [[ $DRY == 1 ]]; then
  export DS_ACCELERATOR=cpu
  step collect-gpu-tests 300 "$PY" -m pytest tests/gpu --collect-only -q -p no:cacheprovider
  # without CUDA the GPU tests skip, so the guard must report a failure here
  step skip-guard-fails-on-cpu 300 bash -c "! bash -c '$GPU_TESTS' '$PY'"
  step planner 120 "$PY" benchmarks/scale.py paper
  step throughput-dry 600 "$PY" benchmarks/scale.py throughput --sizes tiny --device cpu \
      --batch 2 --seq-len 64 --reps 1 --out "$OUT"
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check: torch sees no CUDA device (torch.cuda.device_count() = 0)" >&2
    exit 2
  fi
  unset DS_ACCELERATOR
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.csv"
  step cuda-tests 300 bash -c "$GPU_TESTS" "$PY"
  if [[ "$NGPU" -ge 2 ]]; then
    TRAIN=(launch/train.py --model-config configs/model_llama_tiny.json
           --train-data data/tiny/train.jsonl --max-docs 64 --seq-len 64 --vocab-size 512
           --steps 3 --capture --online-selection --target-data data/tiny/target.jsonl
           --target-max-docs 4 --log-every 1)
    cat > "$OUT/zero3_bf16.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": true}},
 "steps_per_print": 1000000000,
 "dattri_ds": {"capture": {"dtype": "bfloat16", "projection": {"dim": 256}}}}
JSON
    step nccl-zero3 300 "$(dirname "$PY")/torchrun" --standalone --nproc_per_node 2 \
        "${TRAIN[@]}" --deepspeed_config "$OUT/zero3_bf16.json" --out "$OUT/nccl_zero3"
    step nccl-megatron-tp2 300 "$(dirname "$PY")/torchrun" --standalone --nproc_per_node 2 \
        "${TRAIN[@]}" --backend megatron --tensor-model-parallel-size 2 \
        --deepspeed_config configs/zero1_cpu.json --out "$OUT/nccl_megatron"
    for run in nccl_zero3 nccl_megatron; do
      [[ -d "$OUT/$run" ]] || continue
      step "check-$run" 60 "$PY" - "$OUT/$run" <<'PYCHECK'
import json, math, sys
from pathlib import Path
run = Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
assert math.isfinite(s["final_loss"]), s
assert any(run.glob("**/info.json")), f"no gradient store under {run}"
print("ok:", {k: s[k] for k in ("steps", "examples", "final_loss")})
PYCHECK
    done
  else
    printf '| nccl (2 GPUs) | not run: %s GPU |  |\n' "$NGPU" >> "$SUMMARY"
  fi
  step throughput 420 "$PY" benchmarks/scale.py throughput --sizes "$SIZES" --device cuda \
      --batch 4 --seq-len 512 --reps 3 --out "$OUT"
fi

{ echo; cat "$OUT/throughput.md" 2>/dev/null || echo "(no throughput table)"; } >> "$SUMMARY"
echo; cat "$SUMMARY"
if [[ $FAILED != 0 ]]; then
  echo "gpu_check: FAILED steps above (logs in $OUT/)" >&2
  exit 1
fi
echo "gpu_check: all steps passed"
