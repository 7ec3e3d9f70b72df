"""One autograd step through many remote experts: each sample to each of its chosen experts.

Forward groups the (sample, slot) pairs by expert, so every chosen expert gets one request with
all the rows routed to it (split at its max_batch_size), and sends them all at once on the
background loop under `quorum.call_with_quorum`. It returns a mask of the pairs that answered and,
per expert output, a `[batch, k, ...]` tensor (zeros where the expert did not answer).

Backward sends each answered group its rows' output gradients, again all at once, and sums the
input gradients the experts return. Groups that failed forward get nothing (their weight in the
mixture was zero anyway); groups that fail backward contribute zero gradient, as long as every
sample keeps `backward_k_min` answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ...p2p.host import Host
from ...utils.background_loop import get_background_loop
from ..expert_uid import ExpertInfo
from ..messages import ExpertSchema
from .expert import DEFAULT_TIMEOUT, expert_backward, expert_forward
from .quorum import call_with_quorum

GRACE = 5.0  # beyond the deadline, how long the torch thread waits for the loop to wind down


@dataclass
class Group:
    """Rows of the batch routed to one expert, and the slot each row's answer goes to."""

    expert: ExpertInfo
    rows: torch.Tensor  # long, [n]
    slots: torch.Tensor  # long, [n]

    @property
    def samples(self) -> list[int]:
        return self.rows.tolist()


@dataclass
class MixtureCall:
    """Everything the autograd function needs besides the tensors."""

    host: Host
    schema: ExpertSchema
    chosen: list[list[ExpertInfo]]  # per sample, best first
    k_min: int
    backward_k_min: int
    timeout_after_k_min: float | None
    forward_deadline: float | None  # time.monotonic() instant
    backward_timeout: float | None
    detect_anomalies: bool
    allow_zero_outputs: bool

    @property
    def slots(self) -> int:
        return max((len(experts) for experts in self.chosen), default=0)

    def groups(self) -> list[Group]:
        by_expert: dict[ExpertInfo, tuple[list[int], list[int]]] = {}
        for sample, experts in enumerate(self.chosen):
            for slot, expert in enumerate(experts):
                rows, slots = by_expert.setdefault(expert, ([], []))
                rows.append(sample)
                slots.append(slot)
        limit = max(1, self.schema.max_batch_size)
        groups = []
        for expert, (rows, slots) in by_expert.items():
            for start in range(0, len(rows), limit):
                groups.append(
                    Group(
                        expert,
                        torch.tensor(rows[start : start + limit], dtype=torch.long),
                        torch.tensor(slots[start : start + limit], dtype=torch.long),
                    )
                )
        return groups


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    for i, tensor in enumerate(tensors):
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{what} {i} holds NaN or Inf (detect_anomalies is on)")


class RemoteCallMany(torch.autograd.Function):
    """apply(dummy, call: MixtureCall, *flat_inputs) -> (mask [batch, k], *outputs [batch, k, ...])."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, call: MixtureCall, *inputs: torch.Tensor):
        inputs = tuple(t.detach() for t in inputs)
        if call.detect_anomalies:
            _check_finite(inputs, "input")
        batch, k = len(call.chosen), call.slots
        groups = call.groups()
        device = inputs[0].device
        cpu_inputs = [t.cpu() for t in inputs]
        answers = _run_groups(
            call,
            groups,
            [[t.index_select(0, g.rows) for t in cpu_inputs] for g in groups],
            call.k_min,
            call.forward_deadline,
            forward=True,
        )
        mask = torch.zeros(batch, k, dtype=torch.bool)
        outputs = []
        for index, descriptor in enumerate(call.schema.outputs_schema):
            sample = next((answer[index] for answer in answers.values()), None)
            shape = (
                tuple(sample.shape[1:])
                if sample is not None
                else tuple(1 if d is None else d for d in descriptor.shape)
            )
            outputs.append(torch.zeros(batch, k, *shape, dtype=descriptor.torch_dtype))
        for i, answer in answers.items():
            group = groups[i]
            mask[group.rows, group.slots] = True
            for output, tensor in zip(outputs, answer):
                output[group.rows, group.slots] = tensor
        if not answers and batch and not call.allow_zero_outputs:
            raise RuntimeError(
                f"forward: none of the {len(groups)} chosen experts answered "
                f"(allow_zero_outputs is off); check that expert servers are running and "
                f"reachable"
            )
        ctx.call, ctx.groups, ctx.alive = call, groups, sorted(answers)
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(mask)
        outputs = [t.to(device) for t in outputs]
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return (mask.to(device), *outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_mask, *grad_outputs: torch.Tensor):
        call: MixtureCall = ctx.call
        inputs = ctx.saved_tensors
        groups = [ctx.groups[i] for i in ctx.alive]
        descriptors = call.schema.inputs_schema
        grad_inputs = [
            torch.zeros(t.shape, dtype=t.dtype) if d.requires_grad else None
            for t, d in zip(inputs, descriptors)
        ]
        if groups:
            cpu_inputs = [t.cpu() for t in inputs]
            cpu_grads = [g.cpu() for g in grad_outputs]
            payloads = [
                [t.index_select(0, g.rows) for t in cpu_inputs]
                + [grad[g.rows, g.slots] for grad in cpu_grads]
                for g in groups
            ]
            deadline = None if call.backward_timeout is None else time.monotonic() + call.backward_timeout
            answers = _run_groups(call, groups, payloads, call.backward_k_min, deadline, forward=False)
            for i, answer in answers.items():
                grads = iter(answer)
                for grad_input in grad_inputs:
                    if grad_input is not None:
                        grad_input.index_add_(0, groups[i].rows, next(grads).to(grad_input.dtype))
        device = inputs[0].device
        return (None, None, *(None if g is None else g.to(device) for g in grad_inputs))


def _run_groups(
    call: MixtureCall,
    groups: list[Group],
    payloads: list[list[torch.Tensor]],
    k_min: int,
    deadline: float | None,
    *,
    forward: bool,
) -> dict[int, list[torch.Tensor]]:
    """Send every group its payload at once; the answers of those that made it, by group index."""
    n_inputs = len(call.schema.inputs_schema)

    def make_call(group: Group, payload: list[torch.Tensor]):
        async def one():
            timeout = _remaining(deadline)
            timeout = DEFAULT_TIMEOUT if timeout is None else timeout
            if forward:
                answer = await expert_forward(call.host, group.expert, call.schema, payload, timeout)
            else:
                answer = await expert_backward(
                    call.host, group.expert, call.schema, payload[:n_inputs], payload[n_inputs:], timeout
                )
            if call.detect_anomalies:
                _check_finite(answer, f"{group.expert.uid} answered a tensor; tensor")
            return answer

        return one

    rows = [group.samples for group in groups]
    if forward:
        required: int | list[int] = k_min
    else:  # a sample needs no more backward answers than it had forward answers
        alive = [0] * len(call.chosen)
        for r in rows:
            for sample in r:
                alive[sample] += 1
        required = [min(k_min, n) for n in alive]
    phase = "forward" if forward else "backward"

    def describe(i: int) -> str:
        return f"expert {groups[i].expert.uid} on {groups[i].expert.peer_id}"

    coroutine = call_with_quorum(
        [make_call(g, p) for g, p in zip(groups, payloads)],
        rows,
        len(call.chosen),
        required,
        call.timeout_after_k_min,
        deadline,
        describe,
        phase,
    )
    remaining = _remaining(deadline)
    return get_background_loop().run(coroutine, None if remaining is None else remaining + GRACE)
