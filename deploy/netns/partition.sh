#!/usr/bin/env bash
# Cut one node of a running deploy/netns/launch.py job off the network, then bring it back.
#
#   deploy/netns/partition.sh [--prefix P] NODE [SECONDS]
#
# Downs the node's host-side veth (found by its alias "elastic-netns P node NODE"), waits
# SECONDS (default 10), and brings it up again; with SECONDS=0 the link stays down until you
# run `ip link set DEV up` yourself (the command is printed). --prefix picks the launch when
# several run at once (launch.py prints its prefix). Needs root. Exit 2 on bad input.
set -euo pipefail

prefix=""
if [[ "${1:-}" == "--prefix" ]]; then
    prefix="${2:?--prefix needs a value}"
    shift 2
fi
node="${1:-}"
seconds="${2:-10}"
if [[ ! "$node" =~ ^[0-9]+$ || ! "$seconds" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "usage: $0 [--prefix P] NODE [SECONDS]" >&2
    exit 2
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "$0: needs root (ip link set)" >&2
    exit 2
fi

# "N: DEV@peer: <...> ... alias elastic-netns P node K" -> DEV, for every matching link.
pattern="elastic-netns ${prefix:-[a-z0-9]+} node ${node}\$"
mapfile -t devs < <(ip -o link show | awk -v pat="$pattern" '
    { line = $0; sub(/.*alias /, "", line) }
    $0 ~ / alias / && line ~ pat { dev = $2; sub(/:$/, "", dev); sub(/@.*/, "", dev); print dev }')
if [[ ${#devs[@]} -eq 0 ]]; then
    echo "$0: no link of node $node found${prefix:+ for prefix $prefix} (is a netns launch running?)" >&2
    exit 2
fi
if [[ ${#devs[@]} -gt 1 ]]; then
    echo "$0: several launches have a node $node (${devs[*]}); pass --prefix" >&2
    exit 2
fi
dev="${devs[0]}"

ip link set "$dev" down
echo "node $node partitioned: $dev down at $(date +%T.%N | cut -c1-12)"
if [[ "$seconds" == 0 || "$seconds" == 0.0 ]]; then
    echo "link stays down; restore with: ip link set $dev up"
    exit 0
fi
trap 'ip link set "$dev" up; echo "node $node: $dev up (interrupted)"' INT TERM
sleep "$seconds"
trap - INT TERM
ip link set "$dev" up
echo "node $node back: $dev up at $(date +%T.%N | cut -c1-12)"
