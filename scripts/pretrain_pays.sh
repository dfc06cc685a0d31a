#!/usr/bin/env bash
# Does pre-training pay? (docs/sweeps.md): pre-train once, then fine-tune from
# scratch and from the pre-trained run, seeds 1, 2, 3, and write the report:
#
#   scripts/pretrain_pays.sh text      # task=mlm on Shakespeare, then experiment=pretrain_pays_text
#   scripts/pretrain_pays.sh vision    # experiment=vit_mnist, then experiment=pretrain_pays_vision
#   scripts/pretrain_pays.sh vision trainer.max_steps=2   # further overrides go to every run
#
# The pre-trained run goes to $PRETRAIN_PAYS_DIR/<mlm_shakespeare|vit_mnist> (default
# outputs/pretrain_pays) and is reused when it completed; the sweep goes to
# $PRETRAIN_PAYS_DIR/pretrain_pays_<kind>, its report and plots to $PRETRAIN_PAYS_REPORTS/pretrain_pays_<kind>
# (default docs/results). Each step's wall time is appended to $PRETRAIN_PAYS_DIR/times.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${PRETRAIN_PAYS_DIR:-outputs/pretrain_pays}
reports=${PRETRAIN_PAYS_REPORTS:-docs/results}
kind=${1:-}
shift || true
case $kind in
  text) source_name=mlm_shakespeare; pretrain=(task=mlm model=nano trainer.max_steps=2000 trainer.val_check_interval=500) ;;
  vision) source_name=vit_mnist; pretrain=(experiment=vit_mnist) ;;
  *) echo "error: unknown kind '$kind': run scripts/pretrain_pays.sh text or scripts/pretrain_pays.sh vision" >&2; exit 2 ;;
esac
source_run=$out/$source_name
preset=pretrain_pays_$kind
if [ -e "$out/$preset" ]; then  # a new sweep into an old one would mix their jobs in the report
  echo "error: $out/$preset holds an earlier sweep: move or delete it, or set PRETRAIN_PAYS_DIR" >&2
  exit 2
fi
mkdir -p "$out"

timed() {  # timed <label> <command...>: run it, then append its wall time to times.txt
  local label=$1 started
  shift
  started=$(date +%s)
  "$@"
  local status=$?
  echo "$label $(( $(date +%s) - started )) s $(date -u +%Y-%m-%dT%H:%M:%SZ)" | tee -a "$out/times.txt"
  return $status
}

if grep -qs '"status": "completed"' "$source_run/status.json"; then
  echo "pre-trained run $source_run completed before: reused" >&2
elif [ -e "$source_run" ]; then
  echo "error: $source_run holds an unfinished pre-training: resume it (python train.py resume=$source_run) or delete it" >&2
  exit 2
else
  timed "$source_name" python train.py "${pretrain[@]}" "$@" "hydra.run.dir=$source_run" || exit $?
fi
# A sweep with failed jobs still gets its report (it lists them) and the script exits with status 1;
# a command line that does not fit the config (status 2) runs no job and writes no report.
timed "$preset" python train.py -m "experiment=$preset" "pretrained_run=$source_run" "$@" "hydra.sweep.dir=$out/$preset"
status=$?
[ $status -eq 2 ] && exit 2
python -m trident.report "$out/$preset" --out "$reports/$preset" --compare best/val/acc test/acc || status=1
exit $status
