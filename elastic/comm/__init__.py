"""Communicators that keep NCCL's rules, the recording group, and the model that checks them.

`communicator.py`: one real process group of one generation (gloo on CPU, NCCL on CUDA),
created eagerly, posting point-to-point operations as groups, abortable; `record.py`: the
per-worker log of everything posted; `nccl_model.py`: NCCL's rules replayed over the logs of
every worker, which finds deadlocks on CPU; `device.py`: the calling thread's device.
Imports nothing of the project (layer 0 beside `templates`).
"""

from elastic.comm.communicator import (
    NCCL_ENV,
    P2P,
    CommAborted,
    Communicator,
    Handle,
    apply_nccl_env,
    open_communicator,
)
from elastic.comm.record import Event, Op, Recorder, current_lane, lane_as

__all__ = [
    "NCCL_ENV",
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
    "open_communicator",
]
