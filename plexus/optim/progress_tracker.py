"""How far the swarm is towards its next global epoch, from signed progress reports in the DHT.

Each peer publishes, under `{prefix}_progress` and a sub-key that is exactly its own public key
(`[owner:...]`, one entry per owner), its epoch, the samples it accumulated for that epoch and its
speed. The records are signed and schema-checked: nobody can write another peer's entry, and a
plain value can neither replace nor shadow the signed entries (see dht/schema.py, "protected"
keys). Every peer reads them all and derives the global epoch, the samples accumulated towards it,
and when the target batch will be reached; it re-reads sooner as that moment approaches. A live
peer re-publishes at least every `max_refresh_period`, so records older than a few periods are
ignored: a dead peer stops counting within seconds.

A signature only says who wrote a record, not that it is true, so readers trust no single report:
- Bounds (`ProgressBounds`). A record must name the peer that signed it, be stamped within
  `max_clock_skew` of the reader's clock, expire within `max_expiration` of its stamp, and claim
  at most `max_samples_factor` x target samples and `max_epochs_per_second` x target samples a
  second. Anything else is ignored and logged once with the peer id (storing nodes refuse what
  needs no clock to check). Our own record is clamped to the bounds before it is published.
- Robust sums. Another peer's samples and speed count at most `outlier_factor` times the lower
  median over the peers at that epoch (ours included): one report cannot move the count or the
  ETA by more than a few honest peers' worth, however large it is.
- Believed epochs. The global epoch is the highest epoch that more than half of the non-client
  peers (ourselves included) have reached. A peer alone ahead of that (a peer that just stepped,
  a swarm a newcomer joins, or a forger) is believed only after its claim stood for
  `epoch_claim_grace` seconds and its state server confirmed it: asked for a manifest (the
  state-sharing protocol under `state_prefix`), it states a priority (its epoch) of at least the
  claim. Without `state_prefix` such claims are never believed. Until it is checked, such a peer
  still counts as a peer (we may be in the round it just stepped in), but not its samples; once
  its claim failed the check it counts for nothing, so it neither moves the epoch nor holds up
  rounds, and it is asked about again at most every `max_refresh_period`.

Records signed with an RSA key (`private_key=RSAPrivateKey(...)`, as hivemind's trackers sign) name
no libp2p peer id, so nothing ties their `peer_id` to their signer: only trackers that sign with RSA
themselves accept them, and in such a run a member can claim another's peer id.

Both loops run on the DHT's event loop; the training thread only calls cheap, thread-safe methods.
"""

import asyncio
import base64
import contextlib
import logging
import threading
from dataclasses import dataclass

import pydantic

from ..averaging.state_download import stated_priority
from ..dht.crypto import OWNER_PATTERN, Ed25519SignatureValidator
from ..dht.dht import DHT
from ..dht.routing import DHTID
from ..dht.rsa import OWNER_PATTERN as RSA_OWNER
from ..dht.rsa import RSAPrivateKey, RSASignatureValidator
from ..dht.schema import OwnerPublicKey, SchemaValidator
from ..dht.validation import DHTRecord, RecordValidatorBase
from ..p2p.identity import IdentityError, PeerID, PrivateKey, PublicKey
from ..utils.logging import RateLimitedLog, eta_text, get_logger
from ..utils.performance_ema import PerformanceEMA
from ..utils.serializer import MSGPackSerializer, SerializationError
from ..utils.timing import get_dht_time

logger = get_logger(__name__)

STALE_AFTER_PERIODS = 3
FIRST_REPORT_TIMEOUT = 10.0
MAX_CONCURRENT_PROBES = 4  # state servers asked at once about claims ahead of the majority


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
    progress: dict[OwnerPublicKey, LocalTrainingProgress | None]


@dataclass(frozen=True)
class ProgressBounds:
    """What one peer's progress record may claim (see the module docstring); `ProgressTracker(bounds=...)`."""

    max_clock_skew: float = 10.0
    """Seconds a record's `time` may be ahead of the reader's clock (older records go stale anyway)."""
    max_expiration: float = 300.0
    """Seconds a record may live past its `time`; the tracker's `metadata_expiration` must be shorter."""
    max_samples_factor: float = 4.0
    """A record claims at most this many times `target_batch_size` samples for one epoch."""
    max_epochs_per_second: float = 1000.0
    """A record claims a speed of at most this many times `target_batch_size` samples a second."""
    outlier_factor: float = 4.0
    """Another peer's samples and speed count at most this many times the peers' lower median."""

    def __post_init__(self):
        if not (
            self.max_clock_skew >= 0
            and self.max_expiration > 0
            and self.max_samples_factor >= 1
            and self.max_epochs_per_second > 0
            and self.outlier_factor >= 1
        ):
            raise ValueError(f"invalid {self}: skew >= 0, expiration > 0, factors >= 1, speed > 0")


