#!/usr/bin/env bash
# Test-only system packages (scripts/test.sh runs this; the demo does not need them).
set -euo pipefail
# tests/deploy/test_slurm.py runs Debian's SLURM and munge daemons: as root on a machine with
# apt-get, install them once when missing (nothing happens when they are there, or not as root).
# A failed install only warns: that test then fails naming what is missing.
slurm_packages=(slurmctld slurmd slurm-client munge)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    for program in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch /usr/sbin/munged; do
        if [ ! -x "$program" ]; then
            export DEBIAN_FRONTEND=noninteractive
            apt-get install -y -q "${slurm_packages[@]}" >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${slurm_packages[@]}" >/dev/null 2>&1; } \
                || echo "install_test_system.sh: could not apt-get install ${slurm_packages[*]} (tests/deploy/test_slurm.py needs them)" >&2
            break
        fi
    done
fi
# tests/faults/test_etcd_stall.py's slow-disk case (soak) delays etcd's fdatasync with strace's
# fault injection (issue 56); it skips, naming strace, where it is missing.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v strace >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q strace >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q strace >/dev/null 2>&1; } \
        || echo "install_test_system.sh: could not apt-get install strace (the slow-disk soak test needs it)" >&2
fi
