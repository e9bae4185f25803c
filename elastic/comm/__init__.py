"""Communicators that keep NCCL's rules, the recording group, and the model that checks them.

`communicator.py`: one real process group of one generation (gloo on CPU, NCCL on CUDA),
posting point-to-point operations as groups, abortable; `opening.py`: making one, in torch's own
order, connected at creation; `record.py`: the per-worker log of everything posted;
`nccl_model.py`: NCCL's rules replayed over the logs of every worker, which finds deadlocks on
CPU; `device.py`: the calling thread's device.
Imports nothing of the project (layer 0 beside `templates`).
"""

from elastic.comm.communicator import P2P, CommAborted, Communicator, Handle
from elastic.comm.opening import (
    NCCL_ENV,
    NONBLOCKING_ENV,
    apply_nccl_env,
    nccl_nonblocking,
    open_communicator,
)
from elastic.comm.record import Event, Op, Recorder, current_lane, lane_as

__all__ = [
    "NCCL_ENV",
    "NONBLOCKING_ENV",
    "P2P",
    "CommAborted",
    "Communicator",
    "Event",
    "Handle",
    "Op",
    "Recorder",
    "apply_nccl_env",
    "current_lane",
    "lane_as",
    "nccl_nonblocking",
    "open_communicator",
]
