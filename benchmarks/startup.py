"""How long Plexus takes to start: `import torch`, what `import plexus` adds after it, `plexus --help`.

Each figure is the median of `--runs` fresh interpreters (after one warm-up run that also writes the
bytecode caches), printed with its ratio to the target (below 1.0 meets it):

    import plexus after torch   target 0.3 s
    plexus --help               target 1.0 s

`plexus.Optimizer` (first use of the training stack) is printed for information: the names of
`plexus` load when first used, so that is where the rest of the import time went.

    python benchmarks/startup.py [--runs 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

TARGETS = {"import plexus after torch": 0.3, "plexus --help": 1.0}
IN_PROCESS = "import time; import torch; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"


def environment() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # measure what users get: imports from cached bytecode
    return env


def wall_time(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=environment())
    return time.perf_counter() - started


def in_process_time(code: str) -> float:
    command = [sys.executable, "-c", IN_PROCESS.format(code=code)]
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=environment())
    return float(result.stdout.strip().splitlines()[-1])


def median(measure, runs: int) -> float:
    measure()  # warm-up: bytecode caches, the OS's file cache
    return statistics.median(measure() for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    figures = {
        "import torch": median(lambda: wall_time([sys.executable, "-c", "import torch"]), runs),
        "import plexus after torch": median(lambda: in_process_time("import plexus"), runs),
        "plexus --help": median(lambda: wall_time([sys.executable, "-m", "plexus", "--help"]), runs),
        "plexus.Optimizer after torch (first use)": median(
            lambda: in_process_time("import plexus; plexus.Optimizer"), runs
        ),
    }
    print(f"median of {runs} runs, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for name, seconds in figures.items():
        target = TARGETS.get(name)
        verdict = f"  target {target:.1f} s, ratio {seconds / target:.2f}" if target else ""
        print(f"{name:42s} {seconds:6.3f} s{verdict}")


if __name__ == "__main__":
    main()
