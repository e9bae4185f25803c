"""Closing the connections of a retired generation's gloo groups.

A generation's groups outlive it (the trainer's graveyard): destroying a gloo group with an
abandoned operation pending blocks the destroying thread until the group's timeout. Left open,
though, a retired group can cost CPU for the rest of the run. gloo's TCP loop polls its sockets
level-triggered, and a pair whose queued write or expected read belongs to a buffer that no
longer exists (an operation abandoned when the step was aborted, its tensors freed) never
progresses: each wake-up finds the same socket writable, or the same unread bytes, and returns
at once. Measured in the effective-time benchmark (small model, one spare): one such loop
thread per survivor used ~0.7 s of CPU per second, in the kernel, from the generation that
abandoned the operation on; each loss added more, and the step time grew generation by
generation (2.5 s, then 4.7 s).

gloo has no call that closes a group (`abort` and `shutdown` of a gloo group change nothing
in torch 2.13: a pending all-reduce still waited out its timeout). Its one way is a wait that
times out: gloo then tells every pair of the group's context of the error, which closes each
connection and takes it off the loop, and fails every operation still pending on the group
(the waiter threads of abandoned waits end instead of waiting out the group's timeout). So
closing a retired group posts a receive nobody will send, on a tag no step uses, and waits for
it with a 1 ms timeout.

Only retired groups are closed, and only once every worker of the current generation has left
the older ones: after the current generation's first committed step (a step commits only when
every worker of the generation ran it). A peer that still used a retired group would see its
connection closed.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CLOSE_TAG = 0x7FFF_FF00
"""Tag of the receive that closes a group: no step, transfer or test posts it."""
_CLOSE_WAIT = timedelta(milliseconds=1)


def close_group(group: dist.ProcessGroup | None) -> bool:
    """Close every connection of the retired gloo group `group` (module doc); True when the
    group is closed or has no connection (one member, None, not gloo). Never blocks: a pair whose
    peer died is already closed, and the receive is posted to the next peer then."""
    if group is None or group.size() < 2 or _backend(group) != "gloo":
        return True
    me = group.rank()
    for peer in (r for r in range(group.size()) if r != me):
        try:
            work = group.recv([torch.empty(1)], peer, CLOSE_TAG)
            work.wait(_CLOSE_WAIT)
        except RuntimeError as exc:
            if "Timed out" in str(exc):
                return True  # the timeout closed every pair of the group's context
            continue  # this pair was closed already (its peer died): another one carries it
        log.warning("a retired group answered the closing receive: a peer sent on tag %d", CLOSE_TAG)
        return False
    return True  # every pair was closed already


def _backend(group: dist.ProcessGroup) -> str:
    name = getattr(group, "name", None)
    if callable(name):
        return str(name()).lower().removeprefix("processgroup")
    return "gloo" if isinstance(group, dist.ProcessGroupGloo) else "other"
