"""How far the swarm is towards its next global epoch, from signed progress reports in the DHT.

Each peer publishes, under `{prefix}_progress` and a sub-key that names its own public key, its
epoch, the samples it accumulated for that epoch and its speed. The records are signed (nobody can
write or erase another peer's progress) and schema-checked (malformed ones are dropped on store and
on fetch). Every peer reads them all, and derives the global epoch (the highest among non-client
peers), the samples accumulated towards it, and when the target batch will be reached; it re-reads
sooner as that moment approaches. A live peer re-publishes at least every `max_refresh_period`,
so records older than a few periods are ignored: a dead peer stops counting within seconds.

Both loops run on the DHT's event loop; the training thread only calls cheap, thread-safe methods.
"""

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass

import pydantic

from ..dht.crypto import Ed25519SignatureValidator
from ..dht.dht import DHT
from ..dht.rsa import RSAPrivateKey, RSASignatureValidator
from ..dht.schema import BytesWithPublicKey, SchemaValidator
from ..p2p.identity import PrivateKey
from ..utils.logging import get_logger
from ..utils.performance_ema import PerformanceEMA
from ..utils.timing import get_dht_time

logger = get_logger(__name__)

STALE_AFTER_PERIODS = 3
FIRST_REPORT_TIMEOUT = 10.0


class LocalTrainingProgress(pydantic.BaseModel):
    """What one peer says about itself; strict types, no coercion."""

    model_config = pydantic.ConfigDict(strict=True, extra="forbid")
    peer_id: bytes
    epoch: int = pydantic.Field(ge=0)
    samples_accumulated: int = pydantic.Field(ge=0)
    samples_per_second: float = pydantic.Field(ge=0.0, allow_inf_nan=False)
    time: float = pydantic.Field(allow_inf_nan=False)
    client_mode: bool


class TrainingProgressSchema(pydantic.BaseModel):
    progress: dict[BytesWithPublicKey, LocalTrainingProgress | None]


@dataclass(frozen=True)
class GlobalTrainingProgress:
    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float


