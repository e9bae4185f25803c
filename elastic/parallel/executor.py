"""Run one stage's schedule: forward and backward passes, and the point-to-point transfers.

Sends are posted asynchronously and only waited for at the end of the step (a send never
blocks the schedule, matching `schedule.simulate`); receives block. Activations travel on tag
0 and gradients on tag 1, so each direction of each link is one FIFO channel. Every wait goes
through the `wait` callable the caller gives (an abortable wait in the runtime), and peers are
addressed by their rank inside `group` (the generation's world group: the layout's ranks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.parallel.schedule import Action, Op

_ACT_TAG = 0
_GRAD_TAG = 1


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
    """Shape of one microbatch's activation sent between stages: (batch, seq, d_model)."""
    act_dtype: torch.dtype = torch.float32
    """Dtype of activations and their gradients on the wire."""


@dataclass
class MicrobatchResult:
    """Losses of the microbatches this stage finished (filled on a last stage only)."""

    losses: dict[int, float] = field(default_factory=dict)
    """Local microbatch index -> unscaled mean loss."""


Post = Callable[[str, torch.Tensor, int, int], dist.Work]
"""Posts a point-to-point operation: ("send" | "recv", tensor, peer rank, tag) -> its work."""

Inputs = Callable[[int], torch.Tensor]
"""Local microbatch index -> tensor (token ids on a first stage, targets on a last stage)."""


def run_schedule(
    module: torch.nn.Module,
    actions: Sequence[Action],
    *,
    spec: StageSpec,
    group: dist.ProcessGroup,
    wait: Callable[[dist.Work | None], None],
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
) -> MicrobatchResult:
    """Execute `actions` for one step. Gradients accumulate into `module`'s parameters.

    `loss_scale` multiplies every microbatch loss before its backward (1 / global microbatch
    count, so accumulated gradients are this pipeline's share of the global-batch mean).
    `wait` blocks until one posted transfer completed (it may raise to abandon the step).
    `autocast` returns a context manager wrapping each forward (bf16 on CUDA, no-op on CPU).
    `post` posts each transfer (default: `dist.isend`/`dist.irecv` on `group`).
    `forward_only`: `actions` has no backward (`schedule.forward_only`, evaluation; call it under
    `torch.no_grad()`): nothing is kept for a backward, a last stage only records its losses.
    `before_final_backward`: called right before the schedule's last backward (the gradients it
    adds are final: a bucket reducer may launch each bucket's reduction as they arrive).
    `before_backward`: called with the microbatch of each backward right before it (a gradient
    accumulator learns where in the step's summation tree the gradients go).
    """
    if spec.prev_rank is None and tokens is None:
        raise ValueError("a first stage needs token inputs")
    if spec.next_rank is None and targets is None:
        raise ValueError("a last stage needs targets")
    run = _StageRun(
        module=module, spec=spec, wait=wait, post=post or functools.partial(_plain_post, group), device=device,
        tokens=tokens, targets=targets, loss_scale=loss_scale, dropout_key=dropout_key, autocast=autocast,
        forward_only=forward_only, before_final_backward=before_final_backward, before_backward=before_backward,
        final_backward=next((a.mb for a in reversed(actions) if a.op is Op.BACKWARD), None),
    )
    for a in actions:
        run.do(a)
    return run.finish()


