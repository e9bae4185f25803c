"""The cost model of one pipeline stage and of a 1F1B pipeline.

A stage is a contiguous layer range [i, j) run by one node of G devices, tensor-parallel:

- compute: (sum of the layers' forward + backward times) / G, plus the TP all-reduces of the
  layers' outputs among the G devices (`LayerProfile.tp_allreduces` of them per layer);
- transfer: every stage but the last sends its output activation forward and receives its
  gradient back, i.e. 2 p2p transfers of the last layer's `output_bytes` per microbatch;
- memory: weights + optimizer state + the engine's gradient and exchange buffers (the profile's
  `memory.grad_bytes_per_param` per parameter), the layers' workspace (the head's loss, once),
  plus the activations of the microbatches in flight. Under 1F1B the stage k-th from the end
  (k = 1 for the last stage) holds up to k microbatches of activations, and a non-last stage
  also their outputs (kept until their gradients come back). The stage must fit its G
  workers' budget: G x (device memory - the device's reserve - the engine's fixed per-worker
  buffers, `memory.worker_bytes`).

Activation recomputation (`recompute`): under a mode a stage keeps its layers' activations as
the mode keeps them (`LayerProfile.under`), runs their recomputed forward again in the backward
(its seconds, and under `full` the forward's TP all-reduces again) and holds, once, the largest
workspace a layer's rerun brings back to life. With "auto" each stage takes the fastest mode
that fits, the one keeping more on ties (none, selective, full): a stage's mode depends on
(i, j, k) alone, so the choice stays inside the same DP.

A stage's cost therefore depends on (i, j, k) only, which is what makes an exact DP over layer
suffixes and stage counts possible. The iteration time of a pipeline running m microbatches
is sum(stage times) + (m - 1) * max(stage times); interleaved over v chunks per stage, see
`pipeline_time` and templates/interleave.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from templates.profile import PLANNED_RECOMPUTE, RECOMPUTE_MODES, WEIGHT_BYTES, Profile


def pipeline_time(stage_times: Sequence[float], microbatches: int, chunks: int = 1) -> float:
    """1F1B iteration time: all stages once (fill + drain) plus m - 1 rounds of the slowest.

    Interleaved over v = `chunks` chunks per stage (elastic/parallel/interleaved.py; a stage's
    time is its chunks' together): the fill and drain shrink v-fold, sum / v + (m - 1 / v) *
    max, and where p does not divide m each of the m' - m microbatches that pad the last group
    still costs (v - 1) / v of a round of the slowest."""
    total, slowest = float(sum(stage_times)), float(max(stage_times))
    if chunks == 1:
        return total + (microbatches - 1) * slowest
    p = len(stage_times)
    padding = -(-microbatches // p) * p - microbatches
    return total / chunks + (microbatches - 1 / chunks) * slowest + padding * (chunks - 1) / chunks * slowest


@dataclass(frozen=True)
class _Mode:
    """One recomputation mode's (L+1, L+1) arrays over stages [i, j)."""

    time_last: np.ndarray
    time_mid: np.ndarray
    static: np.ndarray
    act: np.ndarray
    act_mid: np.ndarray
    rerun: np.ndarray
    """(i, j): the largest workspace a layer of [i, j) brings back to life when it reruns its
    forward in this mode (included in `static`)."""

    def time(self, k: int) -> np.ndarray:
        return self.time_last if k == 1 else self.time_mid

    def memory(self, k: int) -> np.ndarray:
        return self.static + k * (self.act if k == 1 else self.act_mid)


def _range_sums(values: np.ndarray) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, :] - prefix[:, None]  # (i, j): sum of values[i:j]


def _range_max(values: np.ndarray) -> np.ndarray:
    """(i, j): max of values[i:j] (0 where empty)."""
    n = len(values) + 1
    out = np.zeros((n, n))
    for i in range(len(values)):
        out[i, i + 1:] = np.maximum.accumulate(values[i:])
    return out


