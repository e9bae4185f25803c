"""Run one stage's schedule: forward and backward passes, and the point-to-point transfers.

Sends are posted asynchronously and only waited for at the end of the step (a send never
blocks the schedule, matching `schedule.simulate`); receives block. Activations travel on tag
0 and gradients on tag 1, so each direction of each link is one FIFO channel. Every wait goes
through the `wait` callable the caller gives (an abortable wait in the runtime), and peers are
addressed by their rank inside `group` (the generation's world group: the layout's ranks).
"""

from __future__ import annotations

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
) -> MicrobatchResult:
    """Execute `actions` for one step. Gradients accumulate into `module`'s parameters.

    `loss_scale` multiplies every microbatch loss before its backward (1 / global microbatch
    count, so accumulated gradients are this pipeline's share of the global-batch mean).
    `wait` blocks until one posted transfer completed (it may raise to abandon the step).
    `autocast` returns a context manager wrapping each forward (bf16 on CUDA, no-op on CPU).
    `post` posts each transfer (default: `dist.isend`/`dist.irecv` on `group`).
    """
    first, last = spec.prev_rank is None, spec.next_rank is None
    if first and tokens is None:
        raise ValueError("a first stage needs token inputs")
    if last and targets is None:
        raise ValueError("a last stage needs targets")
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    out_grads: dict[int, torch.Tensor] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    result = MicrobatchResult()

    def plain(op: str, t: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = (dist.isend(t, group=group, group_dst=peer, tag=tag) if op == "send"
                else dist.irecv(t, group=group, group_src=peer, tag=tag))
        assert work is not None
        return work

    posting = post or plain

    def recv(src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(spec.act_shape, dtype=spec.act_dtype, device=device)
        wait(posting("recv", buf, src, tag))
        return buf

    def send(t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        sends.append((posting("send", t, dst, tag), t))

    for a in actions:
        m = a.mb
        if a.op is Op.RECV_ACT:
            assert spec.prev_rank is not None
            inputs[m] = recv(spec.prev_rank, _ACT_TAG).requires_grad_(True)
        elif a.op is Op.FORWARD:
            x = tokens(m).to(device) if first and tokens is not None else inputs[m]
            with autocast():  # type: ignore[attr-defined]
                out = module(x, dropout_key=dropout_key(m))
                if last:
                    assert targets is not None
                    loss = module.loss(out, targets(m).to(device))  # type: ignore[operator]
            if last:
                result.losses[m] = float(loss.detach())
                outputs[m] = loss.float() * loss_scale
            else:
                outputs[m] = out.to(spec.act_dtype)
        elif a.op is Op.SEND_ACT:
            assert spec.next_rank is not None
            send(outputs[m].detach(), spec.next_rank, _ACT_TAG)
        elif a.op is Op.RECV_GRAD:
            assert spec.next_rank is not None
            out_grads[m] = recv(spec.next_rank, _GRAD_TAG)
        elif a.op is Op.BACKWARD:
            out = outputs.pop(m)
            if last:
                out.backward()
            else:
                torch.autograd.backward(out, grad_tensors=out_grads.pop(m))
        elif a.op is Op.SEND_GRAD:
            assert spec.prev_rank is not None
            x = inputs.pop(m)
            assert x.grad is not None, f"rank {spec.rank}: no input gradient for microbatch {m}"
            send(x.grad, spec.prev_rank, _GRAD_TAG)
    for work, _ in sends:
        wait(work)
    assert not outputs and not out_grads, f"rank {spec.rank}: schedule left unfinished microbatches"
    return result
