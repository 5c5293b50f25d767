#!/usr/bin/env bash
# One GPU check, one Markdown table (about 6-8 min on one H200; docs/gpu.md):
#   1. the CUDA tests (tests/gpu): exactness on CUDA, Megatron on NCCL; none may skip;
#   2. the throughput ladder (Qwen2 0.5B / 1.5B / 7B, bf16, B=4, T=512, Kronecker k=256):
#      plain forward+backward, collect, their ratio (target <= 1.3x), MFU, the planner;
#   3. the launch step costs (1B Llama, ZeRO-3 bf16, micro-batch 8, T=512): launch/train.py
#      plain, --capture (<= 1.05x), content selection (<= 1.02x), alignment (<= 2x) and a
#      bare DeepSpeed loop (plain within 1.1x of it), MFU and the planner beside each;
#   4. the planner's calibration against the recorded H200 points (python benchmarks/calibrate.py)
#      and refitted on this run's measurements (--from $OUT: planner-refit.log);
#   5. peers' collect (bergson, kronfluence, dattri, LogIX) when installed;
#   6. with >= 2 GPUs, NCCL runs of launch/train.py on 2 ranks (ZeRO-3 and Megatron TP=2).
# Logs go to $OUT/<step>.log; the table to $OUT/table.md and stdout. Exit status: non-zero if
# any step failed (a ratio over its target is a MISS row, measured, not a failure).
#
#   tools/gpu_check.sh              # on the GPU machine, from the repository root
#   tools/gpu_check.sh --dry-run    # here, without a GPU: the same steps on CPU, tiny sizes
#   tools/gpu_check.sh --bundle     # here: build .gpu/ (the wheels the GPU image lacks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[[ -x "$PY" ]] || PY=$(command -v python3)
OUT=${OUT:-runs/gpu_check}
SIZES=${SIZES:-0.5b,1.5b,7b}
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --bundle) MODE=bundle ;;
  "") ;;
  *) echo "usage: tools/gpu_check.sh [--dry-run | --bundle]" >&2; exit 2 ;;
esac
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error

