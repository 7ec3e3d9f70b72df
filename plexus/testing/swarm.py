"""`LocalSwarm`: a swarm of `plexus.Optimizer` peers in local processes, with churn and faults on demand.

    from plexus.testing import ChurnSchedule, LocalSwarm, Silent

    schedule = ChurnSchedule.random_kills(duration=120, num_peers=4, every=(15, 25), seed=0)
    with LocalSwarm(4, optimizer=dict(target_batch_size=256, matchmaking_time=2.0),
                    faults={3: Silent(after=30)}) as swarm:
        report = swarm.run(120, schedule)
    print(report.table())

Each peer is a process started with `spawn` (no fork: torch and threads do not survive one), with
its own DHT on 127.0.0.1, bootstrapped from peers that are up. A killed peer gets SIGKILL, as a
crash or an OOM kill would; a restarted one is a new process with a new identity (incarnation),
which must catch up with the swarm. Peers report to the harness over a pipe each (see
`swarm_peer`), and a collector thread gathers the reports; `SwarmReport` turns them into figures.

Closing stops every peer (it finishes its step and leaves the swarm), waits up to `stop_timeout`
seconds, then kills what is left and counts it: a peer that does not stop when asked is a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_connections

from .faults import Fault
from .report import ChurnRecord, SwarmReport
from .swarm_peer import STOP, Finished, PeerSpec, Ready, Silenced, run_peer
from .tasks import RegressionTask

DEFAULT_OPTIMIZER_OPTIONS = dict(
    target_batch_size=4096,
    matchmaking_time=2.0,
    averaging_timeout=30.0,
    tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=1.0, default_refresh_period=0.3),
)
"""Options given to each peer's `plexus.Optimizer` unless `LocalSwarm(optimizer=...)` overrides them:
a fast tracker, so the swarm sees joins and deaths within seconds."""


@dataclass(frozen=True)
class ChurnEvent:
    """`action` on peer `peer`, `at` seconds after `LocalSwarm.run` begins.

    Actions: "kill" (SIGKILL), "restart" (a new process in the peer's slot, if it is down),
    "start" (the slot's first process, for staggered joins), "stop" (a graceful leave)."""

    at: float
    action: str
    peer: int

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown churn action {self.action!r}; use one of {sorted(ACTIONS)}")
        if self.at < 0 or self.peer < 0:
            raise ValueError(f"a churn event needs a time and a peer index >= 0, got {self}")


ACTIONS = {"kill", "restart", "start", "stop"}


@dataclass(frozen=True)
class ChurnSchedule:
    """A list of `ChurnEvent`s, in time order."""

    events: tuple[ChurnEvent, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda event: event.at)))

    @classmethod
    def random_kills(
        cls,
        duration: float,
        num_peers: int,
        *,
        every: tuple[float, float] = (15.0, 25.0),
        restart_after: tuple[float, float] = (2.0, 5.0),
        start_after: float = 10.0,
        victims: Sequence[int] | None = None,
        seed: int = 0,
    ) -> ChurnSchedule:
        """Kill one random peer every `every` seconds (uniform in the range), from `start_after` on,
        and restart it `restart_after` seconds later; at most one peer is down at a time.

        `victims`: the peers that may be killed (default: all)."""
        rng = random.Random(seed)
        candidates = list(range(num_peers) if victims is None else victims)
        events, now = [], start_after
        while candidates:
            now += rng.uniform(*every)
            if now >= duration:
                break
            victim = rng.choice(candidates)
            back = now + rng.uniform(*restart_after)
            events.append(ChurnEvent(now, "kill", victim))
            if back < duration:
                events.append(ChurnEvent(back, "restart", victim))
        return cls(tuple(events))

    @classmethod
    def staggered_joins(cls, num_peers: int, every: float, first: int = 1) -> ChurnSchedule:
        """Peers `first`..num_peers-1 join one by one, `every` seconds apart (start them with
        `LocalSwarm.start(peers=range(first))`)."""
        return cls(tuple(ChurnEvent(every * (i - first + 1), "start", i) for i in range(first, num_peers)))

    def __add__(self, other: ChurnSchedule) -> ChurnSchedule:
        return ChurnSchedule(self.events + other.events)


