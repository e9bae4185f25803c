"""Periodic blocking checkpoints since a (re)start, at a pace that may change on the way.

The run alternates K steps of training and one blocking checkpoint write of `write_s`. K is
fixed at the restart (the job checkpoints every K steps); a slow node changes only how long a
step takes. A change of pace keeps the place in the current cycle (the fraction of the
training block done, or the seconds of the write done) and goes on at the new pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.sim.result import whole_steps


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where a run stands `elapsed` seconds after it (re)started, under periodic checkpoints.

    The run alternates K steps of training and one blocking checkpoint write of `write_s`.
    """

    steps_run: int
    """Steps completed."""
    steps_saved: int
    """Steps covered by the last completed checkpoint."""
    training_s: float
    """Seconds spent computing."""
    writing_s: float
    """Seconds spent writing checkpoints (a write cut short included)."""

    @classmethod
    def after(cls, elapsed: float, *, iteration_s: float, every_steps: int, write_s: float) -> Progress:
        train_block = every_steps * iteration_s
        cycle = train_block + write_s
        full = int(math.floor(elapsed / cycle + 1e-12)) if elapsed > 0 else 0
        rem = max(0.0, elapsed - full * cycle)
        running = min(rem, train_block)
        return cls(
            steps_run=full * every_steps + min(every_steps, whole_steps(running, iteration_s)),
            steps_saved=full * every_steps,
            training_s=full * train_block + running,
            writing_s=full * write_s + max(0.0, rem - train_block),
        )


@dataclass(frozen=True, kw_only=True)
class Tally:
    """What a stretch of training under periodic checkpoints adds up to."""

    steps_saved: int
    """Steps covered by completed checkpoints (all since the restart)."""
    steps_run: int
    """Steps completed (all since the restart)."""
    training_s: float
    """Seconds computing in this stretch."""
    writing_s: float
    """Seconds writing checkpoints in this stretch."""
    unsaved_s: float
    """Training seconds since the last completed checkpoint (lost on a failure)."""
    partial_s: float
    """Seconds of the step in flight (lost if the job stops at once), at the current pace."""


@dataclass(frozen=True, kw_only=True)
class CheckpointClock:
    """Training under periodic checkpoints from `start_s` at `iteration_s` a step (module doc)."""

    start_s: float
    """When this stretch began: the restart's resume, or the last change of pace."""
    iteration_s: float
    every_steps: int
    write_s: float
    offset_s: float = 0.0
    """Where the current cycle stood at `start_s`, in seconds at this pace (0 after a restart)."""
    saved: int = 0
    """Steps saved before the current cycle."""
    cycle_training_s: float = 0.0
    """Real training seconds of the current cycle before `start_s`."""

    def _after(self, elapsed: float) -> Progress:
        return Progress.after(elapsed, iteration_s=self.iteration_s, every_steps=self.every_steps,
                              write_s=self.write_s)

    def tally(self, t: float) -> Tally:
        """The stretch's figures if it ends at `t`."""
        p0 = self._after(self.offset_s)
        p = self._after(self.offset_s + max(0.0, t - self.start_s))
        training = p.training_s - p0.training_s
        if p.steps_saved == 0:
            unsaved = self.cycle_training_s + training
        else:
            unsaved = p.training_s - p.steps_saved * self.iteration_s
        return Tally(
            steps_saved=self.saved + p.steps_saved,
            steps_run=self.saved + p.steps_run,
            training_s=training,
            writing_s=p.writing_s - p0.writing_s,
            unsaved_s=unsaved,
            partial_s=p.training_s - p.steps_run * self.iteration_s,
        )

    def repace(self, t: float, iteration_s: float) -> tuple[CheckpointClock, Tally]:
        """The clock going on at `iteration_s` a step from `t`, and the tally of the stretch
        it ends (the place in the current cycle carries over)."""
        if t <= self.start_s:
            moved = CheckpointClock(start_s=self.start_s, iteration_s=iteration_s, every_steps=self.every_steps,
                                    write_s=self.write_s, offset_s=self.offset_s * iteration_s / self.iteration_s,
                                    saved=self.saved, cycle_training_s=self.cycle_training_s)
            return moved, self.tally(t)
        tally = self.tally(t)
        elapsed = self.offset_s + (t - self.start_s)
        block = self.every_steps * self.iteration_s
        full = (tally.steps_saved - self.saved) // self.every_steps
        rem = max(0.0, elapsed - full * (block + self.write_s))
        if rem <= block:  # training: the same fraction of the block at the new pace
            offset = rem / self.iteration_s * iteration_s
        else:  # writing: the same seconds of the write
            offset = self.every_steps * iteration_s + (rem - block)
        moved = CheckpointClock(start_s=t, iteration_s=iteration_s, every_steps=self.every_steps,
                                write_s=self.write_s, offset_s=offset, saved=tally.steps_saved,
                                cycle_training_s=tally.unsaved_s)
        return moved, tally
