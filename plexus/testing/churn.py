"""Run a local swarm under churn and faults, and print what happened.

    python -m plexus.testing.churn --peers 4 --duration 120 --kill-every 15 25
    python -m plexus.testing.churn --peers 3 --no-churn --fault 2:slow:delay=0.2
    python -m plexus.testing.churn --peers 4 --fault 3:silent:after=30 --check

Every peer is a process on 127.0.0.1 training `RegressionTask` with `plexus.Optimizer`. The table
says how fast the swarm went, its longest stalls (also around each kill), how long restarted peers
took to rejoin, whether peers at the same epoch disagreed, state downloads, failed rounds, memory
and leftover processes. With `--check` the exit status is 1 if there was a hang, a disagreement
between honest peers, a crash or a leftover process.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .faults import FAULT_KINDS, Fault
from .swarm import DEFAULT_OPTIMIZER_OPTIONS, ChurnSchedule, LocalSwarm
from .tasks import RegressionTask


def parse_fault(text: str) -> tuple[int, Fault]:
    """`INDEX:KIND[:FIELD=VALUE,...]`, e.g. `2:scaled:factor=100,after=5`."""
    index, _, rest = text.partition(":")
    kind, _, fields = rest.partition(":")
    if not index.isdigit() or kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(
            f"--fault {text!r}: expected INDEX:KIND[:FIELD=VALUE,...] with KIND one of "
            f"{', '.join(FAULT_KINDS)}"
        )
    cls = FAULT_KINDS[kind]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, fields.split(",")):
        name, _, value = item.partition("=")
        if name not in types:
            raise argparse.ArgumentTypeError(
                f"--fault {text!r}: {kind} has no field {name!r} (it has {', '.join(types) or 'none'})"
            )
        values[name] = int(value) if types[name] in (int, "int") else float(value)
    return int(index), cls(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m plexus.testing.churn",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=int, default=4, help="peer processes (default 4)")
    parser.add_argument(
        "--duration", type=float, default=120.0, help="seconds of training measured (default 120)"
    )
    parser.add_argument("--no-churn", action="store_true", help="kill nobody")
    parser.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=(15.0, 25.0),
        metavar=("MIN", "MAX"),
        help="seconds between kills, uniform in [MIN, MAX] (default 15 25)",
    )
    parser.add_argument(
        "--restart-after",
        type=float,
        nargs=2,
        default=(2.0, 5.0),
        metavar=("MIN", "MAX"),
        help="seconds from a kill to the restart (default 2 5)",
    )
    parser.add_argument(
        "--start-after", type=float, default=10.0, help="seconds before the first kill (default 10)"
    )
    parser.add_argument("--victims", type=int, nargs="*", help="peers that may be killed (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument(
        "--fault",
        type=parse_fault,
        action="append",
        default=[],
        metavar="INDEX:KIND[:F=V,...]",
        help=f"a faulty peer; KIND is one of {', '.join(FAULT_KINDS)} (repeatable)",
    )
    defaults = DEFAULT_OPTIMIZER_OPTIONS
    parser.add_argument("--target-batch-size", type=int, default=defaults["target_batch_size"])
    parser.add_argument("--matchmaking-time", type=float, default=defaults["matchmaking_time"])
    parser.add_argument("--averaging-timeout", type=float, default=defaults["averaging_timeout"])
    parser.add_argument("--use-local-updates", action="store_true", help="the Optimizer's local-updates mode")
    task = RegressionTask()
    parser.add_argument("--batch-size", type=int, default=task.batch_size, help="samples per step")
    parser.add_argument(
        "--step-delay", type=float, default=task.step_delay, help="stand-in compute per step (s)"
    )
    parser.add_argument("--identical-batches", action="store_true", help="every batch is the whole data set")
    parser.add_argument("--log-level", default=None, help="the peers' Plexus log level (their stderr)")
    parser.add_argument("--timeline-step", type=float, default=10.0, help="seconds between timeline points")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 on a hang, a disagreement, a crash or a leftover process"
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    task = RegressionTask(
        batch_size=args.batch_size, step_delay=args.step_delay, identical_batches=args.identical_batches
    )
    optimizer = dict(
        target_batch_size=args.target_batch_size,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        use_local_updates=args.use_local_updates,
    )
    schedule = (
        None
        if args.no_churn
        else ChurnSchedule.random_kills(
            args.duration,
            args.peers,
            every=tuple(args.kill_every),
            restart_after=tuple(args.restart_after),
            start_after=args.start_after,
            victims=args.victims,
            seed=args.seed,
        )
    )
    with LocalSwarm(
        args.peers, task=task, optimizer=optimizer, faults=dict(args.fault), log_level=args.log_level
    ) as swarm:
        print(f"starting {args.peers} peers...", file=sys.stderr)
        swarm.start()
        print(f"training for {args.duration:.0f} s", file=sys.stderr)
        report = swarm.run(args.duration, schedule)
    print(report.table())
    print(f"swarm epoch over time: {report.timeline(args.timeline_step)}")
    for epoch, digests in list(report.disagreements().items())[:10]:
        print(f"epoch {epoch}: peers disagree: {' vs '.join(', '.join(p) for p in digests.values())}")
    if args.check:
        failed = (
            report.hangs or report.disagreements() or report.crashes or report.leftovers or report.children
        )
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
