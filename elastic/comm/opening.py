"""Making a communicator: a real `dist.ProcessGroup` with its backend, built the way torch's own
`distributed_c10d._new_process_group_helper` builds one, without the default group.

A live process cannot re-create torch's default group for a later generation, so the public way
(`new_group`) is closed to this project; it makes the group itself, in torch's order:

1. `ProcessGroup(store, rank, size)`, then its default backend type;
2. NCCL: the bound device (`bound_device_id`), before the backend exists: `setBackend` copies the
   group's bound device into the backend at registration, and a backend registered before it
   has none (no eager connect, no split, nothing derived from the device);
3. the backend (options: timeout, the members' world ranks, the group's name; NCCL: blocking or
   not, low-priority streams) and `_register_backend`;
4. the group's name and description (`_set_group_name`, `_set_group_desc`): NCCL's logs, watchdog
   and flight recorder then tell every generation's groups apart;
5. NCCL: the communicator connected at once (`eager_connect_single_device`).

`tests/comm/test_opening.py` records these calls on a fake of the process-group API and holds
their order to the order in torch's helper, read from the installed torch.

Blocking or non-blocking NCCL communicators (`$ELASTIC_NCCL_NONBLOCKING`, default 0: blocking).
Blocking is the default because it is the combination torch itself runs (lazy or eager) and the
one torchft settled on: a non-blocking communicator connected eagerly starts an asynchronous
init that nothing in Python can wait for, and a first operation posted before it ends fails
("NCCL Error 7: operation in progress", torchft#320, pytorch#153960). Non-blocking
(`ELASTIC_NCCL_NONBLOCKING=1`) is kept for the first GPU runs to compare (`bench/nccl_smoke.py`):
there the communicator is not connected eagerly; a one-element all-reduce, waited for on the
host, connects it inside `open_communicator`, so creation stays one blocking rendezvous of the
members and no later operation meets a communicator still initialising. An abort does not hang
the caller in either mode: `Communicator.abort` runs the backend's abort on a thread of its own.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm.communicator import Communicator
from elastic.comm.device import to_host
from elastic.comm.record import Recorder

NONBLOCKING_ENV = "ELASTIC_NCCL_NONBLOCKING"
"""`1`: NCCL communicators are created non-blocking (module doc); `0` (default): blocking."""

NCCL_ENV: dict[str, str] = {
    # On a collective's timeout the watchdog aborts the communicators and does not kill the
    # process (the default tears the process down: one lost peer would end every survivor).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor kills a process whose watchdog seems stuck (an abort in progress).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # No flight-recorder dump to disk when an abandoned operation times out.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # `wait()` stays a stream wait: a host wait is done abortably by the caller.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}
"""The NCCL watchdog settings of a worker: explicit, so that no survivor is killed by the watchdog
when a peer fails (values set in the environment win). `TORCH_NCCL_USE_COMM_NONBLOCKING` follows
`$ELASTIC_NCCL_NONBLOCKING` (`apply_nccl_env`); the options of every group say it too."""


def nccl_nonblocking() -> bool:
    """Whether NCCL communicators are created non-blocking ($ELASTIC_NCCL_NONBLOCKING; module doc)."""
    value = os.environ.get(NONBLOCKING_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"${NONBLOCKING_ENV} is 0 (blocking NCCL communicators, the default) or 1, got {value!r}")
    return value == "1"


def apply_nccl_env() -> None:
    """Set NCCL_ENV, and TORCH_NCCL_USE_COMM_NONBLOCKING by the mode, in this process's
    environment (a value already set is kept). torch reads these when a NCCL process group is
    constructed: call before the first one."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1" if nccl_nonblocking() else "0")


def group_desc(name: str, members: Sequence[int]) -> str:
    """The description a group carries into torch's and NCCL's logs."""
    shown = ", ".join(map(str, members[:8])) + (", ..." if len(members) > 8 else "")
    return f"elastic {name} ({len(members)} ranks: {shown})"


def open_communicator(
    store: dist.Store, *, name: str, members: Sequence[int], rank: int, backend: str, device: torch.device,
    timeout: timedelta, recorder: Recorder | None = None, api: types.ModuleType | Any = dist,
) -> Communicator:
    """Create communicator `name` of `members` (world ranks, by group rank) as group rank `rank`,
    on `store` (a prefix of its own): a rendezvous of every member (blocks until all joined).

    The result is a real `dist.ProcessGroup` with the backend registered for `device`, made as
    torch's helper makes one (module doc). NCCL: bound to `device` and connected at once
    (blocking mode) or by a first all-reduce (non-blocking), so no later operation creates a
    communicator. gloo connects each pair at creation, or on first use with
    TORCH_GLOO_LAZY_INIT=1. `api`: where the process-group classes come from (`torch.distributed`;
    a test passes a recording fake).
    """
    size = len(members)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside communicator {name} of {size} members")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")
    nonblocking = nccl_nonblocking()
    group = api.ProcessGroup(store, rank, size)
    if backend == "gloo":
        kind = api.ProcessGroup.BackendType.GLOO
        group._set_default_backend(kind)
        native = api.ProcessGroupGloo(store, rank, size, timeout)
        native.options.global_ranks_in_group = list(members)
        native.options.group_name = name
    else:
        apply_nccl_env()
        kind = api.ProcessGroup.BackendType.NCCL
        group._set_default_backend(kind)
        group.bound_device_id = device  # before the backend: registration copies it (module doc)
        native = api.ProcessGroupNCCL(store, rank, size, _nccl_options(api, name, members, timeout, nonblocking))
    group._register_backend(device, kind, native)
    group._set_group_name(name)
    group._set_group_desc(group_desc(name, members))
    comm = Communicator(group, name=name, members=members, backend=backend, device=device, recorder=recorder,
                        native=native, eager=not nonblocking, abort_join_s=timeout.total_seconds())
    if backend == "nccl":
        _connect(group, native, device, nonblocking)
    return comm


def _nccl_options(api: Any, name: str, members: Sequence[int], timeout: timedelta, nonblocking: bool) -> Any:
    """ProcessGroupNCCL's options as torch's helper fills them, with the mode (module doc)."""
    options = api.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False  # a side stream of high priority is never one of NCCL's (device.py)
    options._timeout = timeout  # the constructor takes the timeout only through Options
    options.config.blocking = 0 if nonblocking else 1  # explicit: wins over TORCH_NCCL_USE_COMM_NONBLOCKING
    options.global_ranks_in_group = list(members)
    options.group_name = name
    return options


def _connect(group: Any, native: Any, device: torch.device, nonblocking: bool) -> None:
    """Connect a NCCL communicator now, as one blocking rendezvous of its members (module doc)."""
    if not nonblocking:
        native.eager_connect_single_device(device)
        return
    probe = torch.zeros(1, device=device)
    group.allreduce([probe]).wait()
    _, ready = to_host(probe)
    while not ready():  # the host waits for the init and the all-reduce behind it
        time.sleep(0.0005)
