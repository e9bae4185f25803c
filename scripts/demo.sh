#!/usr/bin/env bash
# The README's main-job command: install (idempotent) into ./.venv, then train the `tiny` GPT
# on 4 simulated nodes with fault tolerance 1 (two pipeline replicas), printing the loss per step.
# Extra arguments are passed to `elastic run` (e.g. --steps 50 --gpus-per-node 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p runs
exec .venv/bin/elastic run --model tiny --nodes 4 --fault-tolerance 1 --global-batch 16 --microbatch 2 \
    --steps 20 --run-dir runs/demo --summary runs/demo/summary.json --final-state runs/demo/final_state.pt "$@"
