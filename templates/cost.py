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

A stage's cost therefore depends on (i, j, k) only, which is what makes an exact DP over layer
suffixes and stage counts possible. The iteration time of a pipeline running m microbatches
is sum(stage times) + (m - 1) * max(stage times).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from templates.profile import WEIGHT_BYTES, Profile


def pipeline_time(stage_times: Sequence[float], microbatches: int) -> float:
    """1F1B iteration time: all stages once (fill + drain) plus m - 1 rounds of the slowest."""
    return float(sum(stage_times)) + (microbatches - 1) * float(max(stage_times))


class StageCosts:
    """Stage times and memory for every layer range and position, as numpy arrays."""

    def __init__(self, profile: Profile, gpus_per_node: int) -> None:
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        self.profile = profile
        self.gpus_per_node = gpus_per_node
        self.num_layers = profile.num_layers
        dev = profile.device
        self.worker_bytes = float(gpus_per_node) * profile.memory.worker_bytes
        """The G workers' fixed buffers (work buffers: no stage is without them)."""
        self.capacity = float(gpus_per_node) * dev.budget_bytes - self.worker_bytes
        """Bytes for the stage's layers: G devices' budget less the workers' fixed buffers."""
        layers = profile.layers
        grad_per_weight_byte = profile.memory.grad_bytes_per_param / WEIGHT_BYTES

        compute = np.array([(ly.forward + ly.backward) / gpus_per_node for ly in layers], dtype=np.float64)
        compute += np.array(
            [ly.tp_allreduces * dev.allreduce_time(ly.output_bytes, gpus_per_node) for ly in layers]
        )
        state = np.array([ly.param_bytes * (1.0 + grad_per_weight_byte) + ly.optimizer_bytes for ly in layers])
        static = state + np.array([float(ly.workspace_bytes) for ly in layers])
        act = np.array([float(ly.activation_bytes) for ly in layers], dtype=np.float64)
        p2p = np.array([2.0 * dev.p2p_time(ly.output_bytes) for ly in layers], dtype=np.float64)

        def range_sums(values: np.ndarray) -> np.ndarray:
            prefix = np.concatenate([[0.0], np.cumsum(values)])
            return prefix[None, :] - prefix[:, None]  # (i, j): sum of values[i:j]

        n = self.num_layers + 1
        valid = np.triu(np.ones((n, n), dtype=bool), k=1)  # i < j
        self._valid = valid
        self._time_last = np.where(valid, range_sums(compute), np.inf)
        # A non-last stage [i, j) sends the output of layer j - 1.
        self._time_mid = self._time_last + np.concatenate([[0.0], p2p])[None, :]
        self._static = np.where(valid, range_sums(static), np.inf)
        self._state = range_sums(state)
        self._act = np.where(valid, range_sums(act), np.inf)
        # A non-last stage [i, j) keeps the output of layer j - 1 per microbatch in flight.
        self._act_mid = self._act + np.concatenate([[0.0], [float(ly.output_bytes) for ly in layers]])[None, :]

    def costs(self, k: int) -> np.ndarray:
        """(L+1, L+1) array: time of stage [i, j) placed k-th from the end; inf if it cannot be."""
        base = self._time_last if k == 1 else self._time_mid
        fits = self._static + k * (self._act if k == 1 else self._act_mid) <= self.capacity
        return np.where(fits & self._valid, base, np.inf)

    def candidate_times(self) -> np.ndarray:
        """Every distinct finite stage time any (i, j, k) can take, sorted ascending."""
        last_fits = self._static + self._act <= self.capacity  # k = 1 is the loosest for each
        mid_fits = self._static + 2 * self._act_mid <= self.capacity
        values = np.concatenate([self._time_last[last_fits], self._time_mid[mid_fits]])
        return np.unique(values[np.isfinite(values)])

    def stage_time(self, first: int, last: int, k: int) -> float:
        """Time of stage [first, last) placed k-th from the end (ignores memory)."""
        return float((self._time_last if k == 1 else self._time_mid)[first, last])

    def stage_memory(self, first: int, last: int, k: int) -> float:
        """Bytes stage [first, last) needs when placed k-th from the end (beside the workers'
        fixed buffers, which `capacity` leaves out)."""
        return float(self._static[first, last] + k * (self._act if k == 1 else self._act_mid)[first, last])

    def state_bytes(self, first: int, last: int) -> float:
        """The planner's parameter-and-state bytes of stage [first, last): weights, optimizer
        state, gradient and exchange buffers, and its G workers' fixed buffers."""
        return float(self._state[first, last]) + self.worker_bytes

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
