"""Churn soak: a local swarm of plexus.Optimizer peers with and without a peer SIGKILLed and restarted
every 15-25 s, measured in the same run.

Run: `.venv/bin/python benchmarks/soak.py [--peers 4] [--seconds 300] [--kill-every 15 25] [--seed 0]`

Each phase is a fresh `plexus.testing.LocalSwarm` (one process per peer on 127.0.0.1, training
`RegressionTask` with the harness's default Optimizer options); the first has no churn and is the
baseline, the second kills one random peer every `--kill-every` seconds and restarts it 2-5 s later.

Columns: epochs per minute (and the churn phase's ratio to the baseline), the median epoch time,
the longest stall (time between two advances of the swarm's epoch) and the longest stall around a
kill, the mean and longest time from a restart to holding the swarm's epoch (process start,
imports and the state download included; the time to start a process is shown apart), epochs at
which two peers held different parameters, state downloads after a peer's first step (of peers
never killed), failed gradient rounds, hangs and leftover processes.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plexus.testing import ChurnSchedule, LocalSwarm


def run_phase(peers: int, seconds: float, schedule: ChurnSchedule | None, run_id: str):
    with LocalSwarm(peers, run_id=run_id) as swarm:
        swarm.start()
        return swarm.run(seconds, schedule)


def fmt(values, unit="s") -> str:
    return f"{statistics.mean(values):.1f} / {max(values):.1f} {unit}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0, help="length of each phase")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(15.0, 25.0), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.peers} peers, "
        f"{args.seconds:.0f} s per phase\n"
    )
    baseline = run_phase(args.peers, args.seconds, None, "soak_baseline")
    schedule = ChurnSchedule.random_kills(
        args.seconds, args.peers, every=tuple(args.kill_every), seed=args.seed
    )
    churn = run_phase(args.peers, args.seconds, schedule, "soak_churn")

    print(
        "| phase | epochs/min | ratio | median epoch | longest stall | stall around a kill (max) "
        "| rejoin (mean / max) | process start (mean) | disagreements | catch-up loads (never killed) "
        "| failed rounds | hangs | leftovers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, report in (("no churn", baseline), ("churn", churn)):
        stalls = report.stall_after_kill()
        around_kills = f"{max(stalls):.1f} s ({len(stalls)} kills)" if stalls else "-"
        ratio = report.epochs_per_minute / baseline.epochs_per_minute
        print(
            f"| {name} | {report.epochs_per_minute:.1f} | {ratio:.2f} | {report.median_epoch_time:.1f} s | {report.longest_stall:.1f} s | {around_kills} "
            f"| {fmt(report.rejoin_times())} | {statistics.mean(report.ready_times()):.1f} s "
            f"| {len(report.disagreements())} | {sum(report.catch_up_loads().values())} "
            f"({report.never_killed_catch_up_loads}) | {report.rounds[1]} | {report.hangs} "
            f"| {len(report.leftovers) + len(report.children)} |"
        )
    print(f"\nchurn phase, swarm epoch every 30 s: {churn.timeline(30)}")
    for message, count in churn.warnings().most_common(3):
        print(f"churn phase warning, {count} times: {message}")


if __name__ == "__main__":
    main()
