"""Run one stage's schedule: forward and backward passes, and the point-to-point transfers.

The transfers are posted in groups (`schedule.coalesce`): each run of consecutive transfer
actions is one group of operations on the generation's world communicator, posted at once and
waited for before the next computation. Activations travel on tag 0 and gradients on tag 1
(gloo matches by tag; NCCL ignores tags, and each direction of a link carries one kind only, so
the order alone pairs them). Every wait goes through the `wait` callable the caller gives (an
abortable wait in the runtime), and peers are addressed by their rank inside the world group
(the layout's ranks).

Losses stay on the device: a last stage adds them up in float64 as it goes, and the caller
reads the sum once, in the step's vote (no host sync per microbatch).

Under the interleaved schedule (elastic/parallel/interleaved.py) a stage runs v model chunks:
every action names its chunk, the links form a ring (chunk c of the last stage feeds chunk
c + 1 of the first), and only chunk 0 of the first stage reads tokens and chunk v - 1 of the
last computes losses.

Scatter/gather (Megatron, 2021): with tensor parallelism the t ranks of a stage hold the same
boundary activation (and the same input gradient), so each sends only its 1/t part
(`StageSpec.split`, `part`) and the receiving node rebuilds the whole with one all-gather in
its tensor-parallel group (`gather`): pipeline bytes fall t-fold, the result is bit-identical.
Under sequence parallelism the boundary is already one shard per rank and travels as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from elastic.comm import P2P, Communicator, Handle
from elastic.parallel.phase_clock import PhaseClock
from elastic.parallel.schedule import TRANSFERS, Action, Op, coalesce

_ACT_TAG = 0
_GRAD_TAG = 1

Slot = tuple[int, int]
"""(chunk, microbatch): one chunk's pass over one microbatch."""


