"""`SwarmReport`: what a `LocalSwarm` run did, from its peers' reports and the harness's churn log.

Definitions (times are `time.monotonic()`, shared by every process on the machine):

- the *swarm epoch* at time t is the highest epoch any peer had reached by a global step;
  `epochs_per_minute` is its growth over the run;
- a *stall* is the time between two advances of the swarm epoch; `stall_after_kill` is, for each
  kill, the stall that contains it (how long the swarm went without a step around the kill);
- peers *disagree* at epoch e when two of them hold different parameters there. A peer's
  parameters at e count unless the peer's next move is a state download (a peer that stepped on
  its own may fix that by reloading before its next step). Only honest peers are compared;
- a *catch-up load* is a state download after a process's first step (a newcomer's first
  download is its join); `never_killed_catch_up_loads` counts those of peers never killed;
- *rejoin time*: from a restart's spawn until that process holds the swarm's epoch;
- a *hang* is a stall longer than `hang_after`, or a peer that did not stop when asked.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from .faults import Fault
from .swarm_peer import Finished, Heartbeat, Ready, Transition


@dataclass(frozen=True)
class ChurnRecord:
    """What the harness did: "spawn", "kill" or "stop" to process `index`.`incarnation`."""

    time: float
    action: str
    index: int
    incarnation: int


@dataclass
class SwarmReport:
    messages: list
    churn: list[ChurnRecord]
    begin: float
    end: float
    num_peers: int
    faults: dict[int, Fault] = field(default_factory=dict)
    forced_kills: list[tuple[int, int]] = field(default_factory=list)
    """Processes (index, incarnation) that did not stop when asked and were killed."""
    leftovers: list[int] = field(default_factory=list)
    """Pids of processes still alive after the swarm closed."""
    silenced: set[tuple[int, int]] = field(default_factory=set)
    exit_codes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Exit codes of the processes that ended, by (index, incarnation)."""
    closed: bool = False
    hang_after: float = 60.0
    """A stall longer than this counts as a hang."""

    # --- raw views -----------------------------------------------------------------------------

    @property
    def transitions(self) -> list[Transition]:
        return [m for m in self.messages if isinstance(m, Transition)]

    def _honest(self, index: int) -> bool:
        return self.faults.get(index, Fault()).honest

    @property
    def killed_slots(self) -> set[int]:
        return {record.index for record in self.churn if record.action == "kill"}

    # --- progress ------------------------------------------------------------------------------

    def swarm_epochs(self) -> list[tuple[float, int]]:
        """(time, epoch) at each advance of the swarm epoch, the first being its state at `begin`."""
        steps = sorted((t.time, t.epoch) for t in self.transitions if t.kind == "step")
        reached = max((epoch for moment, epoch in steps if moment <= self.begin), default=0)
        timeline = [(self.begin, reached)]
        for moment, epoch in steps:
            if moment > self.begin and epoch > reached:
                reached = epoch
                timeline.append((moment, epoch))
        return timeline

    def swarm_epoch_at(self, moment: float) -> int:
        return max((epoch for t, epoch in self.swarm_epochs() if t <= moment), default=0)

    @property
    def epochs(self) -> int:
        timeline = self.swarm_epochs()
        return timeline[-1][1] - timeline[0][1]

    @property
    def epochs_per_minute(self) -> float:
        return 60.0 * self.epochs / max(self.end - self.begin, 1e-9)

    def stalls(self) -> list[tuple[float, float]]:
        """(start, length) of each interval between advances, and the open one at the end."""
        moments = [t for t, _ in self.swarm_epochs()] + [self.end]
        return [(a, b - a) for a, b in zip(moments, moments[1:])]

    @property
    def median_epoch_time(self) -> float:
        lengths = [length for _, length in self.stalls()[1:-1]]
        return statistics.median(lengths) if lengths else float("nan")

    @property
    def longest_stall(self) -> float:
        return max((length for _, length in self.stalls()[1:]), default=float("nan"))

    def stall_after_kill(self) -> list[float]:
        """For each kill, the length of the stall that contains it."""
        kills = [r.time for r in self.churn if r.action == "kill" and self.begin <= r.time <= self.end]
        return [
            length for moment in kills for start, length in self.stalls() if start <= moment < start + length
        ]

    @property
    def hangs(self) -> int:
        return sum(length > self.hang_after for _, length in self.stalls()[1:]) + len(self.forced_kills)

    # --- agreement -----------------------------------------------------------------------------

    def disagreements(self) -> dict[int, dict[str, list[str]]]:
        """{epoch: {digest: ["peer.incarnation", ...]}} for each epoch where honest peers disagree."""
        by_process = collections.defaultdict(list)
        for t in self.transitions:
            by_process[t.index, t.incarnation].append(t)
        held: collections.defaultdict = collections.defaultdict(lambda: collections.defaultdict(list))
        for (index, incarnation), moves in by_process.items():
            if not self._honest(index):
                continue
            for move, following in zip(moves, moves[1:] + [None]):
                superseded = following is not None and following.kind == "load"
                if move.kind != "start" and not superseded:
                    held[move.epoch][move.digest].append(f"{index}.{incarnation}")
        return {epoch: dict(digests) for epoch, digests in sorted(held.items()) if len(digests) > 1}

    # --- loads and rejoins ---------------------------------------------------------------------

    def catch_up_loads(self) -> dict[int, int]:
        """{peer slot: state downloads after its processes' first steps}."""
        counts: collections.Counter = collections.Counter()
        stepped = set()
        for t in sorted(self.transitions, key=lambda t: t.time):
            process = (t.index, t.incarnation)
            if t.kind == "load" and process in stepped:
                counts[t.index] += 1
            elif t.kind == "step":
                stepped.add(process)
        return dict(counts)

    @property
    def never_killed_catch_up_loads(self) -> int:
        return sum(n for index, n in self.catch_up_loads().items() if index not in self.killed_slots)

    def rejoin_times(self) -> list[float]:
        """For each restart after a kill: seconds from its spawn until it held the swarm's epoch."""
        killed_before = set()
        times = []
        for record in sorted(self.churn, key=lambda r: r.time):
            if record.action == "kill":
                killed_before.add(record.index)
            elif record.action == "spawn" and record.index in killed_before:
                moves = [
                    t
                    for t in self.transitions
                    if (t.index, t.incarnation) == (record.index, record.incarnation)
                    and t.kind != "start"
                    and t.epoch >= self.swarm_epoch_at(t.time)
                ]
                if moves:
                    times.append(min(t.time for t in moves) - record.time)
        return times

    def ready_times(self) -> list[float]:
        """Seconds from each spawn until the process's DHT was up (process start, imports, bootstrap)."""
        spawned = {(r.index, r.incarnation): r.time for r in self.churn if r.action == "spawn"}
        return [
            m.time - spawned[m.index, m.incarnation]
            for m in self.messages
            if isinstance(m, Ready) and (m.index, m.incarnation) in spawned
        ]

    # --- processes -----------------------------------------------------------------------------

    def finished(self) -> list[Finished]:
        return [m for m in self.messages if isinstance(m, Finished)]

    @property
    def crashes(self) -> list[str]:
        """Processes whose training loop failed, or that died on their own (not killed by the harness)."""
        crashed = [f"{m.index}.{m.incarnation}: {m.error}" for m in self.finished() if m.error]
        killed = {(r.index, r.incarnation) for r in self.churn if r.action == "kill"}
        killed |= set(self.forced_kills) | self.silenced
        crashed += [
            f"{i}.{n}: exit code {code}"
            for (i, n), code in sorted(self.exit_codes.items())
            if code != 0 and (i, n) not in killed
        ]
        return crashed

    @property
    def rounds(self) -> tuple[int, int]:
        """(gradient rounds averaged, rounds failed), summed over processes' last reports."""
        last = {}
        for m in self.messages:
            if isinstance(m, (Transition, Finished)):
                last[m.index, m.incarnation] = m
        return sum(m.rounds_averaged for m in last.values()), sum(m.rounds_failed for m in last.values())

    @property
    def max_rss_mib(self) -> float:
        values = [m.max_rss_kib for m in self.messages if isinstance(m, (Heartbeat, Finished))]
        return max(values, default=0) / 1024

    @property
    def children(self) -> list[int]:
        return [pid for m in self.finished() for pid in m.children]

    def warnings(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for m in self.finished():
            total.update(m.warnings)
        return total

    # --- presentation --------------------------------------------------------------------------

    def summary(self) -> dict[str, str]:
        stalls_after_kill = self.stall_after_kill()
        rejoins = self.rejoin_times()
        averaged, failed = self.rounds
        return {
            "duration": f"{self.end - self.begin:.0f} s",
            "epochs": f"{self.epochs} ({self.epochs_per_minute:.1f}/min)",
            "median epoch time": f"{self.median_epoch_time:.1f} s",
            "longest stall": f"{self.longest_stall:.1f} s",
            "kills": str(len([r for r in self.churn if r.action == "kill"])),
            "stall around a kill (max)": f"{max(stalls_after_kill):.1f} s" if stalls_after_kill else "-",
            "rejoin time (mean / max)": f"{statistics.mean(rejoins):.1f} / {max(rejoins):.1f} s"
            if rejoins
            else "-",
            "hangs": str(self.hangs),
            "same-epoch disagreements": str(len(self.disagreements())),
            "catch-up loads (never-killed peers)": f"{sum(self.catch_up_loads().values())} "
            f"({self.never_killed_catch_up_loads})",
            "gradient rounds averaged / failed": f"{averaged} / {failed}",
            "crashes": str(len(self.crashes)),
            "max RSS per peer": f"{self.max_rss_mib:.0f} MiB",
            "leftover processes": str(len(self.leftovers) + len(self.children)),
        }

    def table(self) -> str:
        rows = self.summary()
        width = max(map(len, rows))
        lines = [f"{name:<{width}}  {value}" for name, value in rows.items()]
        top = self.warnings().most_common(5)
        if top:
            lines.append("most frequent warnings:")
            lines += [f"  {count:>5}  {message}" for message, count in top]
        return "\n".join(lines)

    def timeline(self, step: float = 10.0) -> str:
        """The swarm epoch every `step` seconds, one line."""
        points, moment = [], self.begin
        while moment <= self.end:
            points.append(f"{moment - self.begin:.0f}s:{self.swarm_epoch_at(moment)}")
            moment += step
        return " ".join(points)
