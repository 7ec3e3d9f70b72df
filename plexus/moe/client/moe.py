"""RemoteMixtureOfExperts: a layer whose experts are found in the DHT and run on other peers.

For each sample, a linear gate scores every coordinate of the expert grid; a beam search through
the DHT finds the `k_best` experts with the highest summed scores; the sample goes to all of them
at once; the answers are averaged with softmax weights over the experts that answered. Gradients
flow to the gate (through the weights) and to the experts (the servers train on them).

`forward_timeout` bounds the whole forward call, beam search included (hivemind's covered only
the expert calls, its issue #125); `backward_timeout` bounds the whole backward call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from ...compression.wire import DTYPE_NAMES
from ...utils.background_loop import get_background_loop
from ...utils.logging import get_logger
from ..expert_registry import learn_addresses
from ..expert_uid import UID_DELIMITER, ExpertInfo
from ..messages import ExpertSchema
from .beam_search import MoEBeamSearcher
from .call_many import GRACE, MixtureCall, RemoteCallMany
from .expert import DEFAULT_TIMEOUT, DUMMY, get_expert_schema
from .quorum import TooFewExpertsError

logger = get_logger(__name__)

SCHEMA_CANDIDATES = 4  # experts asked at once for the common schema


class RemoteMixtureOfExperts(nn.Module):
    """A mixture-of-experts layer over a grid of remote experts (hivemind's arguments, keyword-only).

    Args:
        in_features: size of the last input dimension, which the gate reads.
        grid_size: experts per grid dimension, e.g. (4, 16).
        dht: a running plexus.DHT; expert calls go through its host.
        uid_prefix: the grid's name, e.g. "ffn." (experts are `ffn.i.j`).
        k_best: experts each sample is sent to.
        k_min: answers each sample needs; fewer raises TooFewExpertsError.
        forward_timeout: bound on the whole forward in seconds, beam search included (None: only
            each RPC's own timeout).
        timeout_after_k_min: once every sample has k_min answers, how much longer to wait for the rest.
        backward_k_min: backward answers each sample needs (at most as many as answered forward).
        backward_timeout: bound on the whole backward.
        detect_anomalies: refuse NaN/Inf inputs; treat NaN/Inf answers as failures.
        allow_zero_outputs: return zeros instead of raising when no expert at all answered.
        **dht_kwargs: to MoEBeamSearcher (negative_caching, cache_expiration, num_workers).
    """

    def __init__(
        self,
        *,
        in_features: int,
        grid_size: Sequence[int],
        dht,
        uid_prefix: str,
        k_best: int,
        k_min: int = 1,
        forward_timeout: float | None = None,
        timeout_after_k_min: float | None = None,
        backward_k_min: int = 1,
        backward_timeout: float | None = None,
        detect_anomalies: bool = False,
        allow_zero_outputs: bool = False,
        **dht_kwargs,
    ):
        super().__init__()
        if not 0 <= k_min <= k_best or not 0 <= backward_k_min <= k_best:
            raise ValueError(
                f"need 0 <= k_min ({k_min}) <= k_best ({k_best}) and 0 <= backward_k_min "
                f"({backward_k_min}) <= k_best"
            )
        self.dht = dht
        self.beam_search = MoEBeamSearcher(dht, uid_prefix, grid_size, **dht_kwargs)
        self.k_best, self.k_min, self.backward_k_min = k_best, k_min, backward_k_min
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_timeout = backward_timeout
        self.detect_anomalies, self.allow_zero_outputs = detect_anomalies, allow_zero_outputs
        self.proj = nn.Linear(in_features, sum(self.beam_search.grid_size))
        self._schema: ExpertSchema | None = None

    @property
    def grid_size(self) -> tuple[int, ...]:
        return self.beam_search.grid_size

    @property
    def uid_prefix(self) -> str:
        return self.beam_search.uid_prefix

    @property
    def info(self) -> dict | None:
        """The experts' schema in hivemind's keys (None until the first forward)."""
        return None if self._schema is None else self._schema.as_dict()

    # --- forward ------------------------------------------------------------------------------------

    def forward(self, input: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor):
        deadline = None if self.forward_timeout is None else time.monotonic() + self.forward_timeout
        grid_scores = self.proj(self._gating_input(input)).split(self.grid_size, dim=-1)
        chosen, schema = self._find_experts(grid_scores, deadline)
        mask, expert_outputs = self._call_experts(chosen, schema, deadline, input, args, kwargs)
        outputs = self._average(expert_outputs, self.expert_weights(grid_scores, chosen, mask))
        return outputs if schema.outputs_tuple else outputs[0]

    @staticmethod
    def _gating_input(input: torch.Tensor) -> torch.Tensor:
        """The gate reads one vector per sample: middle dimensions are averaged."""
        return input.mean(dim=tuple(range(1, input.ndim - 1))) if input.ndim > 2 else input

    def _find_experts(
        self,
        grid_scores: Sequence[torch.Tensor],
        deadline: float | None,
    ) -> tuple[list[list[ExpertInfo]], ExpertSchema]:
        """Beam search and (once) the experts' schema: one trip to the loop, bounded by the deadline."""
        per_dimension = (scores.detach().float().cpu().tolist() for scores in grid_scores)
        samples = [list(per_sample) for per_sample in zip(*per_dimension)]
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return get_background_loop().run(
            self._find_experts_async(samples, remaining), None if remaining is None else remaining + GRACE
        )

    async def _find_experts_async(self, samples, timeout: float | None):
        node = self.dht.node
        phase = "beam search"
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                chosen = await self.beam_search.batch_find_best_experts_async(node, samples, self.k_best)
                short = [i for i, experts in enumerate(chosen) if len(experts) < self.k_min]
                if short:
                    raise TooFewExpertsError(
                        f"beam search found only {len(chosen[short[0]])} experts under {self.uid_prefix!r} for "
                        f"sample {short[0]} ({len(short)} samples in all), fewer than k_min={self.k_min}; are "
                        f"enough expert servers announcing this grid {self.grid_size} in this DHT?"
                    )
                phase = "finding the experts' servers"
                await learn_addresses(node, self.dht.host, [e.peer_id for experts in chosen for e in experts])
                if self._schema is None:
                    phase = "fetching the experts' schema"
                    self._schema = await self._fetch_schema(chosen, timeout)
        except TimeoutError:
            if not deadline.expired():
                raise  # e.g. TooFewExpertsError: not ours to rename
            raise TimeoutError(
                f"forward_timeout of {self.forward_timeout} s passed during {phase} in "
                f"{self.uid_prefix!r}; the DHT or the experts are slow or "
                f"unreachable"
            ) from None
        return chosen, self._schema

    async def _fetch_schema(self, chosen: list[list[ExpertInfo]], timeout: float | None) -> ExpertSchema:
        candidates = list(dict.fromkeys(e for experts in chosen for e in experts))[:SCHEMA_CANDIDATES]
        if not candidates:
            raise TooFewExpertsError(
                f"beam search found no experts under {self.uid_prefix!r} (grid "
                f"{self.grid_size}); is an expert server announcing them in this DHT?"
            )
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        tasks = [asyncio.ensure_future(get_expert_schema(self.dht.host, e, timeout)) for e in candidates]
        errors = []
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    return await next_done
                except Exception as error:  # try the next expert
                    errors.append(error)
        finally:
            for task in tasks:
                task.cancel()
        raise TooFewExpertsError(
            f"none of {len(candidates)} experts answered a schema request: "
            f"{'; '.join(f'{type(e).__name__}: {e}' for e in errors[:3])}"
        )

    def _call_experts(
        self, chosen, schema, deadline, input, args, kwargs
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The remote calls: a [batch, k] mask of who answered and each output as [batch, k, ...]."""
        if len(args) != len(schema.args_schema) - 1 or set(kwargs) != set(schema.kwargs_names):
            raise TypeError(
                f"the experts take {len(schema.args_schema)} positional tensors and keywords "
                f"{list(schema.kwargs_names)}, got {1 + len(args)} and {sorted(kwargs)}"
            )
        flat_inputs = [input, *args, *(kwargs[name] for name in schema.kwargs_names)]
        for index, (tensor, descriptor) in enumerate(zip(flat_inputs, schema.inputs_schema)):
            dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
            problem = descriptor.mismatch(tuple(tensor.shape), dtype)
            if problem is not None:
                raise ValueError(
                    f"input {index} of the mixture has {problem}, as the experts under "
                    f"{self.uid_prefix!r} declare"
                )
        call = MixtureCall(
            self.dht.host,
            schema,
            chosen,
            self.k_min,
            self.backward_k_min,
            self.timeout_after_k_min,
            deadline,
            self.backward_timeout,
            self.detect_anomalies,
            self.allow_zero_outputs,
        )
        mask, *expert_outputs = RemoteCallMany.apply(DUMMY, call, *flat_inputs)
        return mask, expert_outputs

    @staticmethod
    def _average(expert_outputs: list[torch.Tensor], weights: torch.Tensor) -> list[torch.Tensor]:
        """Weighted sums over the k slots (a non-float output takes the first slot's value)."""
        return [
            torch.einsum("bk,bk...->b...", weights.to(t.dtype), t) if t.is_floating_point() else t[:, 0]
            for t in expert_outputs
        ]

    # --- gating -------------------------------------------------------------------------------------

    def chosen_coordinates(
        self, chosen: list[list[ExpertInfo]], device=None, dims: int | None = None
    ) -> torch.Tensor:
        """[batch, k, dims] grid coordinates of the chosen experts (0 in empty slots). The coordinates
        are read from the uids, which must have `dims` of them (default: the grid's)."""
        k = max((len(experts) for experts in chosen), default=0)
        start, dims = len(self.uid_prefix), len(self.grid_size) if dims is None else dims
        padding = [0] * dims
        rows = []
        for experts in chosen:
            row = [[int(c) for c in expert.uid[start:].split(UID_DELIMITER)] for expert in experts]
            if any(len(coordinates) != dims for coordinates in row):
                raise ValueError(
                    f"expected uids {self.uid_prefix}<{dims} coordinates>, got "
                    f"{[expert.uid for expert in experts]}"
                )
            rows.append(row + [padding] * (k - len(experts)))
        return torch.tensor(rows, dtype=torch.long, device=device).view(len(chosen), k, dims)

    def compute_expert_scores(
        self, grid_scores: Sequence[torch.Tensor], chosen: list[list[ExpertInfo]]
    ) -> torch.Tensor:
        """[batch, k] logits of the chosen experts: the sums of their coordinates' gate scores, one
        [batch, size] score tensor per coordinate of their uids."""
        coordinates = self.chosen_coordinates(chosen, grid_scores[0].device, dims=len(grid_scores))
        total = sum(scores.gather(1, coordinates[..., dim]) for dim, scores in enumerate(grid_scores))
        return cast(torch.Tensor, total)  # a grid has at least one dimension, so never sum()'s 0

    def expert_weights(self, grid_scores, chosen, mask: torch.Tensor) -> torch.Tensor:
        """Softmax over the experts that answered; all-zero for a sample none answered."""
        logits = self.compute_expert_scores(grid_scores, chosen)
        any_alive = mask.any(dim=1, keepdim=True)
        logits = torch.where(mask, logits, torch.full_like(logits, float("-inf")))
        logits = torch.where(any_alive, logits, torch.zeros_like(logits))  # keeps softmax finite
        return torch.softmax(logits, dim=1) * mask

    def extra_repr(self) -> str:
        return (
            f"uid_prefix={self.uid_prefix!r}, grid_size={self.grid_size}, k_best={self.k_best}, "
            f"k_min={self.k_min}, forward_timeout={self.forward_timeout}"
        )