def signer_of(
    subkey, report: "LocalTrainingProgress | None" = None, rsa_records: bool = False
) -> PeerID | None:
    """The peer whose key a progress sub-key names (None if it names none).

    An RSA key (hivemind's records, accepted only by trackers that sign with RSA themselves) names
    no libp2p peer: its record's `peer_id` is taken as stated."""
    match = OWNER_PATTERN.fullmatch(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        if rsa_records and report is not None and isinstance(subkey, bytes) and RSA_OWNER.fullmatch(subkey):
            with contextlib.suppress(IdentityError, ValueError):
                return PeerID(report.peer_id)
        return None
    try:
        public_key = PublicKey.from_protobuf(base64.b64decode(match.group(1), validate=True))
    except (IdentityError, ValueError):
        return None
    return PeerID.from_public_key(public_key)


def broken_bound(
    report: "LocalTrainingProgress",
    signer: PeerID | None,
    expiration_time: float,
    bounds: ProgressBounds,
    now: float | None = None,
) -> tuple[str, str] | None:
    """(the bound, what is wrong) for a record that breaks one, else None. Without `now` only the
    checks that need no clock are made (what a storing node can tell)."""
    if signer is None or report.peer_id != signer.to_bytes():
        return "peer_id", "its peer_id is not the key that signed it"
    if expiration_time - report.time > bounds.max_expiration:
        return "max_expiration", (
            f"it expires {expiration_time - report.time:.0f} s after its time "
            f"(at most {bounds.max_expiration})"
        )
    if now is not None and report.time > now + bounds.max_clock_skew:
        return "max_clock_skew", (
            f"its time is {report.time - now:.0f} s ahead of ours (at most {bounds.max_clock_skew})"
        )
    return None


class _ProgressRecordValidator(RecordValidatorBase):
    """Storing nodes refuse progress records that name another peer than their signer, or that
    live longer than the bounds allow."""

    def __init__(self, key: str, bounds: ProgressBounds, rsa_records: bool = False):
        self.key_id, self.bounds, self.rsa_records = (
            DHTID.generate(source=key).to_bytes(),
            bounds,
            rsa_records,
        )

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id or record.subkey == MSGPackSerializer.dumps(None):
            return True  # other keys, and plain values (the schema refuses those here)
        try:
            value = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
        except SerializationError:
            return False
        if value is None:
            return True  # a peer that left
        report = _parse(value)
        if report is None:
            return False
        signer = signer_of(subkey, report, self.rsa_records)
        return broken_bound(report, signer, record.expiration_time, self.bounds) is None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, _ProgressRecordValidator) and (
            other.key_id,
            other.bounds,
            other.rsa_records,
        ) == (self.key_id, self.bounds, self.rsa_records)


@dataclass(frozen=True)
class GlobalTrainingProgress:
    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float


def progress_validators(
    prefix: str,
    signer: RecordValidatorBase,
    bounds: ProgressBounds = ProgressBounds(),
    rsa_records: bool = False,
) -> list[RecordValidatorBase]:
    """What a DHT needs to store and read `{prefix}_progress` records (a tracker adds them itself; a
    reader that publishes nothing, such as a dashboard, adds them with its own `signer`)."""
    return [
        signer,
        SchemaValidator(TrainingProgressSchema, prefix=prefix),
        _ProgressRecordValidator(f"{prefix}_progress", bounds, rsa_records),
    ]


