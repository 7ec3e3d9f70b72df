"""The collaborative optimizer of the DeDLOC/sahajBERT era, as a thin layer over `plexus.Optimizer`.

Scripts of that time build `CollaborativeOptimizer(opt=..., dht=..., prefix=..., target_batch_size=...,
batch_size_per_step=...)` and call `step()` after every backward pass; peers take a global step
together once the swarm has accumulated `target_batch_size` samples. Here the swarm's work is done
by today's classes (ProgressTracker, the gradient and state averagers): gradients are averaged at
each global step and parameters with optimizer statistics right after it, the same outcome as the
old single round over both. What this layer adds is the old vocabulary: `local_step`,
`is_synchronized`, `collaboration_state` (a `CollaborationState`) and its log line,

    Collaboration accumulated 4056 samples from 2 peers; ETA 0.75 seconds (refresh in 0.50s.)

and the old constructor's names (`compression_type`, `throughput`, `averaging_expiration`, ...).
Old options that name the gRPC transport of the time (`listen`, `listen_on`, `endpoint`) have no
meaning over libp2p; they are accepted and reported once.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ..compression import BASE_COMPRESSION_TYPES, CompressionBase, CompressionType
from ..dht.dht import DHT
from ..optim.optimizer import Optimizer
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time

logger = get_logger(__name__)

TRACKER_OPTIONS = (
    "min_refresh_period",
    "max_refresh_period",
    "default_refresh_period",
    "expected_drift_peers",
    "expected_drift_rate",
    "metadata_expiration",
)
RENAMED_AVERAGER_OPTIONS = {"throughput": "bandwidth", "compression_type": "compression"}
TRANSPORT_OPTIONS = ("listen", "listen_on", "endpoint")


@dataclasses.dataclass
class CollaborationState:
    """The swarm as one peer last saw it: the global step and how far the next one is."""

    optimizer_step: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_step: float
    next_fetch_time: float

    @property
    def ready_for_step(self) -> bool:
        return self.samples_accumulated >= self.target_batch_size or get_dht_time() >= self.eta_next_step

    def register_step(self, local_step: int) -> None:
        """This peer took step `local_step`: its count starts over."""
        self.optimizer_step = max(local_step, self.optimizer_step)
        self.samples_accumulated = 0
        self.eta_next_step = float("inf")


def as_compression(compression) -> CompressionBase:
    """A compression method from an old-style CompressionType value (or a method, passed through)."""
    if isinstance(compression, CompressionBase):
        return compression
    return BASE_COMPRESSION_TYPES[CompressionType(compression).name]


class CollaborativeOptimizer(Optimizer):
    """`CollaborativeOptimizer(opt, dht=dht, prefix="run", target_batch_size=4096, batch_size_per_step=32)`.

    Args (the old names):
        opt: the local torch optimizer (its parameters are the model's).
        prefix: the experiment's name; peers with the same prefix train together.
        step_tolerance: how many global steps behind a peer may be before it reloads the state.
        averaging_expiration: seconds to look for a group before each averaging (matchmaking_time).
        averaging_timeout: the longest one averaging round may take (default 60 s).
        min_refresh_period ... metadata_expiration: how the swarm's progress is read (ProgressTracker).
        verbose: log the collaboration state and every step at INFO.
        **kwargs: for the averagers (target_group_size, bandwidth or throughput, compression or
            compression_type, min_group_size, request_timeout, part_size_bytes, ...).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        *,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        scheduler=None,
        averaging_timeout: float | None = None,
        averaging_expiration: float | None = None,
        load_state_timeout: float = 600.0,
        step_tolerance: int = 1,
        reuse_grad_buffers: bool = False,
        client_mode: bool = False,
        verbose: bool = False,
        **kwargs,
    ):
        tracker_opts = {name: kwargs.pop(name) for name in TRACKER_OPTIONS if name in kwargs}
        for old, new in RENAMED_AVERAGER_OPTIONS.items():
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
        for name in [name for name in TRANSPORT_OPTIONS if name in kwargs]:
            kwargs.pop(name)
            logger.info(f"CollaborativeOptimizer({name}=...) has no meaning over libp2p; ignored")
        if not kwargs.pop("start", True):
            logger.info("CollaborativeOptimizer(start=False): it starts at once all the same")
        compressions = {}
        if "compression" in kwargs:
            method = as_compression(kwargs.pop("compression"))
            compressions = dict(grad_compression=method, state_averaging_compression=method)
        matchmaking_time = kwargs.pop("min_matchmaking_time", averaging_expiration)
        super().__init__(
            dht=dht,
            run_id=prefix,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            optimizer=opt,
            scheduler=scheduler,
            client_mode=client_mode,
            reuse_grad_buffers=reuse_grad_buffers,
            matchmaking_time=matchmaking_time if matchmaking_time is not None else 5.0,
            averaging_timeout=averaging_timeout if averaging_timeout is not None else 60.0,
            load_state_timeout=load_state_timeout,
            verbose=verbose,
            averager_opts=kwargs,
            tracker_opts={"status_loglevel": logging.DEBUG, **tracker_opts},  # the old line replaces its own
            **compressions,
        )
        self.prefix, self.step_tolerance = prefix, step_tolerance
        self._logged_fetch = -1

    @property
    def local_step(self) -> int:
        return self.local_epoch

    @property
    def averager(self):
        """The averager that holds the parameters and optimizer state (today's TrainingStateAverager)."""
        return self.state_averager

    @property
    def performance_ema(self):
        return self.tracker.performance_ema

    @property
    def local_samples_accumulated(self) -> int:
        return self.tracker.local_progress.samples_accumulated

    @property
    def collaboration_state(self) -> CollaborationState:
        progress = self.tracker.global_progress
        return CollaborationState(
            progress.epoch,
            progress.samples_accumulated,
            self.target_batch_size,
            progress.num_peers,
            progress.num_clients,
            progress.eta_next_epoch,
            progress.next_fetch_time,
        )

    def fetch_collaboration_state(self) -> CollaborationState:
        """Read every peer's progress from the DHT now (instead of waiting for the next refresh)."""
        self.tracker.fetch_global_progress_now()
        self._log_collaboration_state()
        return self.collaboration_state

    @property
    def is_synchronized(self) -> bool:
        return self.local_step >= self.collaboration_state.optimizer_step - self.step_tolerance

    def is_alive(self) -> bool:
        return self.dht.is_alive()

    def step(self, batch_size: int | None = None, **kwargs):
        """Count `batch_size` samples (default: batch_size_per_step) of accumulated gradients; join
        the global step when the swarm is ready. Returns what today's Optimizer.step returns."""
        result = super().step(batch_size=batch_size, **kwargs)
        self._log_collaboration_state()
        return result

    def _log_collaboration_state(self) -> None:
        """The old status line, once per reading of the swarm's progress."""
        if self.tracker.fetch_count == self._logged_fetch:
            return
        self._logged_fetch = self.tracker.fetch_count
        state, now = self.collaboration_state, get_dht_time()
        if state.num_peers == 0:
            logger.log(self.status_loglevel, "Found no active peers: None")
            return
        eta = max(0.0, state.eta_next_step - now) if math.isfinite(state.eta_next_step) else float("inf")
        logger.log(
            self.status_loglevel,
            f"Collaboration accumulated {state.samples_accumulated} samples from "
            f"{state.num_peers} peers; "
            f"ETA {eta:.2f} seconds (refresh in {max(0.0, state.next_fetch_time - now):.2f}s.)",
        )

    def __repr__(self) -> str:
        return f"<CollaborativeOptimizer {self.prefix} step={self.local_step} over {type(self.opt).__name__}>"


__all__ = ["CollaborationState", "CollaborativeOptimizer"]
