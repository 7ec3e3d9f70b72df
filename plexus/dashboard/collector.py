"""The dashboard's picture of the swarm, built from what this node reads in the DHT.

No I/O and no clock: the server hands in the progress records it fetched (`{run_id}_progress`,
the records `plexus.optim.progress_tracker` publishes), what its host knows of each peer, and the
time. A record that is malformed, stale, or not signed by the peer it names is skipped and counted,
never fatal: anyone may write garbage into a DHT key.

Peers are those with a fresh progress record (they train) and those in this node's routing table
(DHT peers); each row says which. The global epoch is the highest epoch more than half of the
non-client trainers reached (the tracker's rule, without its check of claims ahead of it). The
ETA divides the samples still missing by the swarm's speed; the target batch is the one given,
or else estimated as the most samples the swarm counted in the epoch before the current one.
"""

import math
from collections import deque
from dataclasses import dataclass

import pydantic

from ..optim.progress_tracker import LocalTrainingProgress, ProgressBounds, broken_bound, signer_of

MAX_ADDRESSES_SHOWN = 8
MAX_PEERS_SHOWN = 500  # rows in the table; the counts in the header still cover everyone
MAX_REJECTIONS_NAMED = 16  # signers named per read for breaking a bound; all are counted


@dataclass(frozen=True)
class PeerSighting:
    """What this node's host and routing table know of one peer (gathered on the DHT's loop)."""

    peer_id: str
    addresses: tuple[str, ...] = ()
    connected: bool = False
    relayed: bool = False
    """Our live connections to it all go through a relay."""
    last_seen: float | None = None
    """DHT time of its last sign of life in our routing table (None: not in it)."""


@dataclass(frozen=True)
class NodeInfo:
    """This node itself: the one serving the dashboard."""

    peer_id: str
    addresses: tuple[str, ...]
    reachability: str
    nat_mode: str
    routing_table_size: int


@dataclass(frozen=True)
class ProgressReading:
    """The fresh, well-formed, correctly signed records of one read, by peer id, and how many were not."""

    reports: dict[str, LocalTrainingProgress]
    ignored: int
    rejected: tuple[tuple[str, str], ...] = ()
    """(signer, what is wrong) for signed records that break a bound (stale ones are just old)."""


def read_progress(found, now: float, stale_after: float, bounds: ProgressBounds) -> ProgressReading:
    """Sort `dht.get(f"{run_id}_progress", latest=True)` into usable records and skipped ones."""
    reports: dict[str, LocalTrainingProgress] = {}
    ignored, rejected = 0, list[tuple[str, str]]()
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return ProgressReading(reports, 0 if found is None else 1)
    for subkey, entry in entries.items():
        value, expiration = _unpack(entry)
        if value is None:
            continue  # a peer that left says so with None
        try:
            report = LocalTrainingProgress.model_validate(value)
        except pydantic.ValidationError:
            ignored += 1
            continue
        signer = signer_of(subkey, report)
        broken = None if expiration is None else broken_bound(report, signer, expiration, bounds, now)
        if expiration is None or broken is not None or now - report.time > stale_after:
            ignored += 1
            if broken is not None and signer is not None and len(rejected) < MAX_REJECTIONS_NAMED:
                rejected.append((str(signer), broken[1]))
            continue
        reports[str(signer)] = report
    return ProgressReading(reports, ignored, tuple(rejected))


def _unpack(entry) -> tuple[object, float | None]:
    try:
        value, expiration = entry
    except (TypeError, ValueError):
        return entry, None
    if not isinstance(expiration, int | float) or not math.isfinite(expiration):
        return value, None
    return value, float(expiration)


def nat_label(report: LocalTrainingProgress | None, sighting: PeerSighting | None) -> str:
    """How the peer is reached: client (dials out only), relayed, direct, or unknown."""
    if report is not None and report.client_mode:
        return "client"
    if sighting is None:
        return "unknown"
    if sighting.connected:
        return "relayed" if sighting.relayed else "direct"
    if sighting.addresses and all("/p2p-circuit" in addr for addr in sighting.addresses):
        return "relayed"
    return "direct" if sighting.addresses else "unknown"


