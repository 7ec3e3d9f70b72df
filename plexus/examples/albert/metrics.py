"""What trainers tell the monitor, and how the monitor turns it into one row per global step.

Each trainer stores one signed record under `{run_id}_metrics`, sub-key = its public key marker
(`[owner:...]`), so no peer can write or erase another's metrics (the same pattern as the
optimizer's progress records). The record carries the trainer's last few global steps, not just
the newest: a monitor that polls every 30 s still sees every step of a swarm that steps every 5 s.

For step N, each trainer reports the mean MLM loss of the micro-batches it ran while the swarm
accumulated that step's batch, how many micro-batches that was, the samples it contributed and its
speed. `StepTable` waits `settle_time` seconds after a step first appears (reports arrive a little
apart), then emits one row: the loss averaged over every micro-batch of every peer, the number of
peers, the samples and the swarm's samples/s.
"""

import dataclasses

import pydantic

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.schema import BytesWithPublicKey, SchemaValidator

HISTORY = 32  # steps each trainer keeps in its record


class StepMetrics(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")
    step: int = pydantic.Field(ge=1)
    loss: float = pydantic.Field(ge=0.0, allow_inf_nan=False)
    mini_steps: int = pydantic.Field(ge=1)
    samples_accumulated: int = pydantic.Field(ge=0)
    samples_per_second: float = pydantic.Field(ge=0.0, allow_inf_nan=False)
    time: float = pydantic.Field(allow_inf_nan=False)


class LocalMetrics(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")
    peer_id: str = pydantic.Field(max_length=128)
    client_mode: bool
    history: list[StepMetrics] = pydantic.Field(max_length=HISTORY)


class MetricSchema(pydantic.BaseModel):
    metrics: dict[BytesWithPublicKey, LocalMetrics | None]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def make_validators(run_id: str, private_key) -> tuple[list, bytes]:
    """Validators to add to the DHT, and the sub-key under which this peer's record is signed."""
    signer = Ed25519SignatureValidator(private_key)
    return [signer, SchemaValidator(MetricSchema, prefix=run_id)], signer.local_public_key


def parse_records(value) -> dict[str, LocalMetrics]:
    """peer_id -> metrics, from the dictionary `dht.get(metrics_key(run_id), latest=True)` returns.
    Malformed entries are skipped (the schema already refuses them on store; this is for old peers)."""
    found = {}
    if value is None or not isinstance(value.value, dict):
        return found
    for entry in value.value.values():
        try:
            metrics = LocalMetrics.model_validate(entry.value)
        except pydantic.ValidationError:
            continue
        found[metrics.peer_id] = metrics
    return found


@dataclasses.dataclass
class StepRow:
    step: int
    loss: float
    alive_peers: int
    samples: int
    samples_per_second: float
    time: float  # when the last report for this step was made (DHT time)


class StepTable:
    """Collects reports per step; `update()` returns the steps that have settled, in order."""

    def __init__(self, settle_time: float):
        self.settle_time = settle_time
        self._reports: dict[int, dict[str, StepMetrics]] = {}
        self._first_seen: dict[int, float] = {}
        self.last_emitted = 0
        self.peers_seen: set[str] = set()

    def update(self, records: dict[str, LocalMetrics], now: float) -> list[StepRow]:
        for peer_id, metrics in records.items():
            for entry in metrics.history:
                if entry.step > self.last_emitted:
                    self._reports.setdefault(entry.step, {})[peer_id] = entry
                    self._first_seen.setdefault(entry.step, now)
                    self.peers_seen.add(peer_id)
        return self._emit(lambda step: now - self._first_seen[step] >= self.settle_time)

    def flush(self) -> list[StepRow]:
        """Every pending step, settled or not (at shutdown)."""
        return self._emit(lambda step: True)

    def _emit(self, settled) -> list[StepRow]:
        rows = []
        for step in sorted(self._reports):
            if not settled(step):
                break  # later steps wait for this one: rows stay in order
            reports = list(self._reports.pop(step).values())
            del self._first_seen[step]
            mini_steps = sum(r.mini_steps for r in reports)
            rows.append(
                StepRow(
                    step=step,
                    loss=sum(r.loss * r.mini_steps for r in reports) / mini_steps,
                    alive_peers=len(reports),
                    samples=sum(r.samples_accumulated for r in reports),
                    samples_per_second=sum(r.samples_per_second for r in reports),
                    time=max(r.time for r in reports),
                )
            )
            self.last_emitted = step
        return rows
