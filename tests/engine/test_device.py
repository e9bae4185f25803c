"""Device selection: one accelerator per worker of every simulated node on a host (row 7 of issue
31: every node's local rank 0 landed on cuda:0), the launcher's per-node base, clear errors; the
wire and compute dtypes. No GPU here: the CUDA runtime's two answers are faked (a pure unit)."""

from __future__ import annotations

import pytest
import torch

from elastic.engine import device as device_module
from elastic.engine.device import compute_precision, select_device, wire_dtype
from elastic.records.job import DEVICE_BASE_ENV
from elastic.roles.static_launcher import device_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_module.torch.cuda, "device_count", lambda: 4)


def test_every_worker_of_every_local_node_gets_its_own_device(four_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    for node in range(2):
        for local_rank in range(2):
            monkeypatch.setenv(DEVICE_BASE_ENV, device_env(node, 2)[DEVICE_BASE_ENV])
            seen.append(select_device(local_rank, want="cuda"))
    assert seen == [torch.device("cuda", i) for i in range(4)]
    assert select_device(1, want="auto", base=2) == torch.device("cuda", 3)
    assert select_device(3, want="cpu") == torch.device("cpu")


def test_too_few_devices_or_a_bad_base_is_a_clear_error(four_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_BASE_ENV, "4")
    with pytest.raises(ValueError, match="needs device 5, but this host has 4"):
        select_device(1, want="cuda")
    monkeypatch.setenv(DEVICE_BASE_ENV, "two")
    with pytest.raises(ValueError, match=f"{DEVICE_BASE_ENV} must be a device index"):
        select_device(0, want="cuda")


def test_without_an_accelerator() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert select_device(0) == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        select_device(0, want="cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        select_device(0, want="tpu")


def test_precision_policy() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert wire_dtype(cpu) == torch.float32 and wire_dtype(gpu) == torch.bfloat16
    with compute_precision(cpu):
        assert not torch.is_autocast_enabled("cpu")
