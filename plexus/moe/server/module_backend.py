"""One hosted expert: its module, optimizer and schedule, its schema, and its two task pools.

Forward runs under `no_grad`: nothing is kept between calls. Backward is stateless: it reruns the
forward with grad on the inputs the client sends back, backpropagates the client's output
gradients, returns the input gradients, and then takes an optimizer step, so every backward batch
trains the expert (hivemind's design; a recomputed dropout differs from the forward's, which is
why `det_dropout` takes its mask as an input).

Inputs arrive on the CPU and are moved to the module's device; outputs go back to the CPU.

Nothing non-finite gets through: a batch whose outputs, input gradients or parameter gradients
hold NaN or inf raises `NonFiniteError` instead of answering, and a backward that raises it takes
no optimizer step and clears the parameters' gradients, so the expert stays exactly as it was.
(The handler refuses requests whose own tensors are not finite before they are batched.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...errors import PeerMisbehaved
from ...utils.tensors import first_nonfinite
from ..messages import ExpertSchema
from ..schema import BatchTensorDescriptor
from .runtime import DEFAULT_MAX_PENDING_TASKS, TaskPool

DUMMY_BATCH_SIZE = 3  # the batch used to infer outputs_schema


class NonFiniteError(PeerMisbehaved, ValueError):
    """A batch produced NaN or inf (outputs or gradients) from a client's inputs; it was refused, and
    the expert is unchanged."""


class ModuleBackend:
    """A module served as an expert named `name`.

    Args:
        name: the expert uid.
        module: the torch module; called as `module(*args, **kwargs)`.
        optimizer: stepped after every backward batch (None: the expert does not learn).
        scheduler: stepped after every optimizer step.
        args_schema: one descriptor per positional input (required).
        kwargs_schema: descriptor per keyword input.
        outputs_schema: one descriptor, or a tuple for modules that return a tuple; inferred from a
            dummy forward of DUMMY_BATCH_SIZE rows when None.
        max_batch_size: the most rows one batch of the pools holds.
        min_batch_size: the rows a batch waits for, at most `timeout` seconds.
        timeout: how long the oldest request waits for min_batch_size rows before it runs anyway.
        max_pending_tasks: how many requests a pool queues before it refuses more.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler=None,
        args_schema: Sequence[BatchTensorDescriptor] | None = None,
        kwargs_schema: dict[str, BatchTensorDescriptor] | None = None,
        outputs_schema: BatchTensorDescriptor | Sequence[BatchTensorDescriptor] | None = None,
        max_batch_size: int = 4096,
        min_batch_size: int = 1,
        timeout: float = 1.0,
        max_pending_tasks: int = DEFAULT_MAX_PENDING_TASKS,
    ):
        if args_schema is None:
            raise ValueError(
                f"expert {name!r}: give args_schema, e.g. (BatchTensorDescriptor((hidden_dim,)),)"
            )
        self.name, self.module, self.optimizer, self.scheduler = name, module, optimizer, scheduler
        self.args_schema = tuple(args_schema)
        self.kwargs_schema = dict(kwargs_schema or {})
        self.max_batch_size = max_batch_size
        if outputs_schema is None:
            self.outputs_schema, self.outputs_tuple = self._infer_outputs_schema()
        elif isinstance(outputs_schema, BatchTensorDescriptor):
            self.outputs_schema, self.outputs_tuple = (outputs_schema,), False
        else:
            self.outputs_schema, self.outputs_tuple = tuple(outputs_schema), True
        pool_options: dict[str, Any] = dict(
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            timeout=timeout,
            max_pending_tasks=max_pending_tasks,
        )
        self.forward_pool = TaskPool(self.forward, name=f"{name}_forward", **pool_options)
        self.backward_pool = TaskPool(self.backward, name=f"{name}_backward", **pool_options)
        self.schema = ExpertSchema(
            name,
            self.args_schema,
            tuple(self.kwargs_schema),
            tuple(self.kwargs_schema.values()),
            self.outputs_schema,
            self.outputs_tuple,
            max_batch_size,
        )

    @property
    def device(self) -> torch.device:
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            return tensor.device
        return torch.device("cpu")

    def _split(self, inputs: Sequence[torch.Tensor]) -> tuple[list, dict]:
        n_args = len(self.args_schema)
        return list(inputs[:n_args]), dict(zip(self.kwargs_schema, inputs[n_args:]))

    def _call(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args, kwargs = self._split(inputs)
        outputs = self.module(*args, **kwargs)
        return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)

    def _infer_outputs_schema(self) -> tuple[tuple[BatchTensorDescriptor, ...], bool]:
        inputs = [
            d.make_zeros(DUMMY_BATCH_SIZE, self.device)
            for d in (*self.args_schema, *self.kwargs_schema.values())
        ]
        with torch.no_grad():
            args, kwargs = self._split(inputs)
            outputs = self.module(*args, **kwargs)
        as_tuple = isinstance(outputs, (tuple, list))
        outputs = tuple(outputs) if as_tuple else (outputs,)
        return tuple(BatchTensorDescriptor.from_tensor(t) for t in outputs), as_tuple

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs for a batch of inputs (args then kwargs in schema order), without grad."""
        device = self.device
        with torch.no_grad():
            outputs = self._call([t.to(device, non_blocking=True) for t in inputs])
        if (index := first_nonfinite(outputs)) is not None:
            raise NonFiniteError(
                f"expert {self.name!r}: output {index} of this batch holds NaN or inf; refused"
            )
        return tuple(t.detach().cpu() for t in outputs)

    def backward(self, *inputs_and_grad_outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Gradients for the inputs whose descriptor requires grad; then one optimizer step."""
        n_inputs = len(self.args_schema) + len(self.kwargs_schema)
        device = self.device
        inputs = [t.to(device) for t in inputs_and_grad_outputs[:n_inputs]]
        grad_outputs = [t.to(device) for t in inputs_and_grad_outputs[n_inputs:]]
        descriptors = (*self.args_schema, *self.kwargs_schema.values())
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(d.requires_grad) for t, d in zip(inputs, descriptors)]
            outputs = self._call(inputs)
            pairs = [
                (out, grad) for out, grad in zip(outputs, grad_outputs, strict=True) if out.requires_grad
            ]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        grads = tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)).detach().cpu()
            for t, d in zip(inputs, descriptors)
            if d.requires_grad
        )
        parameter_grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        for what, tensors in (("a parameter gradient", parameter_grads), ("an input gradient", grads)):
            if first_nonfinite(tensors) is not None:
                for param in self.module.parameters():
                    param.grad = None
                raise NonFiniteError(
                    f"expert {self.name!r}: {what} of this batch holds NaN or inf; refused, "
                    f"no optimizer step taken"
                )
        self.on_backward(inputs[0].shape[0] if inputs else 0)
        return grads

    def on_backward(self, batch_size: int) -> None:
        """Train on the gradients the backward just accumulated (override for custom updates)."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def get_pools(self) -> tuple[TaskPool, TaskPool]:
        return self.forward_pool, self.backward_pool

    def get_info(self) -> dict:
        """The schemas, in hivemind's `info` keys (see ExpertSchema.as_dict)."""
        return self.schema.as_dict()

    def state_dict(self) -> dict:
        state = {"module": self.module.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def __repr__(self) -> str:
        return f"<ModuleBackend {self.name} {type(self.module).__name__} on {self.device}>"