class ProgressTracker:
    """Publishes this peer's progress and keeps an estimate of the whole swarm's."""

    def __init__(self, dht: DHT, prefix: str, target_batch_size: int, *, client_mode: bool | None = None,
                 min_refresh_period: float = 0.5, max_refresh_period: float = 10.0,
                 default_refresh_period: float = 3.0, expected_drift_peers: float = 3,
                 expected_drift_rate: float = 0.2, performance_ema_alpha: float = 0.1,
                 metadata_expiration: float = 60.0, status_loglevel: int = logging.DEBUG, start: bool = True,
                 private_key: PrivateKey | RSAPrivateKey | None = None):
        """`private_key` signs this peer's records: the DHT's own Ed25519 identity by default, or
        the key given (an Ed25519 PrivateKey, or an RSAPrivateKey as hivemind's records use)."""
        if min_refresh_period > max_refresh_period:
            raise ValueError(f"min_refresh_period={min_refresh_period} exceeds "
                             f"max_refresh_period={max_refresh_period}")
        # hivemind accepts a default outside [min, max] (tracker_opts often set only max): clip it
        default_refresh_period = min(max(default_refresh_period, min_refresh_period), max_refresh_period)
        self.dht, self.prefix, self.target_batch_size = dht, prefix, target_batch_size
        self.client_mode = dht.client_mode if client_mode is None else client_mode
        self.min_refresh_period, self.max_refresh_period = min_refresh_period, max_refresh_period
        self.default_refresh_period = default_refresh_period
        self.expected_drift_peers, self.expected_drift_rate = expected_drift_peers, expected_drift_rate
        self.metadata_expiration, self.status_loglevel = metadata_expiration, status_loglevel
        self.training_progress_key = f"{prefix}_progress"
        self.performance_ema = PerformanceEMA(alpha=performance_ema_alpha)
        signer = (RSASignatureValidator(private_key) if isinstance(private_key, RSAPrivateKey)
                  else Ed25519SignatureValidator(private_key or dht.private_key))
        self._subkey = signer.local_public_key
        dht.add_validators([signer, SchemaValidator(TrainingProgressSchema, prefix=prefix)])
        self._lock = threading.Lock()
        self.local_progress = self._make_local_progress(0, 0)
        self._last_reported_epoch = -1
        self.global_progress = self._solo_progress(get_dht_time())
        self._paused = False
        self._swarm_speed = 0.0
        self.fetch_count = 0
        """How many times the swarm's progress was read (to tell a fresh estimate from an old one)."""
        self._loop = dht._background.loop
        self._wake_reporter = self._wake_fetcher = None
        self._tasks: list = []
        if start:
            self.start()

    # --- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.run_coroutine_threadsafe(self._start_loops(), self._loop).result()]

    async def _start_loops(self) -> asyncio.Task:
        self._wake_reporter, self._wake_fetcher = asyncio.Event(), asyncio.Event()
        # announce ourselves before start() returns: a peer that starts with us and looks at the
        # swarm after we started counts us in, instead of running solo epochs (bounded wait)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_REPORT_TIMEOUT):
                await self._publish(self.local_progress)
        return asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        await asyncio.gather(self._report_loop(), self._fetch_loop())

    def is_alive(self) -> bool:
        """Whether the reporting and fetching loops still run (until `shutdown`)."""
        return bool(self._tasks) and not self._tasks[0].done()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop both loops and tell the swarm we left (stores None under our sub-key)."""
        if not self._tasks:
            return
        task = self._tasks.pop()
        self._loop.call_soon_threadsafe(task.cancel)
        try:
            self.dht.store(self.training_progress_key, None, get_dht_time() + self.metadata_expiration,
                           subkey=self._subkey, return_future=True).result(timeout)
        except Exception as error:  # leaving still succeeds: our record expires on its own
            logger.warning(f"could not tell the swarm that this peer left: {error!r}")

    # --- reporting ---------------------------------------------------------------------------------

    def _make_local_progress(self, epoch: int, samples: int) -> LocalTrainingProgress:
        return LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(), epoch=epoch, samples_accumulated=samples,
            samples_per_second=float(self.performance_ema.samples_per_second), time=get_dht_time(),
            client_mode=self.client_mode,
        )

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True) -> None:
        """Record this peer's progress (call after each local step); published shortly after."""
        extra = samples_accumulated - self.local_progress.samples_accumulated
        if update_global_samples and local_epoch == self.local_progress.epoch and extra > 0 and not self._paused:
            self.performance_ema.update(extra)
        with self._lock:
            self.local_progress = self._make_local_progress(local_epoch, samples_accumulated)
            if update_global_samples and local_epoch == self.global_progress.epoch:
                self.global_progress = _with_extra_samples(self.global_progress, extra)
        self._notify(self._wake_reporter)

    def update_epoch(self, new_epoch: int) -> int:
        """Move this peer to `new_epoch` with no samples yet; publish it and refresh at once."""
        with self._lock:
            self.local_progress = self._make_local_progress(new_epoch, 0)
            progress = self.global_progress
            if new_epoch > progress.epoch:
                now = get_dht_time()
                self.global_progress = GlobalTrainingProgress(
                    new_epoch, 0, self.target_batch_size, progress.num_peers, progress.num_clients,
                    now + self._eta(0, self._swarm_speed), now + self.min_refresh_period)
        self._notify(self._wake_reporter)
        self._notify(self._wake_fetcher)
        return new_epoch

    @contextlib.contextmanager
    def pause_updates(self):
        """While averaging or loading state: keep the speed estimate honest by not counting this time."""
        self._paused = True
        try:
            with self.performance_ema.pause():
                yield
        finally:
            self._paused = False

    def _notify(self, event: asyncio.Event | None) -> None:
        if event is not None:
            self._loop.call_soon_threadsafe(event.set)

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.max_refresh_period):
                    await self._wake_reporter.wait()
            self._wake_reporter.clear()
            with self._lock:
                progress = self.local_progress.model_copy(update={"time": get_dht_time()})
            # a peer that has not trained for two epochs (idle, auxiliary) stays out of the count
            if progress.samples_accumulated == 0 and progress.epoch > self._last_reported_epoch + 1:
                continue
            if progress.samples_accumulated > 0:
                self._last_reported_epoch = progress.epoch
            await self._publish(progress)
            await asyncio.sleep(self.min_refresh_period)  # rate limit, not synchronisation

    async def _publish(self, progress: LocalTrainingProgress) -> None:
        try:
            await self.dht.node.store(self.training_progress_key, progress.model_dump(),
                                      get_dht_time() + self.metadata_expiration, subkey=self._subkey)
        except Exception as error:  # the DHT may be briefly unreachable; the next report retries
            logger.debug(f"could not publish training progress: {error!r}")

    # --- fetching ----------------------------------------------------------------------------------

    @property
    def global_epoch(self) -> int:
        """The swarm's epoch as last read (the highest among non-client peers)."""
        return self.global_progress.epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """True when the swarm reached the target batch (or the deadline for it), or moved on."""
        progress = self.global_progress
        return (progress.epoch > self.local_progress.epoch
                or progress.samples_accumulated >= self.target_batch_size
                or get_dht_time() >= progress.eta_next_epoch)

    @property
    def estimated_next_update_time(self) -> float:
        return self.global_progress.eta_next_epoch

    def fetch_global_progress_now(self, timeout: float | None = None) -> GlobalTrainingProgress:
        return asyncio.run_coroutine_threadsafe(self._fetch(), self._loop).result(timeout)

    async def _fetch_loop(self) -> None:
        while True:
            try:
                await self._fetch()
            except Exception as error:
                logger.debug(f"could not fetch training progress: {error!r}")
            delay = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake_fetcher.wait()
            self._wake_fetcher.clear()

    async def _fetch(self) -> GlobalTrainingProgress:
        found = await self.dht.node.get(self.training_progress_key, latest=True)
        now = get_dht_time()
        with self._lock:
            local = self.local_progress
        reports = {local.peer_id: local} if local.samples_accumulated > 0 or local.epoch > 0 else {}
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                report = _parse(entry.value)
                if (report is not None and report.peer_id != local.peer_id
                        and now - report.time <= STALE_AFTER_PERIODS * self.max_refresh_period):
                    reports[report.peer_id] = report
        progress = self._estimate(list(reports.values()), now) if reports else self._solo_progress(now)
        with self._lock:
            self.global_progress = progress
            self.fetch_count += 1
        logger.log(self.status_loglevel,
                   f"{self.prefix} accumulated {progress.samples_accumulated} samples for epoch #{progress.epoch} "
                   f"from {progress.num_peers} peers. ETA {max(0.0, progress.eta_next_epoch - now):.2f} sec "
                   f"(refresh in {max(0.0, progress.next_fetch_time - now):.2f} sec)")
        return progress

    def _estimate(self, reports: list[LocalTrainingProgress], now: float) -> GlobalTrainingProgress:
        workers = [r for r in reports if not r.client_mode] or reports
        epoch = max(max(r.epoch for r in workers), self.local_progress.epoch)
        current = [r for r in reports if r.epoch == epoch]
        samples = sum(r.samples_accumulated for r in current)
        extrapolated = sum(r.samples_accumulated + max(0.0, now - r.time) * r.samples_per_second for r in current)
        speed = self._swarm_speed = sum(r.samples_per_second for r in reports)  # laggards soon count again
        eta = now + self._eta(extrapolated, speed)
        num_peers = len(reports)
        expected_peers = max(num_peers + self.expected_drift_peers, num_peers * (1 + self.expected_drift_rate))
        refresh = min(max((eta - now) * num_peers / expected_peers, self.min_refresh_period), self.max_refresh_period)
        return GlobalTrainingProgress(epoch, samples, self.target_batch_size, num_peers,
                                      sum(r.client_mode for r in reports), eta, now + refresh)

    def _eta(self, samples: float, speed: float) -> float:
        return max(0.0, self.target_batch_size - samples) / max(speed, 1e-9)

    def _solo_progress(self, now: float) -> GlobalTrainingProgress:
        local = self.local_progress
        self._swarm_speed = self.performance_ema.samples_per_second
        return GlobalTrainingProgress(
            local.epoch, local.samples_accumulated, self.target_batch_size, 0, 0,
            now + self._eta(local.samples_accumulated, self.performance_ema.samples_per_second),
            now + self.default_refresh_period)


def _parse(value) -> LocalTrainingProgress | None:
    if value is None:
        return None
    try:
        return LocalTrainingProgress.model_validate(value)
    except pydantic.ValidationError:
        return None


def _with_extra_samples(progress: GlobalTrainingProgress, extra: int) -> GlobalTrainingProgress:
    return GlobalTrainingProgress(progress.epoch, progress.samples_accumulated + max(extra, 0),
                                  progress.target_batch_size, progress.num_peers, progress.num_clients,
                                  progress.eta_next_epoch, progress.next_fetch_time)