class LocalSwarm:
    """Peers 0..num_peers-1 training one model together, each in its own process on 127.0.0.1.

    Args:
        num_peers: peer slots; `start()` starts them (or some of them).
        task: what they train (default `RegressionTask()`); it also sets each peer's batch size.
        optimizer: options for each peer's `plexus.Optimizer`, over `DEFAULT_OPTIMIZER_OPTIONS`.
        faults: a `Fault` per peer index (the others are honest). A restarted peer keeps its fault.
        run_id: the swarm's `run_id` (the DHT prefix its records live under).
        report_parameters: peers send their parameters with each transition, not only a digest
            (for comparisons with a reference; keep the model small).
        ready_timeout: how long a peer may take to start (spawn, import torch, join the DHT).
        stop_timeout: how long a peer may take to stop when asked before it is killed and counted.
        log_level: the peers' Plexus log level (their stderr), e.g. "DEBUG"; None leaves them quiet.
        max_lifetime: a peer stops by itself after this many seconds (a crashed harness leaves no
            process behind for longer).
    """

    def __init__(
        self,
        num_peers: int,
        *,
        task: RegressionTask | None = None,
        optimizer: Mapping | None = None,
        faults: Mapping[int, Fault] | None = None,
        run_id: str = "local_swarm",
        report_parameters: bool = False,
        ready_timeout: float = 120.0,
        stop_timeout: float = 30.0,
        log_level: str | None = None,
        max_lifetime: float = 3600.0,
    ):
        if num_peers < 1:
            raise ValueError(f"a swarm needs at least one peer, got {num_peers}")
        self.num_peers, self.task = num_peers, task or RegressionTask()
        self.optimizer_options = {**DEFAULT_OPTIMIZER_OPTIONS, **(optimizer or {})}
        self.faults = {index: faults[index] for index in faults or {}}
        for index in self.faults:
            if not 0 <= index < num_peers:
                raise ValueError(f"fault for peer {index}, but the swarm has peers 0..{num_peers - 1}")
        self.run_id, self.report_parameters, self.log_level = run_id, report_parameters, log_level
        self.ready_timeout, self.stop_timeout, self.max_lifetime = ready_timeout, stop_timeout, max_lifetime
        self._context = multiprocessing.get_context("spawn")
        self._processes: dict[int, multiprocessing.Process] = {}  # the slot's current process
        self._incarnations = [0] * num_peers
        self._all_processes: dict[tuple[int, int], multiprocessing.Process] = {}  # by (index, incarnation)
        self._conns: dict = {}  # (index, incarnation) -> the harness's end of that process's pipe
        self._maddrs: dict[int, tuple[str, ...]] = {}  # live peers' addresses, for bootstrapping
        self._messages: list = []
        self._churn: list[ChurnRecord] = []
        self._silenced: set[tuple[int, int]] = set()
        self._changed = threading.Condition()
        self._closing = threading.Event()
        self._collector = threading.Thread(target=self._collect, name="local-swarm-collector", daemon=True)
        self._collector.start()
        self._forced_kills: list[tuple[int, int]] = []
        self._leftovers: list[int] = []
        self.started_at = time.monotonic()
        self._closed = False

    # --- peers ---------------------------------------------------------------------------------------

    def start(self, peers: Sequence[int] | None = None) -> None:
        """Start the given peer slots (default: all) and wait until each is up. The first peer started
        bootstraps the others."""
        for index in range(self.num_peers) if peers is None else peers:
            self.spawn(index)

    def spawn(self, index: int, wait: bool = True) -> None:
        """Start a new process in slot `index` (which must be down), bootstrapped from live peers."""
        if self.is_alive(index):
            raise RuntimeError(f"peer {index} is still running")
        incarnation = self._incarnations[index] = self._incarnations[index] + 1
        parent_end, child_end = self._context.Pipe(duplex=True)
        initial_peers = tuple(
            addr for i, maddrs in sorted(self._maddrs.items()) if self.is_alive(i) for addr in maddrs
        )
        spec = PeerSpec(
            index,
            incarnation,
            self.run_id,
            self.task,
            dict(self.optimizer_options),
            self.faults.get(index, Fault()),
            initial_peers,
            self.report_parameters,
            self.log_level,
            self.max_lifetime,
        )
        process = self._context.Process(
            target=run_peer, args=(spec, child_end), daemon=True, name=f"plexus-peer-{index}.{incarnation}"
        )
        process.start()
        child_end.close()
        with self._changed:
            self._processes[index] = process
            self._all_processes[index, incarnation] = process
            self._conns[index, incarnation] = parent_end
            self._churn.append(ChurnRecord(time.monotonic(), "spawn", index, incarnation))
            self._changed.notify_all()
        if wait:
            self.wait_for(
                lambda: self._is_ready(index, incarnation) or not process.is_alive(),
                self.ready_timeout,
                f"peer {index}.{incarnation} to start",
            )
            if not process.is_alive():
                raise RuntimeError(
                    f"peer {index}.{incarnation} exited while starting (code {process.exitcode})"
                )

    def kill(self, index: int) -> None:
        """SIGKILL the peer in slot `index` (no goodbye, no cleanup: a crash)."""
        process = self._processes.get(index)
        if process is None or not process.is_alive():
            return
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        with self._changed:
            self._maddrs.pop(index, None)
            self._churn.append(ChurnRecord(time.monotonic(), "kill", index, self._incarnations[index]))
            self._changed.notify_all()

    def stop(self, index: int) -> bool:
        """Ask peer `index` to leave the swarm gracefully; True if it did within `stop_timeout`."""
        return self._stop_all([index])

    def is_alive(self, index: int) -> bool:
        process = self._processes.get(index)
        return process is not None and process.is_alive()

    def pid(self, index: int) -> int | None:
        process = self._processes.get(index)
        return None if process is None else process.pid

    # --- running a schedule --------------------------------------------------------------------------

    def run(
        self,
        duration: float,
        schedule: ChurnSchedule | None = None,
        on_event: Callable[[ChurnEvent], None] | None = None,
    ) -> SwarmReport:
        """Carry out `schedule` for `duration` seconds (peers not started yet start first), then close
        the swarm and return its report."""
        if not any(self.is_alive(i) for i in range(self.num_peers)):
            starts = {
                event.peer for event in (schedule.events if schedule else ()) if event.action == "start"
            }
            self.start([i for i in range(self.num_peers) if i not in starts])
        begin = time.monotonic()
        for event in schedule.events if schedule else ():
            if event.at >= duration:
                break
            self._wait_until(begin + event.at)
            if event.action == "kill":
                self.kill(event.peer)
            elif event.action in ("restart", "start") and not self.is_alive(event.peer):
                self.spawn(event.peer, wait=False)
            elif event.action == "stop":
                self.stop(event.peer)
            if on_event is not None:
                on_event(event)
        self._wait_until(begin + duration)
        self.close()
        return self.report(since=begin)

    def _wait_until(self, moment: float) -> None:
        """Collect reports until `moment` (a scheduled time, not a synchronisation)."""
        with self._changed:
            while time.monotonic() < moment:
                self._changed.wait(moment - time.monotonic())

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str = "the condition") -> None:
        """Block until `predicate()` holds (re-checked whenever a report arrives); TimeoutError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} did not happen within {timeout} s")
                self._changed.wait(min(left, 1.0))

    def wait_for_epoch(self, epoch: int, timeout: float, peers: Sequence[int] | None = None) -> None:
        """Block until every given peer (default: every live one) has reached `epoch`."""

        def reached() -> bool:
            wanted = [i for i in range(self.num_peers) if self.is_alive(i)] if peers is None else peers
            return all(self.epoch_of(i) >= epoch for i in wanted)

        self.wait_for(
            reached, timeout, f"epoch {epoch} on {'every live peer' if peers is None else list(peers)}"
        )

    def epoch_of(self, index: int) -> int:
        """The last epoch the current process in slot `index` reported (-1 before its first report)."""
        incarnation = self._incarnations[index]
        epochs = [
            m.epoch
            for m in self.messages()
            if getattr(m, "epoch", None) is not None
            and (m.index, m.incarnation) == (index, incarnation)
            and not isinstance(m, Finished)
        ]
        return epochs[-1] if epochs else -1

    def messages(self) -> list:
        with self._changed:
            return list(self._messages)

    def report(self, since: float | None = None) -> SwarmReport:
        """The figures so far (`since`: where the timeline starts; default: when the swarm was made)."""
        with self._changed:
            return SwarmReport(
                list(self._messages),
                list(self._churn),
                self.started_at if since is None else since,
                time.monotonic(),
                self.num_peers,
                dict(self.faults),
                list(self._forced_kills),
                list(self._leftovers),
                set(self._silenced),
                {key: p.exitcode for key, p in self._all_processes.items() if p.exitcode is not None},
                closed=self._closed,
            )

    # --- closing -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every peer (graceful, then SIGKILL after `stop_timeout`) and check nothing is left."""
        if self._closed:
            return
        self._stop_all(list(self._processes))
        for process in self._all_processes.values():
            process.join(1)
            if process.is_alive() or _exists(process.pid):
                self._leftovers.append(process.pid)
        self._closing.set()
        self._collector.join(5)
        self._closed = True

    def _stop_all(self, indices: Sequence[int]) -> bool:
        asked = []
        for index in indices:
            process = self._processes.get(index)
            if process is None or not process.is_alive():
                continue
            try:
                self._conns[index, self._incarnations[index]].send(STOP)
            except OSError:
                pass  # it is dying anyway; joined below
            asked.append((index, process))
        deadline = time.monotonic() + self.stop_timeout
        clean = True
        for index, process in asked:
            if (index, self._incarnations[index]) not in self._silenced:
                process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                if (index, self._incarnations[index]) not in self._silenced:
                    self._forced_kills.append((index, self._incarnations[index]))
                    clean = False
                os.kill(process.pid, signal.SIGKILL)
                process.join(10)
            with self._changed:
                self._maddrs.pop(index, None)
                self._churn.append(ChurnRecord(time.monotonic(), "stop", index, self._incarnations[index]))
        # the collector reads each pipe to its end (the peer's last reports) and then closes it
        pipes = [self._conns[index, self._incarnations[index]] for index, _ in asked]
        self.wait_for(lambda: all(pipe.closed for pipe in pipes), 5.0, "the stopped peers' last reports")
        return clean

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- the collector thread ------------------------------------------------------------------------

    def _collect(self) -> None:
        while not self._closing.is_set():
            with self._changed:
                conns = [conn for conn in self._conns.values() if not conn.closed]
            if not conns:
                self._closing.wait(0.1)  # nothing to read yet: look again for new peers
                continue
            for conn in wait_for_connections(conns, timeout=0.2):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the peer exited (or was killed mid-message)
                    conn.close()
                    with self._changed:
                        self._changed.notify_all()
                    continue
                with self._changed:
                    self._messages.append(message)
                    if isinstance(message, Ready):
                        self._maddrs[message.index] = message.maddrs
                    elif isinstance(message, Silenced):
                        self._silenced.add((message.index, message.incarnation))
                    self._changed.notify_all()

    def _is_ready(self, index: int, incarnation: int) -> bool:
        return any(
            isinstance(m, Ready) and (m.index, m.incarnation) == (index, incarnation) for m in self._messages
        )

    def __repr__(self) -> str:
        alive = [i for i in range(self.num_peers) if self.is_alive(i)]
        return f"<LocalSwarm {self.run_id} peers={self.num_peers} alive={alive}>"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
