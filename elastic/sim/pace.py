"""Training at a pace that may change between two membership changes (a node slows down or
recovers, a re-split): the step arithmetic of `result.py` with the in-flight step carried over.

A change of pace loses nothing: the step in flight keeps the fraction of it already done and
finishes at the new pace. Only a membership change (or a restart) loses it, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.sim.result import PolicyResult, train_interrupted, whole_steps

_EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class Stretch:
    """Training from `start_s` at `iteration_s` a step, with part of an in-flight step done
    before `start_s` at an earlier pace (nothing carried: exactly `result.py`'s arithmetic)."""

    start_s: float
    """When training (re)started at this pace (after a recovery, it may lie ahead)."""
    iteration_s: float
    """Seconds per step from `start_s` on."""
    carried: float = 0.0
    """Fraction of the in-flight step done before `start_s` (0 <= carried < 1)."""
    carried_s: float = 0.0
    """Training seconds that fraction took (already counted in `training_s`)."""

    def _steps(self, t: float) -> float:
        return self.carried + max(0.0, t - self.start_s) / self.iteration_s

    def boundary(self, t: float) -> float:
        """The first step boundary at or after `t` (`start_s` while training has not resumed)."""
        if t < self.start_s:
            return self.start_s
        return self.start_s + (math.ceil(self._steps(t) - _EPS) - self.carried) * self.iteration_s

    def in_flight(self, t: float) -> float:
        """Fraction of the step in flight at `t` already done (0 <= it < 1)."""
        total = self._steps(t)
        return max(0.0, total - math.floor(total + _EPS))

    def interrupt(self, res: PolicyResult, t: float) -> None:
        """Training until `t`, cut by a membership change: whole steps count, the in-flight one
        (its carried part included) is lost."""
        if not self.carried:
            if t > self.start_s:
                train_interrupted(res, t - self.start_s, self.iteration_s)
            return
        ran = max(0.0, t - self.start_s)
        total = self._steps(t)
        done = int(math.floor(total + _EPS))
        res.steps += done
        res.training_s += ran
        res.lost_s += self.carried_s + ran if done == 0 else (total - done) * self.iteration_s

    def commit(self, res: PolicyResult, t: float) -> None:
        """Training until the step boundary `t` (from `boundary`): every step counts."""
        ran = max(0.0, t - self.start_s)
        res.steps += int(math.floor(self._steps(t) + 1e-6))
        res.training_s += ran

    def repace(self, res: PolicyResult, t: float, iteration_s: float) -> Stretch:
        """The same training at `iteration_s` a step from `t` on: the steps done until `t` count
        and the in-flight one carries over (before `start_s`, only the pace changes)."""
        if t <= self.start_s:
            return Stretch(start_s=self.start_s, iteration_s=iteration_s, carried=self.carried,
                           carried_s=self.carried_s)
        ran = t - self.start_s
        total = self._steps(t)
        done = int(math.floor(total + _EPS))
        res.steps += done
        res.training_s += ran
        frac = max(0.0, total - done)
        frac_s = self.carried_s + ran if done == 0 else frac * self.iteration_s
        return Stretch(start_s=t, iteration_s=iteration_s, carried=frac, carried_s=frac_s)

    def finish(self, res: PolicyResult, horizon_s: float) -> None:
        """Training until the horizon: whole steps count (the one in flight is not lost)."""
        if horizon_s <= self.start_s:
            return
        ran = horizon_s - self.start_s
        res.steps += whole_steps(ran, self.iteration_s) if not self.carried else int(
            math.floor(self._steps(horizon_s) + _EPS))
        res.training_s += ran
