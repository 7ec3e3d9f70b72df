"""Run this example's scripts (modules of this package) as a local swarm of child processes (for the demo and the tests).

    with LocalSwarm("data/demo_run") as swarm:
        peers = swarm.start_monitor("--refresh_period", "1")
        swarm.start("trainer-1", "run_trainer.py", "--initial_peers", *peers, ...)
        swarm.wait_until(lambda: ..., timeout=300)
    # every child has stopped here, whatever happened

Every child runs in one process group of its own (so Ctrl+C in the terminal reaches only the
launcher, which then stops them in order), with one CPU thread for torch, its output in
`<run_dir>/logs/<name>.log`, and the kernel's promise (PR_SET_PDEATHSIG) to stop it if the launcher
itself dies. Stopping sends SIGTERM (each peer says goodbye to the swarm), waits, then kills the
whole group: nothing is left running.
"""

import ctypes
import os
import re
import signal
import subprocess
import sys
import time

from plexus.errors import PlexusError

_INITIAL_PEERS = re.compile(r"--initial_peers ((?:/\S+ ?)+)")
_PEER_UP = re.compile(r"Peer (\w+) is up")


class SwarmError(PlexusError, RuntimeError):
    """A child failed (or a wait timed out); the message quotes the end of its log."""


def _child_setup(group: int):
    def setup() -> None:
        os.setpgid(0, group)
        if sys.platform.startswith("linux"):  # die with the launcher, even if it is killed with SIGKILL
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return setup


def stop_on_signals() -> None:
    """The child's side of stopping: SIGTERM (from LocalSwarm or any launcher) and SIGINT (Ctrl+C)
    both stop a peer cleanly. SIGINT is set explicitly: a shell starting a script in the
    background (`&`) makes it ignore SIGINT."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


class LocalSwarm:
    def __init__(self, run_dir: str, threads: int = 1, python: str = sys.executable):
        self.run_dir, self.python = os.path.abspath(run_dir), python
        self.log_dir = os.path.join(self.run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        self.processes: dict[str, subprocess.Popen] = {}
        self.group: int | None = None  # the first child's pid is the group's id

    def start(self, name: str, script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Start `python -m plexus.examples.albert.<script> <args>` (`script` such as "run_trainer.py")
        as child `name`, in the current directory (`env` adds variables)."""
        if name in self.processes:
            raise ValueError(f"a child named {name!r} already runs")
        with open(self.log_path(name), "wb") as log:
            process = subprocess.Popen(
                [self.python, "-m", f"{__package__}.{script.removesuffix('.py')}", *args],
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup(self.group or 0),
            )
        if self.group is None:
            self.group = process.pid
        self.processes[name] = process
        return process

    def start_monitor(
        self, *args: str, name: str = "monitor", timeout: float = 120.0, env: dict | None = None
    ):
        """Start the training monitor and return the addresses it prints for --initial_peers."""
        self.start(name, "run_training_monitor.py", *args, env=env)
        found = self.wait_until(
            lambda: _INITIAL_PEERS.search(self.read_log(name)), timeout, f"{name} to start"
        )
        return found.group(1).split()

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def read_log(self, name: str) -> str:
        with open(self.log_path(name), errors="replace") as f:
            return f.read()

    def peer_ids(self) -> dict[str, str]:
        """peer id -> child name, for the children that said which peer they are."""
        found = {}
        for name in self.processes:
            match = _PEER_UP.search(self.read_log(name))
            if match:
                found[match.group(1)] = name
        return found

    def check_alive(self, *names: str) -> None:
        for name in names or self.processes:
            code = self.processes[name].poll()
            if code is not None:
                raise SwarmError(
                    f"{name} exited with code {code}; the end of {self.log_path(name)}:\n{self._tail(name)}"
                )

    def wait_until(self, condition, timeout: float, what: str = "the swarm", poll: float = 0.5):
        """Poll `condition()` until it returns something true (returned); fail if a child dies first."""
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            self.check_alive()
            if time.monotonic() >= deadline:
                raise SwarmError(
                    f"gave up waiting for {what} after {timeout:.0f} s; logs are in {self.log_dir}"
                )
            time.sleep(poll)

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        """Stop every child (SIGTERM, then SIGKILL to the group after `timeout`); their exit codes."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.group is not None:
            try:
                os.killpg(self.group, signal.SIGKILL)  # whatever is left, grandchildren included
            except ProcessLookupError:
                pass
        return {name: process.wait() for name, process in self.processes.items()}

    def _tail(self, name: str, lines: int = 20) -> str:
        return "\n".join(self.read_log(name).splitlines()[-lines:])

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
