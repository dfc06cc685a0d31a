#!/bin/sh
# The node prolog of the test cluster (scripts/slurm_cluster.sh copies it next to slurm.conf):
# submitit makes a job's log directory (.submitit/<job id>/, the --output path) only once sbatch has
# returned the id. A real cluster takes seconds to start a job; that one starts it within
# milliseconds, and slurmd, finding no directory for the job's stdout, kills the job before it runs
# ("Could not open stdout file"; the sweep then waits for a job that is gone). A prolog runs before
# slurmd opens that file: this one waits up to 5 s for the directory (no longer: on a node that only
# runs a step, srun gives up on a launch that takes 10 s). It always exits 0: a failing prolog
# drains the node.
# The record of this job alone (the id of an array's task also lists the array's other records).
out=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep "^JobId=$SLURM_JOB_ID " | tr ' ' '\n' | sed -n 's/^StdOut=//p')
dir=$(dirname "${out:-/}")
case $dir in *%*) exit 0 ;; esac  # a pattern left unexpanded names no directory to wait for
for _ in $(seq 50); do
  [ -d "$dir" ] && exit 0
  sleep 0.1
done
exit 0
