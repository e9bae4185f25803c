#!/usr/bin/env bash
# One GPU, measured: the plain training loop's tokens/s and MFU, the engine's on one worker
# (--static and under the control plane) as ratios of it, peak memory against the planner's
# estimate; exits non-zero when a figure misses its target. The work is bench/gpu_check.py's
# (its --help lists every flag); this wrapper runs it from the repository root with the
# repository on PYTHONPATH, so it needs no install: `python -m elastic.cli.main` runs the engine.
#
#   bash bench/gpu_check.sh                                       # gpt2-124m, bf16, on the GPU
#   bash bench/gpu_check.sh --model gpt3-350m --microbatch 4 --global-batch 16 --profile-trace "$OUT/trace"
#   bash bench/gpu_check.sh --device cpu --model tiny --steps 8   # CI (tests/bench/test_gpu_session.py, through gpu_session.sh --cpu)
#
# The interpreter: $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.gpu_check "$@"
