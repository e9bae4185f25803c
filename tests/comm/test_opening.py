"""How a communicator is made (elastic/comm/opening.py): the calls that build a NCCL group come in
the order of torch's own `_new_process_group_helper` (read from the installed torch's source, on
a recording fake of the process-group API: this machine's torch has no NCCL), in both modes, with
the options torch's helper sets; a real gloo group carries its name and description; a bad mode
is refused with a clear error."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastic.comm import NONBLOCKING_ENV, Recorder, nccl_nonblocking, open_communicator
from elastic.comm.opening import group_desc
from tests.comm.support import gloo_comms

pytestmark = pytest.mark.timeout(60)

MARKERS = {
    "ProcessGroup(": "ProcessGroup",
    "_set_default_backend(": "_set_default_backend",
    "bound_device_id = ": "bound_device_id",
    "ProcessGroupNCCL(": "ProcessGroupNCCL",
    "_register_backend(": "_register_backend",
    "_set_group_name(": "_set_group_name",
    "_set_group_desc(": "_set_group_desc",
    "eager_connect_single_device(": "eager_connect_single_device",
}
"""What marks each call in torch's helper -> the name the fake records it under."""


def torch_order() -> list[str]:
    """The calls of MARKERS in the order of their first appearance in torch's helper."""
    source = inspect.getsource(c10d._new_process_group_helper)
    found = {name: source.find(marker) for marker, name in MARKERS.items()}
    missing = [name for name, at in found.items() if at < 0]
    assert not missing, f"torch's _new_process_group_helper no longer makes these calls: {missing}"
    return sorted(found, key=found.__getitem__)


class _Fake:
    """A process-group API (`torch.distributed`'s classes) that records every call made on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.options: Any = None
        api = self

        class Options:
            def __init__(self) -> None:
                self.config = type("NCCLConfig", (), {"blocking": -1})()
                api.options = self

        class ProcessGroupNCCL:
            def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
                api.calls.append("ProcessGroupNCCL")
                assert options is api.options

            def eager_connect_single_device(self, device: torch.device) -> None:
                api.calls.append("eager_connect_single_device")

        ProcessGroupNCCL.Options = Options  # type: ignore[attr-defined]

        class ProcessGroup:
            BackendType = dist.ProcessGroup.BackendType

            def __init__(self, store: Any, rank: int, size: int) -> None:
                api.calls.append("ProcessGroup")
                self._rank, self._size = rank, size

            def __setattr__(self, key: str, value: Any) -> None:
                if key == "bound_device_id":
                    api.calls.append("bound_device_id")
                object.__setattr__(self, key, value)

            def __getattr__(self, name: str) -> Any:
                return lambda *args: api.calls.append(name)  # _set_default_backend, _register_backend, ...

            def rank(self) -> int:
                return int(self._rank)

            def size(self) -> int:
                return int(self._size)

            def allreduce(self, tensors: list[torch.Tensor]) -> Any:
                api.calls.append("allreduce")
                return type("Work", (), {"wait": lambda self: True})()

        self.ProcessGroup = ProcessGroup
        self.ProcessGroupNCCL = ProcessGroupNCCL


def _open_fake(recorder: Recorder | None = None) -> _Fake:
    fake = _Fake()
    open_communicator(dist.HashStore(), name="g3/1-5", members=[1, 5], rank=1, backend="nccl",
                      device=torch.device("cpu"), timeout=timedelta(seconds=42), recorder=recorder, api=fake)
    return fake


@pytest.mark.parametrize("nonblocking", ["0", "1"])
def test_a_nccl_group_is_made_in_torchs_order(nonblocking: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NONBLOCKING_ENV, nonblocking)
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING", raising=False)
    recorder = Recorder(rank=5)
    fake = _open_fake(recorder)
    made = [c for c in fake.calls if c in MARKERS.values()]
    want = torch_order()
    if nonblocking == "1":  # connected by a first all-reduce, after everything torch's helper does
        want.remove("eager_connect_single_device")
        assert fake.calls[-1] == "allreduce", fake.calls
    assert made == want, f"made {made}; torch's helper: {want}"
    options = fake.options
    assert options.config.blocking == (0 if nonblocking == "1" else 1)
    assert (options.is_high_priority_stream, options._timeout) == (False, timedelta(seconds=42))
    assert (options.group_name, options.global_ranks_in_group) == ("g3/1-5", [1, 5])
    created = [e for e in recorder.snapshot() if e.kind == "create"]
    assert [(e.comm, e.eager) for e in created] == [("g3/1-5", nonblocking == "0")]


def test_a_gloo_group_carries_its_name_and_description() -> None:
    comms = gloo_comms(2, name="g7/world")
    for comm in comms:
        assert (comm.group.group_name, comm.group.group_desc) == ("g7/world", group_desc("g7/world", [0, 1]))
        assert comm.group.bound_device_id is None  # only NCCL's groups are bound
        comm.shutdown()


def test_a_bad_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NONBLOCKING_ENV, "yes")
    with pytest.raises(ValueError, match=NONBLOCKING_ENV):
        nccl_nonblocking()
    with pytest.raises(ValueError, match=NONBLOCKING_ENV):
        _open_fake()