MOMENT_GRID_BYTES = 8 * 64 * 16
"""What a holder's slice of a layer's moments may exceed 1/S of them by: slices are cut on a
64-element grid of each parameter (`templates.optim_slices.aligned_cuts`), 8 bytes an element,
for layers of up to 16 parameter tensors (a GPT block has 12)."""


def moment_bytes(optimizer_bytes: float, slices: int) -> float:
    """A holder's bytes of a layer's moments when they are cut into `slices` (1: all of them)."""
    return float(optimizer_bytes) if slices == 1 else min(float(optimizer_bytes), optimizer_bytes / slices + MOMENT_GRID_BYTES)


class StageCosts:
    """Stage times and memory for every layer range and position, as numpy arrays."""

    def __init__(self, profile: Profile, gpus_per_node: int, recompute: str = "none", moment_slices: int = 1) -> None:
        if moment_slices < 1:
            raise ValueError(f"moment_slices must be >= 1, got {moment_slices}")
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        if recompute not in PLANNED_RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(PLANNED_RECOMPUTE)}, got {recompute!r}")
        self.profile = profile
        self.gpus_per_node = gpus_per_node
        self.num_layers = profile.num_layers
        self.modes: tuple[str, ...] = RECOMPUTE_MODES if recompute == "auto" else (recompute,)
        """The modes a stage may take, in order of preference on ties."""
        dev = profile.device
        self.worker_bytes = float(gpus_per_node) * profile.memory.worker_bytes
        """The G workers' fixed buffers (work buffers: no stage is without them)."""
        self.capacity = float(gpus_per_node) * dev.budget_bytes - self.worker_bytes
        """Bytes for the stage's layers: G devices' budget less the workers' fixed buffers."""
        layers = profile.layers
        grad_per_weight_byte = profile.memory.grad_bytes_per_param / WEIGHT_BYTES
        self.moment_slices = moment_slices
        """S: the sharded optimizer's slices of every layer's moments (1: each holder keeps all)."""
        state = np.array([ly.param_bytes * (1.0 + grad_per_weight_byte) + moment_bytes(ly.optimizer_bytes, moment_slices)
                          for ly in layers])
        n = self.num_layers + 1
        self._valid = np.triu(np.ones((n, n), dtype=bool), k=1)  # i < j
        self._state = _range_sums(state)
        self._arrays = {mode: self._mode(mode, state) for mode in self.modes}

    def _mode(self, mode: str, state: np.ndarray) -> _Mode:
        layers, dev, g = self.profile.layers, self.profile.device, self.gpus_per_node
        under = [ly.under(mode) for ly in layers]
        compute = np.array([(ly.forward + ly.backward + u.extra) / g for ly, u in zip(layers, under, strict=True)])
        compute += np.array([(ly.tp_allreduces + u.allreduces) * dev.allreduce_time(ly.output_bytes, g)
                             for ly, u in zip(layers, under, strict=True)])
        rerun = _range_max(np.array([float(u.workspace_bytes) for u in under]))
        static = _range_sums(state + np.array([float(ly.workspace_bytes) for ly in layers])) + rerun
        act = np.where(self._valid, _range_sums(np.array([float(u.activation_bytes) for u in under])), np.inf)
        p2p = np.array([2.0 * dev.p2p_time(ly.output_bytes) for ly in layers], dtype=np.float64)
        time_last = np.where(self._valid, _range_sums(compute), np.inf)
        return _Mode(
            time_last=time_last,
            # A non-last stage [i, j) sends the output of layer j - 1 ...
            time_mid=time_last + np.concatenate([[0.0], p2p])[None, :],
            static=np.where(self._valid, static, np.inf),
            act=act,
            # ... and keeps it per microbatch in flight.
            act_mid=act + np.concatenate([[0.0], [float(ly.output_bytes) for ly in layers]])[None, :],
            rerun=rerun,
        )

    def costs(self, k: int) -> np.ndarray:
        """(L+1, L+1) array: time of stage [i, j) placed k-th from the end in its fastest mode
        that fits; inf if none does."""
        out = np.full(self._valid.shape, np.inf)
        for arrays in self._arrays.values():
            out = np.minimum(out, np.where(arrays.memory(k) <= self.capacity, arrays.time(k), np.inf))
        return out

    def candidate_times(self) -> np.ndarray:
        """Every distinct finite stage time any (i, j, k) can take, sorted ascending."""
        values = []
        for arrays in self._arrays.values():
            last_fits = arrays.memory(1) <= self.capacity  # k = 1 is the loosest for each
            mid_fits = arrays.memory(2) <= self.capacity
            values += [arrays.time_last[last_fits], arrays.time_mid[mid_fits]]
        joined = np.concatenate(values)
        return np.unique(joined[np.isfinite(joined)])

    def stage_mode(self, first: int, last: int, k: int) -> str:
        """The mode of stage [first, last) placed k-th from the end: the fastest that fits, the
        first of `modes` on ties (the first that fits least badly when none fits)."""
        fitting = [m for m in self.modes if self._arrays[m].memory(k)[first, last] <= self.capacity]
        if not fitting:
            return min(self.modes, key=lambda m: float(self._arrays[m].memory(k)[first, last]))
        return min(fitting, key=lambda m: float(self._arrays[m].time(k)[first, last]))

    def stage_time(self, first: int, last: int, k: int) -> float:
        """Time of stage [first, last) placed k-th from the end, in its mode."""
        return float(self._arrays[self.stage_mode(first, last, k)].time(k)[first, last])

    def stage_memory(self, first: int, last: int, k: int) -> float:
        """Bytes stage [first, last) needs when placed k-th from the end, in its mode (beside the
        workers' fixed buffers, which `capacity` leaves out)."""
        return float(self._arrays[self.stage_mode(first, last, k)].memory(k)[first, last])

    def state_bytes(self, first: int, last: int) -> float:
        """The planner's parameter-and-state bytes of stage [first, last): weights, optimizer
        state, gradient and exchange buffers, and its G workers' fixed buffers."""
        return float(self._state[first, last]) + self.worker_bytes

    def chunk_time(self, first: int, last: int, mode: str, *, last_virtual: bool) -> float:
        """Time of layers [first, last) as one chunk of an interleaved stage in `mode`: the
        transfers of its output and gradient unless it is the pipeline's last virtual stage."""
        return float(self._arrays[mode].time(1 if last_virtual else 2)[first, last])

    def chunks_memory(self, ranges: Sequence[tuple[int, int]], mode: str, in_flight: Sequence[int],
                      last_virtual: bool) -> float:
        """Bytes a node holding the chunks `ranges` needs in `mode` with `in_flight[c]`
        microbatches of chunk c in flight (beside the workers' fixed buffers); `last_virtual`:
        its last chunk is the pipeline's last virtual stage (it keeps no output). A rerun's
        workspace lives only during its chunk's backward, and a node runs one backward at a time:
        the largest over the chunks counts, once."""
        arrays, total, rerun = self._arrays[mode], 0.0, 0.0
        for c, (first, last) in enumerate(ranges):
            mid = not (last_virtual and c == len(ranges) - 1)
            total += float(arrays.static[first, last] - arrays.rerun[first, last]) + in_flight[c] * float(
                (arrays.act_mid if mid else arrays.act)[first, last])
            rerun = max(rerun, float(arrays.rerun[first, last]))
        return total + rerun

    def stage_fits(self, first: int, last: int, k: int) -> bool:
        return self.stage_memory(first, last, k) <= self.capacity

    def layout_times(self, bounds: Sequence[tuple[int, int]]) -> list[float] | None:
        """Stage times of a layout given as [(first, last), ...]; None if a stage does not fit."""
        depth = len(bounds)
        times = []
        for s, (first, last) in enumerate(bounds):
            k = depth - s
            if not self.stage_fits(first, last, k):
                return None
            times.append(self.stage_time(first, last, k))
        return times

    def layout_modes(self, bounds: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """The mode of each stage of a layout given as [(first, last), ...]."""
        return tuple(self.stage_mode(first, last, len(bounds) - s) for s, (first, last) in enumerate(bounds))
