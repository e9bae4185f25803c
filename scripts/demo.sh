#!/usr/bin/env bash
# The README's main-job command: install (idempotent) into ./.venv, then train the `tiny` GPT on
# 5 simulated nodes with fault tolerance 1 under the control plane (embedded etcd, one agent per
# node). A small nominal device memory makes the planner cut the model into multi-stage pipelines
# (3 + 2 stages). At step 8 node 2's workers are SIGKILLed: the survivors abandon the step, the
# leader re-plans, node 0 and 1 fetch the layers they now need from live holders over gRPC, and
# the step is replayed; the run prints the failure, the recovery (seconds per phase, bytes moved)
# and ends with the same result as a failure-free run.
# Extra arguments are passed to `elastic run` (e.g. --steps 50, another --inject hang:node=4,step=14).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p runs
exec .venv/bin/elastic run --model tiny --nodes 5 --fault-tolerance 1 --global-batch 16 --microbatch 2 \
    --device-memory-gib 0.023 --steps 20 --inject kill:node=2,step=8 \
    --run-dir runs/demo --summary runs/demo/summary.json --final-state runs/demo/final_state.pt "$@"
