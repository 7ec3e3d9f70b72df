"""A peer that is itself a `torch.distributed` job (torchrun, DDP): one identity in the swarm, many ranks."""

from .job import Job
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "Job"]
