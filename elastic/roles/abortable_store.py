"""The store of a generation's rendezvous: etcd's, with blocking waits that end once the
generation is aborted, so a rendezvous with a peer that died during the reconfiguration does not
wait out the store timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.store import EtcdStore
from elastic.coordinator.store_relay import StoreRelayClient
from elastic.parallel.abort import AbortSignal

_STORE_SLICE_S = 0.2
"""How long one wait on the store lasts between two looks at the abort flag."""


class AbortableStore(EtcdStore):
    """The generation's etcd Store, whose blocking waits end as soon as the generation is
    aborted: a rendezvous with a peer that died during the reconfiguration does not wait out
    the store timeout."""

    def __init__(self, client: EtcdClient, prefix: str, *, timeout: timedelta, abort: AbortSignal,
                 relay: StoreRelayClient | None = None) -> None:
        super().__init__(client, prefix, timeout=timeout, relay=relay)
        self._abort = abort

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout).total_seconds()
        while True:
            if self._abort.is_set():
                raise dist.DistStoreError(f"rendezvous abandoned: {self._abort.reason}")
            remaining = max(0.0, deadline - time.monotonic())
            try:
                super().wait(keys, timedelta(seconds=min(_STORE_SLICE_S, remaining)))
                return
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    raise