if [[ $MODE == bundle ]]; then
  # What the bare GPU image (python 3.12, torch, transformers) lacks, in one ignored folder:
  # cp312 wheels of megatron-core and pydantic, and the pure-Python deepspeed + hjson of this
  # venv (no ops built). The project itself is used from the checkout (see below).
  grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude
  rm -rf .gpu && mkdir -p .gpu/whl .gpu/site
  ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d .gpu/whl "megatron-core==$(ver megatron-core)" "pydantic==$(ver pydantic)" \
      "pydantic-core==$(ver pydantic-core)" annotated-types typing-inspection
  SP=$("$PY" -c 'import importlib.util as u, os
print(os.path.dirname(os.path.dirname(u.find_spec("deepspeed").origin)))')  # no import: no log
  cp -a "$SP/deepspeed" "$SP"/deepspeed-*.dist-info "$SP/hjson" "$SP"/hjson-*.dist-info .gpu/site/
  find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
  git rev-parse HEAD > .gpu/COMMIT
  du -sh .gpu/whl .gpu/site
  echo "gpu_check: bundle ready; carry .gpu (run tool: carry [\".gpu\"])"
  exit 0
fi

# ---- the GPU image: carried wheels, and the checkout importable as dattri_ds.{launch,...} --
if [[ -d .gpu/whl ]] && ! "$PY" -c 'import deepspeed' 2>/dev/null; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/whl/*.whl
  export PYTHONPATH="$SITE:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
fi
LINKS=()
if ! "$PY" -c 'import dattri_ds.launch' 2>/dev/null; then  # no install: link the mapped folders
  for d in launch selection tools; do
    [[ -e dattri_ds/$d ]] || { ln -s "../$d" "dattri_ds/$d"; LINKS+=("dattri_ds/$d"); }
  done
fi
cleanup() { for l in "${LINKS[@]+"${LINKS[@]}"}"; do rm -f "$l"; done; }
trap cleanup EXIT

rm -rf "$OUT" && mkdir -p "$OUT"
: > "$OUT/steps.tsv"
FAILED=0
step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record status and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS status=ok
  echo "== $name: $*"
  if ! timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then status=FAILED; FAILED=1; fi
  printf '%s\t%s\t%d\n' "$name" "$status" $((SECONDS - t0)) >> "$OUT/steps.tsv"
  tail -n 3 "$OUT/$name.log"
  [[ $status == ok ]] || echo "!! $name FAILED (full log: $OUT/$name.log)" >&2
}

# The CUDA tests; a test that skips on a GPU machine is a failure, not a pass.
GPU_TESTS='set -o pipefail; "$0" -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 |
  tee /dev/stderr | { ! grep -E "^SKIPPED|[0-9]+ skipped"; }'
PEERS=$("$PY" - <<'PYPEERS'
import importlib.util
print(" ".join(n for n, m in (("bergson", "bergson"), ("kronfluence", "kronfluence"),
                              ("dattri", "dattri"), ("logix", "logix"))
               if importlib.util.find_spec(m) is not None))
PYPEERS
)

if [[ $MODE == dry ]]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  step cuda-tests-collected 300 "$PY" -m pytest tests/gpu --collect-only -q -p no:cacheprovider
  # without CUDA the GPU tests skip, so the guard must report a failure here
  step skip-guard-fails-on-cpu 300 bash -c "! bash -c '$GPU_TESTS' '$PY'"
  step throughput 300 "$PY" benchmarks/scale.py throughput --sizes tiny --device cpu \
      --batch 2 --seq-len 64 --reps 1 --out "$OUT"
  step launch-steps 600 "$PY" benchmarks/launch_steps.py --dry-run --out "$OUT"
  step planner-calibration 120 "$PY" benchmarks/calibrate.py
  step planner-refit 120 "$PY" benchmarks/calibrate.py --from "$OUT"
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check: torch sees no CUDA device (torch.cuda.device_count() = 0)" >&2
    exit 2
  fi
  unset DS_ACCELERATOR
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.csv"
  "$PY" -c 'import torch, transformers, deepspeed; print("torch", torch.__version__,
            "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)' \
      | tee "$OUT/versions.txt"
  step cuda-tests 300 bash -c "$GPU_TESTS" "$PY"
  step throughput 180 "$PY" benchmarks/scale.py throughput --sizes "$SIZES" --device cuda \
      --batch 4 --seq-len 512 --reps 3 --out "$OUT"
  step launch-steps 330 "$PY" benchmarks/launch_steps.py --device cuda --out "$OUT"
  step planner-calibration 60 "$PY" benchmarks/calibrate.py
  step planner-refit 60 "$PY" benchmarks/calibrate.py --from "$OUT"  # this run's terms
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
    TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2)
    step nccl-zero3 180 "${TORCHRUN[@]}" "${TRAIN[@]}" --deepspeed_config "$OUT/zero3_bf16.json" \
        --out "$OUT/nccl_zero3"
    step nccl-megatron-tp2 180 "${TORCHRUN[@]}" "${TRAIN[@]}" --backend megatron \
        --tensor-model-parallel-size 2 --deepspeed_config configs/zero1_cpu.json \
        --out "$OUT/nccl_megatron"
  fi
fi
if [[ -n "$PEERS" ]]; then  # the peers' collect on the same machine (their own workload)
  step peers-collect 240 "$PY" benchmarks/peers.py --tasks collect --widths 64 \
      --libs dattri-ds $PEERS --out "$OUT/peers" --json "$OUT/peers.json"
fi

# ---- one table --------------------------------------------------------------------------
"$PY" - "$OUT" "$MODE" "${PEERS:-none}" <<'PYTABLE' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out, mode, peers = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = ["| check | measured | planner | ratio (target) | status |", "|---|---|---|---|---|"]
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, secs = line.split("\t")
    rows.append(f"| step {name} | {secs} s | | | {status} |")
def mark(ratio, target):
    return "ok" if ratio <= target else "MISS"
if (out / "throughput.json").exists():
    for r in json.loads((out / "throughput.json").read_text()):
        sz = f"{r['size']} ({r['params'] / 1e9:.2f}B, B={r['B']} T={r['T']})"
        rows.append(f"| fwd+bwd {sz} | {r['train_s']:.3f} s, MFU {r['mfu']:.2f} | "
                    f"{r['pred_train_s']:.3f} s | | |")
        rows.append(f"| collect {sz} | {r['collect_s']:.3f} s | {r['pred_collect_s']:.3f} s | "
                    f"{r['collect_ratio']:.2f}x fwd+bwd (<= 1.3) | "
                    f"{mark(r['collect_ratio'], 1.3)} |")
if (out / "launch_steps.json").exists():
    rec = json.loads((out / "launch_steps.json").read_text())
    for r in rec["rows"]:
        if "error" in r:
            rows.append(f"| launch {r['variant']} | {r['error'][:60]} | | | FAILED |")
            continue
        tgt = "" if r["target"] is None else f" (<= {r['target']})"
        st = "" if r["target"] is None else mark(r["ratio"], r["target"])
        rows.append(f"| launch {r['variant']} | {r['step_s']:.4f} s/step, {r['ex_s']:.1f} ex/s, "
                    f"MFU {r['mfu']:.3f} | {r['planner_s']:.4f} s | {r['ratio']:.2f} "
                    f"{r['ratio_of']}{tgt} | {st} |")
    rows.append(f"| launch setting | {rec['title'][len('launch steps: '):]} | | | |")
if (out / "peers.json").exists():
    for r in json.loads((out / "peers.json").read_text()):
        if isinstance(r, dict) and r.get("task") == "collect":
            rows.append(f"| peer collect {r.get('lib')} (benchmarks/peers.py workload, "
                        f"width {r.get('width')}) | {r.get('wall_s', '?')} s wall | | | "
                        f"{r.get('status', '?')} |")
else:
    rows.append(f"| peers' collect | not run (installed: {peers}) | | | |")
print(f"gpu_check ({mode}):")
print("\n".join(rows))
PYTABLE
if [[ $FAILED != 0 ]]; then
  echo "gpu_check: FAILED steps above (logs in $OUT/)" >&2
  exit 1
fi
echo "gpu_check: all steps passed"
