#!/usr/bin/env bash
# Run the ablation presets (docs/sweeps.md) one after another, then write each one's
# report where docs/results.md reads it:
#
#   scripts/ablations.sh                          # every ablation preset, 3 seeds each
#   scripts/ablations.sh ablation_heads ablation_depth
#   BUDGET=equal_compute scripts/ablations.sh ablation_width   # at equal compute (conf/budget/)
#   MAX_SEEDS=8 scripts/ablations.sh ablation_heads            # seeds until decided (trident.report.adaptive)
#
# Each sweep runs into outputs/ablations/<preset>/ (set ABLATIONS_DIR to change it); its wall time is
# appended to <that dir>/times.txt. After the last sweep, `python -m trident.report` writes report.md,
# the PNG plots and jobs.csv (each job's results and git commit: commit it with the report) into
# docs/results/<preset>/ (<preset>_<budget> for a BUDGET other than steps; REPORTS_DIR moves them).
# The reports come last because they overwrite tracked files: a report written between two sweeps
# would mark every later job's git_dirty. Time a sweep alone: two trainings on one small CPU slow
# each other.
# MAX_SEEDS=N runs `python -m trident.report.adaptive` instead of the preset's fixed seeds: 3 seeds, then one
# more at a time to the settings still undecided against the best, up to N (a sweep over `task`
# has one family per task, which the loop does not split: it keeps its fixed seeds and is refused).
# A sweep with failed jobs still gets its report (the failures are listed in it); the script goes on
# to the next preset and exits with status 1 at the end.
# A preset that fine-tunes a pre-trained run (its pretrained_run) gets one: pre-trained first into
# <out>/<preset>_base with the overrides in `pretrain` below, or reused when it completed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${ABLATIONS_DIR:-outputs/ablations}
reports=${REPORTS_DIR:-docs/results}
# Every preset by default: the files conf/experiment/ablation_*.yaml, the one list of them.
known=$(cd conf/experiment && ls ablation_*.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
known=${known% }
presets=("$@")
if [ ${#presets[@]} -eq 0 ]; then
  read -r -a presets <<< "$known"
fi
# Label smoothing is judged on BLEU and on perplexity (the paper: it hurts perplexity, helps BLEU);
# dropout on the last validation loss first (a fixed budget without early stopping, as Table 3 is),
# then on the early-stopped best one. The first metric listed is the one the adaptive loop decides
# on (default: best/val/loss).
declare -A compare=([ablation_label_smoothing]="best/val/bleu test/bleu test/ppl"
                    [ablation_dropout]="val/loss best/val/loss test/loss")
declare -A pretrain=([ablation_lora_rank]="task=lm model=nano data.block_size=512 data.batch_size=8 trainer.max_steps=1200 trainer.val_check_interval=300")
max_seeds=${MAX_SEEDS:-}
if [ -n "$max_seeds" ] && ! [[ $max_seeds =~ ^[1-9][0-9]*$ ]]; then
  echo "error: MAX_SEEDS=$max_seeds is not a number of seeds: set e.g. MAX_SEEDS=8, or unset it for the presets' seeds" >&2
  exit 2
fi
for preset in "${presets[@]}"; do  # every name checked before any sweep starts
  if [ ! -f "conf/experiment/$preset.yaml" ]; then
    echo "error: no preset conf/experiment/$preset.yaml: choose among $known" >&2
    exit 2
  fi
  # A list of tasks under hydra.sweeper.params (the preset's sweep), not a task key elsewhere.
  if [ -n "$max_seeds" ] && awk '/^ *params:/ {p = 1} p && /^ +task: *[^ ]+,/ {f = 1} END {exit !f}' \
      "conf/experiment/$preset.yaml"; then
    echo "error: $preset sweeps task, whose comparisons MAX_SEEDS cannot add seeds to: run it without MAX_SEEDS" >&2
    exit 2
  fi
done
budget=${BUDGET:-steps}
if [ ! -f "conf/budget/$budget.yaml" ]; then
  echo "error: no budget conf/budget/$budget.yaml: set BUDGET to one of $(cd conf/budget && ls | sed 's/\.yaml$//' | paste -sd, -)" >&2
  exit 2
fi
status=0
mkdir -p "$out"
names=()
for preset in "${presets[@]}"; do
  name=$preset
  [ "$budget" = steps ] || name=${preset}_$budget
  names+=("$name")
  started=$(date +%s)
  base=()
  if [ -n "${pretrain[$preset]:-}" ]; then
    base=("pretrained_run=$out/${preset}_base")
    if ! grep -qs '"status": "completed"' "$out/${preset}_base/status.json"; then
      # shellcheck disable=SC2086  # the overrides split into arguments
      python train.py ${pretrain[$preset]} "hydra.run.dir=$out/${preset}_base" || status=1
    fi
  fi
  if [ -n "$max_seeds" ]; then
    metric=${compare[$preset]:-best/val/loss}
    python -m trident.report.adaptive "experiment=$preset" "budget=$budget" "${base[@]}" --metric "${metric%% *}" \
        --max-seeds "$max_seeds" --sweep-dir "$out/$name" || status=1
  else
    python train.py -m "experiment=$preset" "budget=$budget" "${base[@]}" "hydra.sweep.dir=$out/$name" || status=1
  fi
  echo "$name $(( $(date +%s) - started )) s $(date -u +%Y-%m-%dT%H:%M:%SZ)" | tee -a "$out/times.txt"
done
for i in "${!presets[@]}"; do
  preset=${presets[$i]} name=${names[$i]}
  # shellcheck disable=SC2086  # the metric list splits into arguments
  python -m trident.report "$out/$name" --out "$reports/$name" ${compare[$preset]:+--compare ${compare[$preset]}} || status=1
done
exit $status