class ProgressTracker:
    """Publishes this peer's progress and keeps an estimate of the whole swarm's."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool | None = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10.0,
        default_refresh_period: float = 3.0,
        expected_drift_peers: float = 3,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        status_loglevel: int = logging.DEBUG,
        start: bool = True,
        bounds: ProgressBounds = ProgressBounds(),
        state_prefix: str | None = None,
        epoch_claim_grace: float | None = None,
        private_key: PrivateKey | RSAPrivateKey | None = None,
    ):
        """`bounds`: what a peer's record may claim. `state_prefix`: where peers serve their training
        state (the Optimizer passes its state averager's prefix), to check a peer's claim to be ahead
        of the majority's epoch, once it stood for `epoch_claim_grace` seconds (default:
        `max_refresh_period`). `private_key` signs this peer's records: the DHT's own Ed25519
        identity by default, or the key given (an Ed25519 PrivateKey, or an RSAPrivateKey as
        hivemind's records use; see the module docstring for what RSA records cannot prove). See
        the module docstring."""
        if min_refresh_period > max_refresh_period:
            raise ValueError(
                f"min_refresh_period={min_refresh_period} exceeds max_refresh_period={max_refresh_period}"
            )
        if not 0 < metadata_expiration < bounds.max_expiration:
            raise ValueError(
                f"metadata_expiration must be positive and below bounds.max_expiration "
                f"({bounds.max_expiration}), got {metadata_expiration}"
            )
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
        self.bounds, self.state_prefix = bounds, state_prefix
        self.epoch_claim_grace = max_refresh_period if epoch_claim_grace is None else epoch_claim_grace
        self.rsa_records = isinstance(private_key, RSAPrivateKey)
        signer = (
            RSASignatureValidator(private_key)
            if self.rsa_records
            else Ed25519SignatureValidator(private_key or dht.private_key)
        )
        self._subkey = signer.local_public_key
        dht.add_validators(progress_validators(prefix, signer, bounds, self.rsa_records))
        self._rejections = RateLimitedLog(logger)
        self._claims: dict[bytes, tuple[int, float]] = {}  # peer -> (epoch it claims ahead of us, since when)
        self._confirmed: dict[bytes, int] = {}  # peer -> the epoch its state server confirmed
        self._last_probe: dict[bytes, float] = {}  # peer -> when we last asked its state server
        self._refuted: dict[bytes, int] = {}  # peer -> the last epoch it claimed and failed to confirm
        self._probes: dict[bytes, asyncio.Task] = {}
        self._lock = threading.Lock()
        self.local_progress = self._make_local_progress(0, 0)
        self._last_reported_epoch = -1
        self.global_progress = self._solo_progress(get_dht_time())
        self._paused = False
        self._swarm_speed = 0.0
        self.fetch_count = 0
        """How many times the swarm's progress was read (to tell a fresh estimate from an old one)."""
        self._peer_reports: dict[bytes, LocalTrainingProgress] = {}  # peer id -> its record, as last read
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
        for probe in list(self._probes.values()):
            self._loop.call_soon_threadsafe(probe.cancel)
        try:
            self.dht.store(
                self.training_progress_key,
                None,
                get_dht_time() + self.metadata_expiration,
                subkey=self._subkey,
                return_future=True,
            ).result(timeout)
        except Exception as error:  # leaving still succeeds: our record expires on its own
            logger.warning(f"could not tell the swarm that this peer left: {error!r}")

    # --- reporting ---------------------------------------------------------------------------------

    def _make_local_progress(self, epoch: int, samples: int) -> LocalTrainingProgress:
        """Our record, clamped to the bounds so that other peers never ignore it (a fresh speed
        estimate can spike, and a batch larger than the bounds allow is counted as their maximum)."""
        max_samples, max_speed = self._max_samples, self.bounds.max_epochs_per_second * self.target_batch_size
        return LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(),
            epoch=epoch,
            samples_accumulated=min(samples, max_samples),
            samples_per_second=min(float(self.performance_ema.samples_per_second), max_speed),
            time=get_dht_time(),
            client_mode=self.client_mode,
        )

    @property
    def _max_samples(self) -> int:
        return int(self.bounds.max_samples_factor * self.target_batch_size)

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """Record this peer's progress (call after each local step); published shortly after."""
        extra = samples_accumulated - self.local_progress.samples_accumulated
        if (
            update_global_samples
            and local_epoch == self.local_progress.epoch
            and extra > 0
            and not self._paused
        ):
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
                    new_epoch,
                    0,
                    self.target_batch_size,
                    progress.num_peers,
                    progress.num_clients,
                    now + self._eta(0, self._swarm_speed),
                    now + self.min_refresh_period,
                )
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
            await self.dht.node.store(
                self.training_progress_key,
                progress.model_dump(),
                get_dht_time() + self.metadata_expiration,
                subkey=self._subkey,
            )
        except Exception as error:  # the DHT may be briefly unreachable; the next report retries
            logger.debug(f"could not publish training progress: {error!r}")

    # --- fetching ----------------------------------------------------------------------------------

    @property
    def global_epoch(self) -> int:
        """The swarm's epoch as last read (the highest among non-client peers)."""
        return self.global_progress.epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """True when the samples the peers reported reach the target batch, or the swarm moved on.

        Unlike hivemind, the ETA alone never makes a peer ready: it extrapolates reports with the
        peers' speeds, and stepping on a prediction is stepping before the target batch is there.
        The ETA only tells when to start matchmaking and to re-read the reports."""
        progress = self.global_progress
        return (
            progress.epoch > self.local_progress.epoch
            or progress.samples_accumulated >= self.target_batch_size
        )

    @property
    def estimated_next_update_time(self) -> float:
        return self.global_progress.eta_next_epoch

    def peer_progress(self, peer_id: bytes) -> LocalTrainingProgress | None:
        """The record of `peer_id` (its bytes) as the last fetch read it, if it counted then."""
        with self._lock:
            return self._peer_reports.get(peer_id)

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
            for subkey, entry in found.value.items():
                report = _parse(entry.value)
                if (
                    report is not None
                    and report.peer_id != local.peer_id
                    and now - report.time <= STALE_AFTER_PERIODS * self.max_refresh_period
                    and self._within_bounds(report, subkey, entry.expiration_time, now)
                ):
                    reports[report.peer_id] = report
        progress = self._estimate(list(reports.values()), now) if reports else self._solo_progress(now)
        with self._lock:
            self.global_progress = progress
            self.fetch_count += 1
            self._peer_reports = reports
        logger.log(
            self.status_loglevel,
            f"{self.prefix} accumulated {progress.samples_accumulated} samples for epoch #{progress.epoch} "
            f"from {progress.num_peers} peers. ETA {eta_text(progress.eta_next_epoch - now)} "
            f"(refresh in {max(0.0, progress.next_fetch_time - now):.2f} sec)",
        )
        return progress

    def _within_bounds(
        self, report: LocalTrainingProgress, subkey, expiration_time: float, now: float
    ) -> bool:
        max_speed = self.bounds.max_epochs_per_second * self.target_batch_size
        signer = signer_of(subkey, report, self.rsa_records)
        broken = broken_bound(report, signer, expiration_time, self.bounds, now)
        if broken is None and report.samples_accumulated > self._max_samples:
            broken = (
                "max_samples_factor",
                (f"it claims {report.samples_accumulated} samples (at most {self._max_samples})"),
            )
        if broken is None and report.samples_per_second > max_speed:
            broken = (
                "max_epochs_per_second",
                (f"it claims {report.samples_per_second:.3g} samples/s (at most {max_speed})"),
            )
        if broken is not None:
            peer = signer or report.peer_id[:64]
            self._rejections.warning(
                (broken[0], peer), f"ignoring the progress record of {peer}: {broken[1]}"
            )
        return broken is None

    def _estimate(self, reports: list[LocalTrainingProgress], now: float) -> GlobalTrainingProgress:
        local = self.local_progress
        workers = [r for r in reports if not r.client_mode and r.peer_id != local.peer_id]
        epoch = self._believed_epoch(workers, local.epoch, now)
        counted = [r for r in reports if r.epoch <= epoch or self._awaiting_check(r.peer_id, now)]
        current = [r for r in counted if r.epoch == epoch]
        sample_cap = self.bounds.outlier_factor * _lower_median([r.samples_accumulated for r in current])
        speed_cap = self.bounds.outlier_factor * _lower_median([r.samples_per_second for r in counted])

        def clip(report: LocalTrainingProgress, value: float, cap: float) -> float:
            return value if report.peer_id == local.peer_id else min(value, cap)

        speeds = {r.peer_id: clip(r, r.samples_per_second, speed_cap) for r in counted}
        samples = sum(int(clip(r, r.samples_accumulated, sample_cap)) for r in current)
        extrapolated = sum(
            clip(r, r.samples_accumulated + max(0.0, now - r.time) * speeds[r.peer_id], sample_cap)
            for r in current
        )
        speed = self._swarm_speed = sum(speeds.values())  # laggards soon count again
        eta = now + self._eta(extrapolated, speed)
        num_peers = len(counted)
        expected_peers = max(
            num_peers + self.expected_drift_peers, num_peers * (1 + self.expected_drift_rate)
        )
        refresh = min(
            max((eta - now) * num_peers / expected_peers, self.min_refresh_period), self.max_refresh_period
        )
        return GlobalTrainingProgress(
            epoch,
            samples,
            self.target_batch_size,
            num_peers,
            sum(r.client_mode for r in counted),
            eta,
            now + refresh,
        )

    # --- believing epochs ----------------------------------------------------------------------------

    def _believed_epoch(self, workers: list[LocalTrainingProgress], local_epoch: int, now: float) -> int:
        """The highest epoch more than half of the workers (us included) reached, or a higher one
        that the claimer's state server confirmed; other claims ahead are checked (see module docstring)."""
        epochs = sorted([r.epoch for r in workers] + [local_epoch], reverse=True)
        believed = max(local_epoch, epochs[len(epochs) // 2])
        claims = {r.peer_id: r.epoch for r in workers if r.epoch > believed}
        confirmed = [epoch for peer, epoch in claims.items() if self._confirmed.get(peer, -1) >= epoch]
        believed = max([believed, *confirmed])
        standing = {}
        for peer, epoch in claims.items():
            if epoch > believed:  # remember since when it claims this epoch
                previous = self._claims.get(peer)
                standing[peer] = previous if previous is not None and previous[0] == epoch else (epoch, now)
                self._maybe_probe(peer, *standing[peer], now)
        self._claims = standing
        present = {r.peer_id for r in workers}  # forget peers that left (or a Sybil's spent identities)
        for verdicts in (self._confirmed, self._last_probe, self._refuted):
            for peer in [peer for peer in verdicts if peer not in present]:
                del verdicts[peer]
        return believed

    def _awaiting_check(self, peer: bytes, now: float) -> bool:
        """A peer ahead that may just have stepped still counts as a peer (we may be in its round)
        until its claim is checked; a claim that failed the check counts for nothing."""
        claim = self._claims.get(peer)
        return (
            claim is not None
            and self._refuted.get(peer) != claim[0]
            and (now - claim[1] < self.epoch_claim_grace or peer in self._probes)
        )

    def _maybe_probe(self, peer: bytes, epoch: int, since: float, now: float) -> None:
        if (
            self.state_prefix is None
            or now - since < self.epoch_claim_grace
            or peer in self._probes
            or len(self._probes) >= MAX_CONCURRENT_PROBES
            or now - self._last_probe.get(peer, float("-inf")) < self.max_refresh_period
        ):
            return
        self._last_probe[peer] = now
        self._probes[peer] = asyncio.get_running_loop().create_task(self._probe(peer, epoch))

    async def _probe(self, peer: bytes, epoch: int) -> None:
        """Ask the peer's state server which epoch it can serve; believe the claim if that reaches it."""
        try:
            served = await stated_priority(
                self.dht.host, self.state_prefix, PeerID(peer), timeout=self.max_refresh_period
            )
            if served is not None:  # claims up to what it serves are believed from now on
                self._confirmed[peer] = int(served)
                self._notify(self._wake_fetcher)
            if served is None or served < epoch:
                self._refuted[peer] = epoch
                self._rejections.warning(
                    ("epoch", peer),
                    f"not believing that {PeerID(peer)} is at epoch "
                    f"{epoch}: its state server offers {served}",
                )
        finally:
            self._probes.pop(peer, None)

    def _eta(self, samples: float, speed: float) -> float:
        return max(0.0, self.target_batch_size - samples) / max(speed, 1e-9)

    def _solo_progress(self, now: float) -> GlobalTrainingProgress:
        local = self.local_progress
        self._swarm_speed = self.performance_ema.samples_per_second
        return GlobalTrainingProgress(
            local.epoch,
            local.samples_accumulated,
            self.target_batch_size,
            0,
            0,
            now + self._eta(local.samples_accumulated, self.performance_ema.samples_per_second),
            now + self.default_refresh_period,
        )


def _parse(value) -> LocalTrainingProgress | None:
    if value is None:
        return None
    try:
        return LocalTrainingProgress.model_validate(value)
    except pydantic.ValidationError:
        return None


def _lower_median(values: list[float]) -> float:
    """The lower median (inf for no values: nothing to compare with, so no cap)."""
    return sorted(values)[(len(values) - 1) // 2] if values else float("inf")


def _with_extra_samples(progress: GlobalTrainingProgress, extra: int) -> GlobalTrainingProgress:
    return GlobalTrainingProgress(
        progress.epoch,
        progress.samples_accumulated + max(extra, 0),
        progress.target_batch_size,
        progress.num_peers,
        progress.num_clients,
        progress.eta_next_epoch,
        progress.next_fetch_time,
    )