def _plain_post(group: dist.ProcessGroup, op: str, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
    """Post one transfer with `dist.isend`/`dist.irecv` on `group` (peers are group ranks)."""
    work = (dist.isend(t, group=group, group_dst=peer, tag=tag) if op == "send"
            else dist.irecv(t, group=group, group_src=peer, tag=tag))
    assert work is not None
    return work


@dataclass(kw_only=True)
class _StageRun:
    """One step of one stage in progress: what its actions read and leave for later actions
    (received inputs, outputs awaiting their backward, received output gradients, posted sends)."""

    module: torch.nn.Module
    """The stage module; gradients accumulate into its parameters."""
    spec: StageSpec
    """The stage's place in its pipeline."""
    wait: Callable[[dist.Work | None], None]
    """Blocks until one posted transfer completed (may raise to abandon the step)."""
    post: Post
    """Posts one transfer."""
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
    final_backward: int | None = None
    """The microbatch of the schedule's last backward."""
    before_backward: Callable[[int], None] | None = None
    """Called with the microbatch of each backward right before it."""
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> received activation (requires grad), until its input gradient is sent."""
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> its output (a last stage: its scaled loss), until its backward."""
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> received gradient of its output, until its backward."""
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    """Posted sends and their tensors (kept alive until waited for at the end of the step)."""
    result: MicrobatchResult = field(default_factory=MicrobatchResult)
    """Losses of the microbatches finished so far."""

    @property
    def first(self) -> bool:
        return self.spec.prev_rank is None

    @property
    def last(self) -> bool:
        return self.spec.next_rank is None

    def do(self, action: Action) -> None:
        """Run one action of the schedule."""
        _HANDLERS[action.op](self, action.mb)

    def recv_act(self, m: int) -> None:
        """Receive microbatch `m`'s activation from the previous stage (blocks)."""
        assert self.spec.prev_rank is not None
        self.inputs[m] = self._recv(self.spec.prev_rank, _ACT_TAG).requires_grad_(not self.forward_only)

    def forward(self, m: int) -> None:
        """Forward microbatch `m`; on a last stage, its loss (recorded, then scaled for the backward)."""
        if self.first and self.tokens is not None:
            x = self.tokens(m).to(self.device)
        else:
            x = self.inputs.pop(m) if self.forward_only else self.inputs[m]
        with self.autocast():  # type: ignore[attr-defined]
            out = self.module(x, dropout_key=self.dropout_key(m))
            if self.last:
                assert self.targets is not None
                loss = self.module.loss(out, self.targets(m).to(self.device))  # type: ignore[operator]
        if self.last:
            self.result.losses[m] = float(loss.detach())
            if not self.forward_only:
                self.outputs[m] = loss.float() * self.loss_scale
        else:
            self.outputs[m] = out.to(self.spec.act_dtype)

    def send_act(self, m: int) -> None:
        """Post microbatch `m`'s activation to the next stage."""
        assert self.spec.next_rank is not None
        out = self.outputs.pop(m) if self.forward_only else self.outputs[m]
        self._send(out.detach(), self.spec.next_rank, _ACT_TAG)

    def recv_grad(self, m: int) -> None:
        """Receive the gradient of microbatch `m`'s output from the next stage (blocks)."""
        assert self.spec.next_rank is not None
        self.out_grads[m] = self._recv(self.spec.next_rank, _GRAD_TAG)

    def backward(self, m: int) -> None:
        """Backward microbatch `m`: from its scaled loss on a last stage, else from its output gradient."""
        out = self.outputs.pop(m)
        if m == self.final_backward and self.before_final_backward is not None:
            self.before_final_backward()
        if self.before_backward is not None:
            self.before_backward(m)
        if self.last:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=self.out_grads.pop(m))

    def send_grad(self, m: int) -> None:
        """Post the gradient of microbatch `m`'s input to the previous stage."""
        assert self.spec.prev_rank is not None
        x = self.inputs.pop(m)
        assert x.grad is not None, f"rank {self.spec.rank}: no input gradient for microbatch {m}"
        self._send(x.grad, self.spec.prev_rank, _GRAD_TAG)

    def finish(self) -> MicrobatchResult:
        """Wait for every posted send; the step's losses."""
        for work, _ in self.sends:
            self.wait(work)
        assert not self.outputs and not self.out_grads, (
            f"rank {self.spec.rank}: schedule left unfinished microbatches"
        )
        return self.result

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.spec.act_shape, dtype=self.spec.act_dtype, device=self.device)
        self.wait(self.post("recv", buf, src, tag))
        return buf

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self.sends.append((self.post("send", t, dst, tag), t))


_HANDLERS: dict[Op, Callable[[_StageRun, int], None]] = {
    Op.RECV_ACT: _StageRun.recv_act,
    Op.FORWARD: _StageRun.forward,
    Op.SEND_ACT: _StageRun.send_act,
    Op.RECV_GRAD: _StageRun.recv_grad,
    Op.BACKWARD: _StageRun.backward,
    Op.SEND_GRAD: _StageRun.send_grad,
}
"""The method of `_StageRun` that runs each kind of action."""