def majority_epoch(reports: list[LocalTrainingProgress]) -> int:
    """The highest epoch that more than half of the non-client peers reached (clients if none)."""
    workers = [r.epoch for r in reports if not r.client_mode] or [r.epoch for r in reports]
    if not workers:
        return 0
    return sorted(workers, reverse=True)[len(workers) // 2]


class SwarmCollector:
    """Keeps the latest reading and a bounded history; `state()` is the JSON the page shows."""

    def __init__(
        self,
        run_id: str | None,
        *,
        target_batch_size: int | None = None,
        stale_after: float = 30.0,
        history: int = 900,
        max_steps: int = 2000,
        bounds: ProgressBounds = ProgressBounds(),
    ):
        if target_batch_size is not None and target_batch_size <= 0:
            raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
        if stale_after <= 0 or history < 1 or max_steps < 1:
            raise ValueError("stale_after must be positive, history and max_steps at least 1")
        self.run_id, self.target_batch_size = run_id, target_batch_size
        self.stale_after, self.bounds, self.history_length = stale_after, bounds, history
        self.progress_key = None if run_id is None else f"{run_id}_progress"
        self._reading = ProgressReading({}, 0)
        self._sightings: dict[str, PeerSighting] = {}
        self._node: NodeInfo | None = None
        self._observed_at: float | None = None
        self._history: deque[tuple[float, float | None, int, int]] = deque(maxlen=history)
        self._steps: deque[tuple[int, float, float, float]] = deque(maxlen=max_steps)
        self._epoch, self._epoch_peak = 0, 0
        self._estimated_target: int | None = None

    def observe(
        self, now: float, reading: ProgressReading, sightings: list[PeerSighting], node: NodeInfo
    ) -> None:
        """Take one read of the swarm (every refresh period)."""
        self._reading, self._node, self._observed_at = reading, node, now
        self._sightings = {s.peer_id: s for s in sightings}
        epoch, samples, speed = self._progress(now)
        if epoch != self._epoch:
            if epoch == self._epoch + 1 and self._epoch_peak > 0:
                self._estimated_target = self._epoch_peak  # what the swarm gathered before stepping
            self._epoch, self._epoch_peak = epoch, 0
        self._epoch_peak = max(self._epoch_peak, samples)
        self._history.append((now, speed, epoch, len(reading.reports)))

    def record_step(self, step: int, loss: float, samples_per_second: float, time: float) -> None:
        """A global step's loss, from the training monitor's metrics (steps arrive in order)."""
        if self._steps and step <= self._steps[-1][0]:
            return
        if all(math.isfinite(x) for x in (loss, samples_per_second, time)):
            self._steps.append((int(step), float(loss), float(samples_per_second), float(time)))

    def _progress(self, now: float) -> tuple[int, int, float | None]:
        """The global epoch, its samples, and the swarm's speed (None where huge claims overflow it)."""
        reports = list(self._reading.reports.values())
        epoch = majority_epoch(reports)
        samples = sum(r.samples_accumulated for r in reports if r.epoch == epoch)
        return epoch, samples, _finite(sum(r.samples_per_second for r in reports))

    def state(self, now: float, history: int | None = None, warnings: list[dict] | tuple = ()) -> dict:
        """Everything the page shows, as plain JSON types (finite numbers only)."""
        reports = self._reading.reports
        epoch, samples, speed = self._progress(now)
        target = self.target_batch_size or self._estimated_target
        extrapolated = _finite(
            sum(
                r.samples_accumulated + max(0.0, now - r.time) * r.samples_per_second
                for r in reports.values()
                if r.epoch == epoch
            )
        )
        eta = None
        if target and speed and extrapolated is not None:
            eta = _finite(max(0.0, target - extrapolated) / speed)
        peers = [self._peer_row(peer_id, now) for peer_id in reports.keys() | self._sightings.keys()]
        peers.sort(key=lambda row: (row["status"] != "training", row["peer_id"]))
        points = list(self._history)
        if history is not None:
            points = points[len(points) - history :] if history > 0 else []
        return dict(
            run_id=self.run_id,
            time=now,
            observed_at=self._observed_at,
            node=None if self._node is None else _node_dict(self._node),
            swarm=dict(
                epoch=epoch,
                samples_accumulated=samples,
                target_batch_size=target,
                target_estimated=self.target_batch_size is None and target is not None,
                samples_per_second=speed,
                eta_seconds=eta,
                trainers=sum(not r.client_mode for r in reports.values()),
                clients=sum(r.client_mode for r in reports.values()),
                dht_peers=len(self._sightings),
                ignored_records=self._reading.ignored,
            ),
            peers=peers[:MAX_PEERS_SHOWN],
            history=[dict(time=t, samples_per_second=s, epoch=e, peers=p) for t, s, e, p in points],
            loss=[dict(step=st, loss=lo, samples_per_second=sp, time=t) for st, lo, sp, t in self._steps],
            warnings=list(warnings),
        )

    def _peer_row(self, peer_id: str, now: float) -> dict:
        report, sighting = self._reading.reports.get(peer_id), self._sightings.get(peer_id)
        seen = [report.time] if report is not None else []
        if sighting is not None and sighting.last_seen is not None:
            seen.append(sighting.last_seen)
        if report is not None:
            status = "training"
        elif sighting is not None and sighting.connected:
            status = "connected"
        else:
            status = "known"
        return dict(
            peer_id=peer_id,
            status=status,
            addresses=list(sighting.addresses[:MAX_ADDRESSES_SHOWN]) if sighting else [],
            nat=nat_label(report, sighting),
            client_mode=None if report is None else report.client_mode,
            epoch=None if report is None else report.epoch,
            samples_accumulated=None if report is None else report.samples_accumulated,
            samples_per_second=None if report is None else report.samples_per_second,
            last_seen_ago=max(0.0, now - max(seen)) if seen else None,
        )


def _node_dict(node: NodeInfo) -> dict:
    return dict(
        peer_id=node.peer_id,
        addresses=list(node.addresses[:MAX_ADDRESSES_SHOWN]),
        reachability=node.reachability,
        nat_mode=node.nat_mode,
        routing_table_size=node.routing_table_size,
    )


def _finite(value: float) -> float | None:
    """JSON has no inf or NaN: a sum that overflowed (records claiming ~1e308 samples/s) shows as None."""
    return float(value) if math.isfinite(value) else None
