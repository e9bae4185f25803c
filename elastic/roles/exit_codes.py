"""How an agent process ends (its exit code), for the launchers that watch it."""

from __future__ import annotations

EXIT_FAILED = 3
"""The node failed (its workers crashed or were killed, it was preempted, etcd stayed out of reach
past the give-up time): the job recovers without it."""
EXIT_REFUSED = 4
"""The job refused the agent (a wrong token, an unknown or finished job)."""
EXIT_FENCED = 5
"""The job fenced this node out while it lived (its lease gone and its place not kept: a partition
that healed, a stall past the leader's probe); its workers were killed before they ran again. Its
next incarnation joins like any new node (`elastic run --rejoin-fenced N` starts it)."""
