#!/usr/bin/env bash
# Run the ablation presets (README, "Sweeps and ablations") one after another and write each one's
# report where docs/results.md reads it:
#
#   scripts/ablations.sh                          # every ablation preset, 3 seeds each
#   scripts/ablations.sh ablation_heads ablation_depth
#   BUDGET=equal_compute scripts/ablations.sh ablation_width   # at equal compute (conf/budget/)
#
# Each sweep runs into outputs/ablations/<preset>/ (set ABLATIONS_DIR to change it); its wall time is
# appended to <that dir>/times.txt; `python -m trident.report` then writes report.md, the PNG plots
# and jobs.csv (each job's results and git commit: commit it with the report) into
# docs/results/<preset>/ (<preset>_<budget> for a BUDGET other than steps). Time a sweep alone: two
# trainings on one small CPU slow each other.
# A sweep with failed jobs still gets its report (the failures are listed in it); the script goes on
# to the next preset and exits with status 1 at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${ABLATIONS_DIR:-outputs/ablations}
# Every preset by default: the files conf/experiment/ablation_*.yaml, the one list of them.
known=$(cd conf/experiment && ls ablation_*.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
known=${known% }
presets=("$@")
if [ ${#presets[@]} -eq 0 ]; then
  read -r -a presets <<< "$known"
fi
# Label smoothing is judged on BLEU and on perplexity (the paper: it hurts perplexity, helps BLEU);
# dropout on the last validation loss too (a fixed budget), not only the early-stopped best one.
declare -A compare=([ablation_label_smoothing]="best/val/bleu test/bleu test/ppl"
                    [ablation_dropout]="best/val/loss val/loss test/loss")
for preset in "${presets[@]}"; do  # every name checked before any sweep starts
  if [ ! -f "conf/experiment/$preset.yaml" ]; then
    echo "error: no preset conf/experiment/$preset.yaml: choose among $known" >&2
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
for preset in "${presets[@]}"; do
  name=$preset
  [ "$budget" = steps ] || name=${preset}_$budget
  started=$(date +%s)
  python train.py -m "experiment=$preset" "budget=$budget" "hydra.sweep.dir=$out/$name" || status=1
  echo "$name $(( $(date +%s) - started )) s $(date -u +%Y-%m-%dT%H:%M:%SZ)" | tee -a "$out/times.txt"
  # shellcheck disable=SC2086  # the metric list splits into arguments
  python -m trident.report "$out/$name" --out "docs/results/$name" ${compare[$preset]:+--compare ${compare[$preset]}} || status=1
done
exit $status
