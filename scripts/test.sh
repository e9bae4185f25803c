#!/usr/bin/env bash
# The README's test command: install (idempotent) into ./.venv, lint, type-check, run the suite.
#
# With no arguments the suite runs as two pytest sessions at once (tests/conftest.py, LANE_ENV):
# the live lane (jobs, etcd, leases, timed faults) in the foreground at normal priority, and the
# background lane (compute-only modules and pure units, no deadline near their timeouts) under
# `nice`, beside mypy: they use the core that the live tests leave idle (the live lane alone keeps
# about one of two cores busy) and yield it whenever a live test wants it. Their output follows the
# live lane's, each with its slowest tests (--durations: where the suite's time goes). With
# arguments (or ELASTIC_TEST_SERIAL=1), mypy and then one pytest session with those arguments, as
# before.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_test_system.sh
.venv/bin/ruff check elastic templates tests bench deploy
if [ "$#" -gt 0 ] || [ "${ELASTIC_TEST_SERIAL:-0}" = 1 ]; then
    .venv/bin/mypy
    exec .venv/bin/python -m pytest "$@"
fi
logs=$(mktemp -d)
nice -n 19 .venv/bin/mypy >"$logs/mypy" 2>&1 &
mypy_pid=$!
# The background lane as one pytest session per folder, one after another: in-process gloo
# groups that its modules leave behind (tests/comm/test_slice_owners.py alone leaves 142 gloo
# loop threads) end with their session, instead of piling up in one process for the whole run
# (772 threads on 2026-12-06, up to 335 of them runnable at once beside the live lane's jobs,
# whose etcd then stopped answering for a minute or more).
background_lane() {
    set +e  # a failing session must not end the others (errexit is on here)
    local rc=0 part
    for part in tests/*/ tests; do  # every folder, so that a new one is not left out
        local only=()
        [ "$part" = tests ] && only=(--ignore-glob='tests/*/*')  # last: the modules at the top of tests/
        ELASTIC_TEST_LANE=background nice -n 10 .venv/bin/python -m pytest -p no:cacheprovider --durations=15 \
            "$part" "${only[@]}"
        case $? in 0|5) ;; *) rc=1 ;; esac  # 5: no background test in that folder
    done
    return $rc
}
background_lane >"$logs/background" 2>&1 &
background_pid=$!
stop_lanes() {
    pkill -INT -P "$background_pid" 2>/dev/null || true  # the running session
    kill "$background_pid" 2>/dev/null || true  # the loop: no further session (it ignores SIGINT, started with &)
    kill "$mypy_pid" 2>/dev/null || true
}
trap 'stop_lanes; exit 130' INT
trap 'stop_lanes; exit 143' TERM
set +e
ELASTIC_TEST_LANE=live .venv/bin/python -m pytest --durations=25
live_rc=$?
wait "$background_pid"
background_rc=$?
wait "$mypy_pid"
mypy_rc=$?
set -e
echo "---- background lane (ELASTIC_TEST_LANE=background, nice 10): exit $background_rc ----"
cat "$logs/background"
echo "---- mypy (nice 19): exit $mypy_rc ----"
cat "$logs/mypy"
rm -rf "$logs"
echo "test.sh: live lane exit $live_rc, background lane exit $background_rc, mypy exit $mypy_rc"
if [ "$live_rc" -ne 0 ] || [ "$background_rc" -ne 0 ] || [ "$mypy_rc" -ne 0 ]; then
    exit 1
fi
