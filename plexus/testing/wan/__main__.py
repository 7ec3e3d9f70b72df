"""Run a WAN lab scenario and print what its links deliver: `python -m plexus.testing.wan scenario.toml`.

Builds the scenario's peers (plexus/testing/wan/scenario.py describes the file), measures the
listed pairs with plain TCP and UDP next to their configured figures, runs the scenario's
programs in their peers' namespaces, prints a table of each, and removes every namespace,
interface and process it made: on success, on error, on SIGINT, SIGTERM or SIGHUP. After a
SIGKILL nothing can run; the next scenario (or `--cleanup`) removes what is left. Needs root.

Exit status: 0 when every program exited with 0, 1 when one did not, 2 on a bad scenario or a
machine that cannot build namespaces.
"""

import argparse
import json
import signal
import sys

from ...errors import UsageError
from ..netns import missing_prerequisite, remove_stale
from .lab import LabOptions, WanLab
from .measure import HEADER, PathProber, format_row
from .scenario import load_scenario, run_programs

TERMINATING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """A terminating signal arrived: unwind, so that the lab's `finally` removes everything."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def run(scenario, out=sys.stdout) -> int:
    lab = WanLab(scenario.peers, scenario.lab)
    failed = 0
    try:
        lab.start()
        print(
            f"lab {lab.namespaces.tag}* is up: {len(scenario.peers)} peers, mtu {scenario.lab.mtu}, "
            f"TCP {scenario.lab.congestion_control}",
            file=out,
            flush=True,
        )
        if scenario.pairs:
            prober = PathProber(lab, scenario.measure)
            print(
                f"\nplain TCP/UDP on the lab's paths\n{HEADER}\n|" + "---|" * (HEADER.count("|") - 1),
                file=out,
                flush=True,
            )
            for a, b in scenario.pairs:
                print(format_row(prober.measure(a, b)), file=out, flush=True)
            prober.close()
        if scenario.programs:
            print("\n| peer | command | exit | seconds | last output |\n|---|---|---|---|---|", file=out)
            for result in run_programs(lab, scenario.programs):
                failed += result.returncode != 0
                code = "timed out" if result.returncode is None else result.returncode
                tail = result.output_tail.strip().replace("\n", " / ").replace("|", "\\|")
                command = " ".join(result.command)
                row = f"| {result.peer} | {command} | {code} | {result.seconds:.1f} | {tail} |"
                print(row, file=out, flush=True)
        stats = lab.forwarder_stats()
        print(
            f"\nforwarder: {stats['received']} packets in, {stats['dropped']} dropped as configured loss, "
            f"{stats['tun_dropped']} lost because the forwarder fell behind",
            file=out,
        )
    finally:
        for signum in TERMINATING_SIGNALS:  # a second signal must not interrupt the clean-up
            signal.signal(signum, signal.SIG_IGN)
        lab.close()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plexus.testing.wan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("scenario", nargs="?", help="the scenario file (TOML)")
    parser.add_argument(
        "--cleanup", action="store_true", help="only remove what labs of crashed runs left behind, then exit"
    )
    parser.add_argument("--show", action="store_true", help="print the scenario as understood, then exit")
    args = parser.parse_args(argv)
    if args.cleanup:
        removed = remove_stale(LabOptions().prefix)
        print(f"removed {len(removed)} stale namespace(s)" + "".join(f"\n  {name}" for name in removed))
        return 0
    if args.scenario is None:
        parser.error("give a scenario file (or --cleanup)")
    try:
        scenario = load_scenario(args.scenario)
        if args.show:
            peers = {name: vars(profile) for name, profile in scenario.peers.items()}
            print(
                json.dumps(
                    {
                        "peers": peers,
                        "pairs": scenario.pairs,
                        "lab": vars(scenario.lab),
                        "programs": [vars(program) for program in scenario.programs],
                    },
                    indent=2,
                )
            )
            return 0
        reason = missing_prerequisite(("ip", "tc", "nft"))
        if reason is not None:
            raise UsageError(f"cannot build a lab here: {reason}")
        for signum in TERMINATING_SIGNALS:
            signal.signal(signum, _raise_terminated)
        return run(scenario)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Terminated as signal_name:
        print(f"stopped by {signal_name}; the lab was removed", file=sys.stderr)
        return 128 + signal.Signals[str(signal_name)].value


if __name__ == "__main__":
    sys.exit(main())
