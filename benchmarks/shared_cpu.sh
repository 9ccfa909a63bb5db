#!/usr/bin/env bash
# Two CPU trainings on one machine at once, against one alone, under the OpenMP settings given in the environment.
# OpenMP threads spin while they wait; two processes that each own every core then starve each other.
#   benchmarks/shared_cpu.sh DATASET_DIR                        # default settings
#   OMP_WAIT_POLICY=passive benchmarks/shared_cpu.sh DATASET_DIR
#   OMP_NUM_THREADS=1 benchmarks/shared_cpu.sh DATASET_DIR
# DATASET_DIR: e.g. outputs/demo/data after `make demo`. Prints wall seconds and the ratio, measured in this run;
# without OMP_WAIT_POLICY set, also one training alone under OMP_WAIT_POLICY=passive against the defaults.
set -euo pipefail
data=${1:?usage: benchmarks/shared_cpu.sh DATASET_DIR}
steps=${STEPS:-60}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
train() { .venv/bin/roboscale train --dataset.root="$data" --output_dir="$out/$1" --steps="$steps" --save_freq=100000 \
            > "$out/$1.log" 2>&1; }
start=$(date +%s.%N); train alone; alone=$(echo "$(date +%s.%N) - $start" | bc)
start=$(date +%s.%N); train a & train b & wait; both=$(echo "$(date +%s.%N) - $start" | bc)
echo "OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-}: one training ${alone}s, two at once" \
     "${both}s, ratio $(echo "scale=2; $both / $alone" | bc) (2.0 = a fair share of the cores)"
if [ -z "${OMP_WAIT_POLICY:-}" ]; then  # what passive waiting costs a training that has the machine to itself
  start=$(date +%s.%N); OMP_WAIT_POLICY=passive train alone_passive; passive=$(echo "$(date +%s.%N) - $start" | bc)
  echo "one training alone: ${alone}s with the defaults, ${passive}s with OMP_WAIT_POLICY=passive," \
       "ratio $(echo "scale=2; $passive / $alone" | bc)"
fi
