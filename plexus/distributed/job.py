"""The ranks of one peer's `torch.distributed` job, and the few collectives a peer needs among them.

Every collective here waits at most `timeout` seconds (`Work.wait(timeout)`), so a rank that
stalls cannot hold the others forever; a rank that dies closes its connections, and the others
fail at once. Either way the collective raises `RankFailed`. After that the process group is in
an undefined state: the job is over, as with any failed collective in torch.

Tensors travel on their own device (CPU with gloo, CUDA with NCCL), coalesced into buckets of
one dtype and device, so a model's parameters take a handful of broadcasts rather than one each.
"""

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import RankFailed, UsageError

BUCKET_BYTES = 32 * 2**20  # coalesce at most this much into one broadcast (a temporary copy)


class Job:
    """The process group of one peer, seen from one of its ranks; rank 0 of the group is the leader."""

    def __init__(self, process_group=None, *, timeout: float):
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(
                "plexus.distributed needs an initialised process group: launch with torchrun and call "
                "torch.distributed.init_process_group(backend, timeout=...) first"
            )
        if not timeout > 0:
            raise UsageError(f"timeout must be positive, got {timeout}")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = dist.get_backend(process_group)
        self.leader = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self.timeout = timeout
        self.bytes_broadcast = 0
        """Bytes of tensors that went through this job's broadcasts (each counted once, as the leader sent it)."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this job's small control tensors live: NCCL moves CUDA tensors only."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, tensors: Sequence[torch.Tensor], phase: str) -> None:
        """The leader's `tensors` into everyone's (in place), waiting at most `timeout` in all."""
        if self.world_size == 1:
            return
        deadline = datetime.timedelta(seconds=self.timeout)
        for bucket in _buckets(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket]) if len(bucket) > 1 else None
            target = flat if flat is not None else bucket[0].detach()
            self.bytes_broadcast += target.numel() * target.element_size()
            try:
                work = dist.broadcast(target, src=self.leader, group=self.group, async_op=True)
                work.wait(deadline)
            except RuntimeError as error:  # gloo and NCCL report a lost or late rank as RuntimeError
                raise self._failure(phase, error) from error
            if flat is not None and not self.is_leader:
                with torch.no_grad():
                    offset = 0
                    for tensor in bucket:
                        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                        offset += tensor.numel()

    def _failure(self, phase: str, error: BaseException) -> RankFailed:
        lost = "rank 0 (the leader)" if not self.is_leader else "another rank"
        timed_out = "timed out" in str(error).lower()
        what = f"did not answer within {self.timeout:.0f} s" if timed_out else "is gone"
        return RankFailed(
            f"{lost} of this job {what} during {phase}; rank {self.rank} stops: {error}",
            rank=None if self.is_leader else 0,
            phase=phase,
        )


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype and device, each at most BUCKET_BYTES (or one larger tensor)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1] if buckets else None
        nbytes = tensor.numel() * tensor.element_size()
        if (
            last is None
            or (last[0].dtype, last[0].device) != (tensor.dtype, tensor.device)
            or size + nbytes > BUCKET_BYTES
        ):
            buckets.append([tensor])
            size = nbytes
        else:
            last.append(tensor)
            size += nbytes
    return buckets