def boundary_shape(module: torch.nn.Module, batch: int, seq: int, d_model: int) -> tuple[int, int, int]:
    """Shape of one microbatch's activation `module` (a stage) sends and receives: the
    sequence split into the stage's `seq_shards` under sequence parallelism (model/gpt.py)."""
    shards = int(getattr(module, "seq_shards", 1))
    return (batch, seq // shards, d_model)


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """Where a stage sits in its pipeline and what flows across its links."""

    rank: int
    """World-group rank of this worker (for error messages)."""
    prev_rank: int | None
    """World-group rank of the previous stage's worker with my TP rank; None on the first stage."""
    next_rank: int | None
    """World-group rank of the next stage's worker with my TP rank; None on the last stage."""
    act_shape: tuple[int, ...]
    """Shape of one microbatch's activation sent between stages: (batch, seq, d_model), or with
    sequence parallelism this rank's shard, (batch, seq / tp, d_model) (`boundary_shape`)."""
    act_dtype: torch.dtype = torch.float32
    """Dtype of activations and their gradients on the wire."""
    chunks: int = 1
    """v: model chunks of the stage; with more than one, the first stage's `prev_rank` and the
    last stage's `next_rank` close the ring (module doc)."""
    first_stage: bool | None = None
    """Whether this is the pipeline's first stage (None: it is when `prev_rank` is None)."""
    last_stage: bool | None = None
    """Whether this is the pipeline's last stage (None: it is when `next_rank` is None)."""
    split: int = 1
    """Parts each boundary tensor is cut into on the wire (scatter/gather: the tensor-parallel
    degree; 1: whole tensors)."""
    part: int = 0
    """The part this rank sends and receives (its tensor-parallel rank)."""

    @property
    def is_first_stage(self) -> bool:
        return self.prev_rank is None if self.first_stage is None else self.first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.next_rank is None if self.last_stage is None else self.last_stage


@dataclass
class MicrobatchResult:
    """Losses of the microbatches this stage finished (filled on a last stage only)."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Local microbatch index -> unscaled mean loss (a 0-dim tensor on the device, detached)."""

    def loss_sum(self, device: torch.device) -> torch.Tensor:
        """The losses added in float64 in microbatch order, on the device (0 without any)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for m in sorted(self.losses):
            total += self.losses[m].to(torch.float64)
        return total


Post = Callable[[Sequence[P2P]], Handle]
"""Posts a group of point-to-point operations (peers are world ranks) -> its handle."""

Inputs = Callable[[int], torch.Tensor]
"""Local microbatch index -> tensor (token ids on a first stage, targets on a last stage)."""

Gather = Callable[[torch.Tensor], torch.Tensor]
"""This rank's part of a boundary tensor (flat) -> the whole (flat), by an all-gather in the
tensor-parallel group (scatter/gather)."""


def run_schedule(
    module: torch.nn.Module,
    actions: Sequence[Action],
    *,
    spec: StageSpec,
    group: Communicator,
    wait: Callable[[Handle], None],
    device: torch.device,
    tokens: Inputs | None,
    targets: Inputs | None,
    loss_scale: float,
    dropout_key: Callable[[int], int | None],
    autocast: Callable[[], object],
    post: Post | None = None,
    forward_only: bool = False,
    before_final_backward: Callable[[], None] | None = None,
    before_backward: Callable[[int], None] | None = None,
    clock: PhaseClock | None = None,
    gather: Gather | None = None,
) -> MicrobatchResult:
    """Execute `actions` for one step. Gradients accumulate into `module`'s parameters.

    `loss_scale` multiplies every microbatch loss before its backward (1 / global microbatch
    count, so accumulated gradients are this pipeline's share of the global-batch mean).
    `wait` blocks until one posted group of transfers completed (it may raise to abandon the step).
    `autocast` returns a context manager wrapping each forward (bf16 on CUDA, no-op on CPU).
    `post` posts each group of transfers (default: `group.post`).
    `forward_only`: `actions` has no backward (`schedule.forward_only`, evaluation; call it under
    `torch.no_grad()`): nothing is kept for a backward, a last stage only records its losses.
    `before_final_backward`: called right before the schedule's last backward (the gradients it
    adds are final: a bucket reducer may launch each bucket's reduction as they arrive).
    `before_backward`: called with the microbatch of each backward right before it (a gradient
    accumulator learns where in the step's summation tree the gradients go).
    `clock`: times each forward and backward (elastic/parallel/phase_clock.py).
    `gather`: rebuilds a boundary tensor from this rank's part (needed when `spec.split` > 1).
    """
    if spec.is_first_stage and tokens is None:
        raise ValueError("a first stage needs token inputs")
    if spec.is_last_stage and targets is None:
        raise ValueError("a last stage needs targets")
    if spec.split > 1 and gather is None:
        raise ValueError("boundary tensors split in parts need a gather")
    final = next((a for a in reversed(actions) if a.op is Op.BACKWARD), None)
    run = _StageRun(
        module=module, spec=spec, wait=wait, post=post or group.post, device=device,
        tokens=tokens, targets=targets, loss_scale=loss_scale, dropout_key=dropout_key, autocast=autocast,
        forward_only=forward_only, before_final_backward=before_final_backward, before_backward=before_backward,
        final_backward=None if final is None else (final.chunk, final.mb), clock=clock, gather=gather,
    )
    for step in coalesce(actions):
        if step[0].op in TRANSFERS:
            run.transfer(step)
        else:
            run.do(step[0])
    return run.finish()


@dataclass(kw_only=True)
class _StageRun:
    """One step of one stage in progress: what its actions read and leave for later actions
    (received inputs, outputs awaiting their backward, received output gradients, posted sends)."""

    module: torch.nn.Module
    """The stage module; gradients accumulate into its parameters."""
    spec: StageSpec
    """The stage's place in its pipeline."""
    wait: Callable[[Handle], None]
    """Blocks until one posted group of transfers completed (may raise to abandon the step)."""
    post: Post
    """Posts one group of transfers."""
    device: torch.device
    """Where inputs, activations and receive buffers live."""
    tokens: Inputs | None
    """Token ids of a microbatch (a first stage only)."""
    targets: Inputs | None
    """Targets of a microbatch (a last stage only)."""
    loss_scale: float
    """Multiplies each microbatch loss before its backward."""
    dropout_key: Callable[[int], int | None]
    """Microbatch -> the dropout key of its forward."""
    autocast: Callable[[], object]
    """Returns the context manager wrapping each forward."""
    forward_only: bool = False
    """No backward follows: inputs and outputs are dropped once forwarded and sent."""
    before_final_backward: Callable[[], None] | None = None
    """Called right before the backward of `final_backward`."""
    final_backward: tuple[int, int] | None = None
    """(chunk, microbatch) of the schedule's last backward."""
    before_backward: Callable[[int], None] | None = None
    """Called with the microbatch of each backward right before it."""
    clock: PhaseClock | None = None
    """Times each computation, when given."""
    gather: Gather | None = None
    """Rebuilds a boundary tensor from this rank's part (scatter/gather)."""
    inputs: dict[Slot, torch.Tensor] = field(default_factory=dict)
    """(chunk, microbatch) -> received activation (requires grad), until its input gradient is sent."""
    outputs: dict[Slot, torch.Tensor] = field(default_factory=dict)
    """(chunk, microbatch) -> its output (the last: its scaled loss), until its backward."""
    out_grads: dict[Slot, torch.Tensor] = field(default_factory=dict)
    """(chunk, microbatch) -> received gradient of its output, until its backward."""
    result: MicrobatchResult = field(default_factory=MicrobatchResult)
    """Losses of the microbatches finished so far."""

    def first(self, chunk: int) -> bool:
        """Whether `chunk` is the pipeline's first virtual stage (it reads tokens)."""
        return self.spec.is_first_stage and chunk == 0

    def last(self, chunk: int) -> bool:
        """Whether `chunk` is the pipeline's last virtual stage (it computes losses)."""
        return self.spec.is_last_stage and chunk == self.spec.chunks - 1

    def do(self, action: Action) -> None:
        """Run one computation of the schedule."""
        if self.clock is None:
            _HANDLERS[action.op](self, (action.chunk, action.mb))
            return
        with self.clock.timed(action.op.value):
            _HANDLERS[action.op](self, (action.chunk, action.mb))

    def transfer(self, actions: Sequence[Action]) -> None:
        """Post `actions` (consecutive transfers) as one group, wait for it, and keep what arrived."""
        ops: list[P2P] = []
        arrivals: list[tuple[Action, torch.Tensor]] = []
        for a in actions:
            slot = (a.chunk, a.mb)
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                peer = self.spec.prev_rank if a.op is Op.RECV_ACT else self.spec.next_rank
                assert peer is not None
                buf = self._buffer()
                ops.append(P2P("recv", buf, peer, _ACT_TAG if a.op is Op.RECV_ACT else _GRAD_TAG))
                arrivals.append((a, buf))
            elif a.op is Op.SEND_ACT:
                assert self.spec.next_rank is not None
                out = self.outputs.pop(slot) if self.forward_only else self.outputs[slot]
                ops.append(P2P("send", self._part(out.detach()), self.spec.next_rank, _ACT_TAG))
            else:
                assert a.op is Op.SEND_GRAD and self.spec.prev_rank is not None
                x = self.inputs.pop(slot)
                assert x.grad is not None, f"rank {self.spec.rank}: no input gradient for microbatch {a.mb}"
                ops.append(P2P("send", self._part(x.grad), self.spec.prev_rank, _GRAD_TAG))
        self.wait(self.post(ops))
        for a, buf in arrivals:
            whole = self._whole(buf)
            if a.op is Op.RECV_ACT:
                self.inputs[(a.chunk, a.mb)] = whole.requires_grad_(not self.forward_only)
            else:
                self.out_grads[(a.chunk, a.mb)] = whole

    def forward(self, slot: Slot) -> None:
        """Forward a chunk of a microbatch; on the last virtual stage, its loss (recorded, then
        scaled for the backward)."""
        chunk, m = slot
        if self.first(chunk) and self.tokens is not None:
            x = self.tokens(m).to(self.device)
        else:
            x = self.inputs.pop(slot) if self.forward_only else self.inputs[slot]
        extra = {"chunk": chunk} if self.spec.chunks > 1 else {}
        last = self.last(chunk)
        with self.autocast():  # type: ignore[attr-defined]
            out = self.module(x, dropout_key=self.dropout_key(m), **extra)
            if last:
                assert self.targets is not None
                loss = self.module.loss(out, self.targets(m).to(self.device))  # type: ignore[operator]
        if last:
            self.result.losses[m] = loss.detach()
            if not self.forward_only:
                self.outputs[slot] = loss.to(torch.promote_types(loss.dtype, torch.float32)) * self.loss_scale
        else:
            self.outputs[slot] = out.to(self.spec.act_dtype)

    def backward(self, slot: Slot) -> None:
        """Backward a chunk of a microbatch: from its scaled loss on the last virtual stage, else
        from its output gradient."""
        out = self.outputs.pop(slot)
        if slot == self.final_backward and self.before_final_backward is not None:
            self.before_final_backward()
        if self.before_backward is not None:
            self.before_backward(slot[1])
        if self.last(slot[0]):
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=self.out_grads.pop(slot))

    def finish(self) -> MicrobatchResult:
        """The step's losses (every transfer was waited for in its group)."""
        assert not self.outputs and not self.out_grads, (
            f"rank {self.spec.rank}: schedule left unfinished microbatches"
        )
        return self.result

    def _buffer(self) -> torch.Tensor:
        if self.spec.split == 1:
            return torch.empty(self.spec.act_shape, dtype=self.spec.act_dtype, device=self.device)
        numel = math.prod(self.spec.act_shape) // self.spec.split
        return torch.empty(numel, dtype=self.spec.act_dtype, device=self.device)

    def _part(self, tensor: torch.Tensor) -> torch.Tensor:
        """What this rank sends of a boundary tensor: all of it, or its part (scatter/gather)."""
        flat = tensor.contiguous()
        if self.spec.split == 1:
            return flat
        return flat.view(-1).chunk(self.spec.split)[self.spec.part]

    def _whole(self, received: torch.Tensor) -> torch.Tensor:
        """A received boundary tensor: as it came, or rebuilt from every rank's part."""
        if self.spec.split == 1:
            return received
        assert self.gather is not None
        return self.gather(received).view(self.spec.act_shape)


_HANDLERS: dict[Op, Callable[[_StageRun, Slot], None]] = {
    Op.FORWARD: _StageRun.forward,
    Op.BACKWARD: _StageRun.backward,
}
"""The method of `_StageRun` that runs each computation."""
