"""`TrainingAverager`: hivemind's legacy helper that averages an optimizer's parameters, gradients
and statistics with peers, one blocking `step()` at a time.

A step copies the local tensors into the averager's float32 CPU buffers (under the caller's
`data_lock`, if any), averages them with a group, and folds the result back with the delta rule,
``local += averaged - copied``, so updates the training loop made while the round ran are kept.
The lock is held only for the two copies, never across the round. Newcomers download the
parameters and the optimizer state (`get_current_state`, `load_state_from_peers`).

For new code prefer `TrainingStateAverager` (epochs, offloading, delayed steps) or
`plexus.averaging.background` (periodic averaging of a model in a thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..averaging.averager import DecentralizedAverager
from ..compression import CompressionInfo, TensorRole
from ..utils.logging import get_logger
from .optimizer_state import (
    flatten_optimizer_state,
    initialize_optimizer_state,
    optimizer_parameters,
    unflatten_optimizer_state,
)

logger = get_logger(__name__)


class TrainingAverager(DecentralizedAverager):
    """Averages `opt`'s parameters and/or gradients, chosen statistics and extra tensors.

    Args:
        opt: the local torch optimizer; its parameters are the model's.
        average_parameters: average the parameters.
        average_gradients: average the gradients.
        average_opt_statistics: optimizer state keys to average too (e.g. ``("exp_avg_sq",)``).
        extra_tensors: more tensors to average (e.g. batch-norm statistics).
        parameter_names: names for compression infos.
        initialize_optimizer: create the statistics now with a zero-gradient step (model unchanged).
        **averager_kwargs: `prefix`, `start`, `target_group_size`, ... for DecentralizedAverager.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        *,
        average_parameters: bool,
        average_gradients: bool,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        parameter_names: Sequence[str] | None = None,
        initialize_optimizer: bool = True,
        **averager_kwargs,
    ):
        self.opt, self.extra_tensors, self.local_step = opt, tuple(extra_tensors), 0
        self.average_parameters, self.average_gradients = average_parameters, average_gradients
        self.opt_statistics = tuple(average_opt_statistics)
        params = optimizer_parameters(opt)
        self.parameter_names = tuple(parameter_names or (f"param{i}" for i in range(len(params))))
        if len(self.parameter_names) != len(params):
            raise ValueError(f"{len(self.parameter_names)} parameter_names for {len(params)} parameters")
        if initialize_optimizer:
            initialize_optimizer_state(opt)
        if average_gradients:
            for param in params:  # the buffers must exist to be averaged
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        self._step_lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="training-averager")
        with torch.no_grad():
            averaged = [t.detach().to("cpu", torch.float32, copy=True) for t in self.local_tensors()]
        super().__init__(averaged, tensor_infos=self._tensor_infos(averaged), **averager_kwargs)

    def local_tensors(self) -> list[torch.Tensor]:
        """The tensors averaged, in order: parameters, gradients, statistics, extra tensors."""
        params = optimizer_parameters(self.opt)
        tensors = list(params) if self.average_parameters else []
        if self.average_gradients:
            for param in params:
                if param.grad is None:
                    raise RuntimeError(
                        "a parameter lost its .grad (set_to_none?); average_gradients needs "
                        "gradient buffers: use opt.zero_grad(set_to_none=False)"
                    )
                tensors.append(param.grad)
        for key in self.opt_statistics:
            tensors.extend(self.opt.state[param][key] for param in params)
        return [*tensors, *self.extra_tensors]

    def _tensor_infos(self, buffers: Sequence[torch.Tensor]) -> list[CompressionInfo]:
        """Infos of the float32 buffers, keyed and tagged by what each holds."""
        names, keys = self.parameter_names, []
        if self.average_parameters:
            keys += [(name, TensorRole.PARAMETER) for name in names]
        if self.average_gradients:
            keys += [((name, "grad"), TensorRole.GRADIENT) for name in names]
        for stat in self.opt_statistics:
            keys += [((name, stat), TensorRole.OPTIMIZER) for name in names]
        keys += [(i, TensorRole.UNSPECIFIED) for i in range(len(self.extra_tensors))]
        return [
            CompressionInfo.from_tensor(buffer, key=key, role=role)
            for buffer, (key, role) in zip(buffers, keys)
        ]

    def step(self, data_lock: Any = None, wait: bool = True, **kwargs):
        """Average once; returns the group's {peer_id: gathered} (or a future of it with `wait=False`).

        `data_lock` (e.g. the training loop's `threading.Lock`) is held while the local tensors are
        read and written back. `kwargs` go to `DecentralizedAverager.step` (timeout, weight, gather).
        Raises AveragingError when no round succeeded; the local tensors are then left alone.
        """
        if not wait:
            return self._executor.submit(self.step, data_lock, True, **kwargs)
        data_lock = data_lock if data_lock is not None else contextlib.nullcontext()
        with self._step_lock:
            with torch.no_grad(), data_lock, self.get_tensors() as averaged:
                local = self.local_tensors()
                if len(local) != len(averaged):
                    raise RuntimeError(
                        f"the number of averaged tensors changed: {len(local)} != {len(averaged)}"
                    )
                for buffer, tensor in zip(averaged, local):
                    buffer.copy_(tensor)
                copied = [buffer.clone() for buffer in averaged]
            gathered = super().step(**kwargs)
            with torch.no_grad(), data_lock, self.get_tensors() as averaged:
                for tensor, buffer, old in zip(self.local_tensors(), averaged, copied):
                    tensor.add_(buffer.sub(old).to(tensor.device, tensor.dtype))
            self.local_step += 1
            return gathered

    def get_current_state(self):
        """Parameters and optimizer state, with {step, group_bits, optimizer_metadata}."""
        optimizer_metadata, optimizer_tensors = flatten_optimizer_state(self.opt)
        params = optimizer_parameters(self.opt)
        metadata = dict(
            step=self.local_step, group_bits=self.get_group_bits(), optimizer_metadata=optimizer_metadata
        )
        infos = [
            CompressionInfo.from_tensor(p, key=n, role=TensorRole.PARAMETER)
            for p, n in zip(params, self.parameter_names)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(optimizer_tensors)
        ]
        return metadata, [*params, *optimizer_tensors], infos

    @torch.no_grad()
    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        """Download parameters and optimizer state and adopt them; False if nobody shares state.

        Raises StateDownloadError when the download failed, ValueError when the state does not
        fit this model and optimizer.
        """
        if not wait:
            return self._executor.submit(self.load_state_from_peers, True, timeout)
        loaded = super().load_state_from_peers(wait=True, timeout=timeout)
        if loaded is None:
            return False
        metadata, tensors = loaded
        params = optimizer_parameters(self.opt)
        if not isinstance(metadata, dict) or len(tensors) < len(params):
            raise ValueError("the donor's state does not fit this optimizer")
        for param, new in zip(params, tensors):
            if param.shape != new.shape:
                raise ValueError(
                    f"a donor parameter has shape {tuple(new.shape)}, ours is {tuple(param.shape)}"
                )
        state = unflatten_optimizer_state(
            metadata.get("optimizer_metadata"), tensors[len(params) :], self.opt
        )
        with self.get_tensors():
            for param, new in zip(params, tensors):
                param.copy_(new)
            self.opt.load_state_dict(state)
            step = metadata.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.local_step = max(self.local_step, step)
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
