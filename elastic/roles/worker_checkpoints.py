"""An elastic worker's checkpoints (`--checkpoint-every`): the shards it writes at each due step
(`checkpoint_writer_shards`: one writer a shard; with the optimizer sharded, the heads of those
and the slices it writes: elastic/engine/optim_checkpoint.py), through a writer thread that saves while
training goes on, and the report of a save that failed (a full or failing disk): an event and the
worker's `checkpoint-failures/` record (elastic/records/checkpoint_failures.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.keys import JobKeys
from elastic.parallel.layout import ParallelLayout
from elastic.records.checkpoint_failures import SaveFailures, save_failures_key
from elastic.records.config import ElasticConfig
from elastic.roles.worker_log import worker_log

if TYPE_CHECKING:
    from elastic.engine.trainer import Trainer


SLOW_DISK_S = 1.0
"""A save that waited this long for the writer (elastic/engine/checkpoint/writers.py) is logged."""


class WorkerCheckpoints:
    """This worker's checkpoint writer and the count of its failed saves (module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, config: ElasticConfig, *, node: int, local_rank: int,
                 incarnation: int) -> None:
        from elastic.engine.checkpoint.writers import CheckpointWriter

        self.client, self.keys, self.every = client, keys, config.checkpoint_every
        self.node, self.local_rank, self.incarnation = node, local_rank, incarnation
        cfg = config.spec.model_config
        self.writer = CheckpointWriter(
            Path(config.checkpoint_path),
            num_layers=cfg.num_layers,
            tp_degree=config.spec.plan.gpus_per_node,
        )
        self.writer.warm()  # its thread imports torch.distributed.checkpoint while we register
        self._save_failures = 0
        """Checkpoint saves of this worker that failed so far (`report_failures`)."""

    def after_commit(self, trainer: Trainer, layout: ParallelLayout) -> None:
        """After a committed step: report failed saves, and queue this worker's shards when the
        step is due."""
        self.report_failures()
        if trainer.step % self.every:
            return
        self.save(trainer, layout)

    def save(self, trainer: Trainer, layout: ParallelLayout) -> None:
        """Queue this worker's checkpoint shards of the committed step (`checkpoint_writer_shards`)."""
        from elastic.engine.checkpoint.policy import checkpoint_writer_shards

        parts = trainer.checkpoint_parts(checkpoint_writer_shards(layout))  # sharded: my heads and slices
        if parts:
            waited = self.writer.save_parts(trainer.step, parts)
            if waited >= SLOW_DISK_S:
                worker_log(f"checkpoint of step {trainer.step} waited {waited:.1f} s for the writer to start on the one "
                           f"before: the disk is slower than --checkpoint-every {self.every} steps of training")

    def flush(self) -> None:
        """Wait until every queued save is on disk (or has failed)."""
        self.writer.flush()

    def report_failures(self) -> None:
        """Report each checkpoint save that failed (a full or failing disk) once: an event and
        this worker's `checkpoint-failures/` record. Training goes on; the failed step left no
        marker, so a fallback takes the last complete checkpoint (records/checkpoint_failures.py)."""
        for failed in self.writer.take_failures():
            self._save_failures += 1
            worker_log(f"checkpoint of step {failed.step} not saved, training goes on: {failed.reason}")
            record = SaveFailures(node=self.node, local_rank=self.local_rank, incarnation=self.incarnation,
                                  count=self._save_failures, last_step=failed.step, last_reason=failed.reason,
                                  last_at=time.time())
            key = save_failures_key(self.keys, self.node, self.local_rank, self.incarnation)
            try:
                self.client.put(key, record.to_json())
                record_event(self.client, self.keys, who=f"node{self.node}/{self.local_rank}",
                             kind="checkpoint-failed", node=self.node, local_rank=self.local_rank,
                             step=failed.step, reason=failed.reason)
            except Exception as exc:  # etcd unreachable: the report is lost, training is not
                worker_log(f"could not report the failed checkpoint of step {failed.step}: {exc}")
