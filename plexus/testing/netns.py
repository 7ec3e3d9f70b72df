"""Linux network namespaces for multi-peer tests and labs: names, links, processes and cleanup.

Theory of operation. A `Namespaces` object owns a set of network namespaces named
`{prefix}-{pid}-{serial}-{name}`: the prefix says what made them (for example `pxnat` or
`pxwan`), the pid says which process owns them and the serial tells apart two sets made by one
process. Links are veth pairs created directly inside their two namespaces, so nothing is ever
left in the caller's own namespace. Processes started with `spawn` run under `ip netns exec`,
get SIGKILL when their parent dies (PR_SET_PDEATHSIG) and read their stdin from a pipe, so a
well-behaved child also sees end-of-file when its owner goes away.

`close()` ends every process started here (by pid), then any other process still inside one of
these namespaces (children of children), then deletes the namespaces, which deletes their
interfaces with them. Nothing can run after SIGKILL, so `remove_stale(prefix)` cleans up after
owners that died that way: it removes every namespace of that prefix whose owner pid is no longer
alive. Labs call it before they build.

`PeerProcess` wraps a child that reports JSON lines (`{"event": ..., ...}`) on stdout, and waits
for its events with deadlines, failing with the tail of its log. Needs root, iproute2 and (for NAT)
nftables; `missing_prerequisite()` says what is missing.
"""

import collections
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ..errors import PhaseTimeout, UsageError

PR_SET_PDEATHSIG = 1
COMMAND_TIMEOUT = 30.0

# The NAT of a home router: masquerade what leaves through "wan"; let in only replies (conntrack).
NAT_RULES = """
table ip nat {
    chain postrouting { type nat hook postrouting priority srcnat; policy accept; oifname "wan" masquerade; }
}
table inet filter {
    chain forward { type filter hook forward priority filter; policy accept;
                    iifname "wan" ct state != { established, related } drop; }
    chain input { type filter hook input priority filter; policy accept;
                  iifname "wan" ct state != { established, related } drop; }
}
"""

_serials = itertools.count()


class LabSetupError(UsageError):
    """A command that builds a lab failed; the message names it and quotes its error output."""


def missing_prerequisite(tools: Sequence[str] = ("ip", "nft")) -> str | None:
    """Why namespaces cannot be made here (None when they can): not Linux, not root, a missing tool."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in tools:
        if shutil.which(tool) is None:
            package = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables"}.get(tool, tool)
            return f"`{tool}` is not installed (apt-get install {package})"
    probe = f"pxprobe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run_command(
    args: Sequence[str], stdin: str | None = None, check: bool = True, timeout: float = COMMAND_TIMEOUT
) -> str:
    """Run one command and return its stdout; LabSetupError with its stderr when it fails."""
    result = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise LabSetupError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


def list_namespaces() -> list[str]:
    output = run_command(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in output.splitlines() if line.strip()]


def namespace_pids(full_name: str) -> list[int]:
    return [int(pid) for pid in run_command(["ip", "netns", "pids", full_name], check=False).split()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(full_name: str) -> None:
    """Kill what still runs inside (repeatedly: a dying process may have forked), then delete it."""
    for _ in range(10):
        pids = namespace_pids(full_name)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)  # let the kernel reap them before looking again
    run_command(["ip", "netns", "del", full_name], check=False)


def remove_stale(prefix: str) -> list[str]:
    """Remove the namespaces of `prefix` whose owner process is gone; returns their names."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-")
    removed = []
    for name in list_namespaces():
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    return removed


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Namespaces:
    """Network namespaces owned by this process; see the module docstring."""

    def __init__(self, prefix: str):
        if not re.fullmatch(r"[a-z][a-z0-9]{1,11}", prefix):
            raise UsageError(f"namespace prefix must be 2-12 lowercase letters and digits, got {prefix!r}")
        self.prefix = prefix
        self.tag = f"{prefix}-{os.getpid()}-{next(_serials)}-"
        self.names: dict[str, str] = {}
        self.processes: list[subprocess.Popen] = []
        self.closed = False

    def full(self, name: str) -> str:
        """The system-wide name of our namespace `name`."""
        return self.names[name]

    def add(self, *names: str) -> None:
        for name in names:
            full = self.tag + name
            run_command(["ip", "netns", "add", full])
            self.names[name] = full
            self.ip(name, "link", "set", "lo", "up")

    def run(self, *args: str, ns: str | None = None, stdin: str | None = None, check: bool = True) -> str:
        prefix = ["ip", "netns", "exec", self.full(ns)] if ns else []
        return run_command(prefix + list(args), stdin=stdin, check=check)

    def ip(self, ns: str, *args: str) -> None:
        run_command(["ip", "-n", self.full(ns), *args])

    def tc(self, ns: str, *args: str) -> None:
        run_command(["tc", "-n", self.full(ns), *args])

    def sysctl(self, ns: str, *settings: str) -> None:
        self.run("sysctl", "-q", "-w", *settings, ns=ns)

    def nft(self, ns: str, rules: str) -> None:
        self.run("nft", "-f", "-", ns=ns, stdin=rules)

    def veth(self, ns1: str, name1: str, ns2: str, name2: str, mtu: int | None = None) -> None:
        """A veth pair from `name1` in `ns1` to `name2` in `ns2`, made inside them (both down)."""
        mtu_args = ["mtu", str(mtu)] if mtu else []
        self.ip(
            ns1,
            "link",
            "add",
            name1,
            *mtu_args,
            "type",
            "veth",
            "peer",
            "name",
            name2,
            *mtu_args,
            "netns",
            self.full(ns2),
        )

    def spawn(
        self,
        ns: str,
        argv: Sequence[str],
        env: dict | None = None,
        cwd: str | None = None,
        stderr=subprocess.PIPE,
    ) -> subprocess.Popen:
        """Start `argv` inside namespace `ns` with pipes for stdin, stdout (text) and stderr."""
        command = ["ip", "netns", "exec", self.full(ns), *argv]
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )
        self.processes.append(process)
        return process

    def close(self) -> None:
        """End our processes and delete our namespaces; safe to call twice and after a failed build."""
        self.closed = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in list_namespaces():  # also any a failed build left unrecorded
            if name.startswith(self.tag):
                _remove_namespace(name)
        self.names.clear()

    def __enter__(self) -> "Namespaces":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Namespaces {self.tag}* {sorted(self.names)}{' closed' if self.closed else ''}>"


class PeerProcess:
    """A child that reports JSON events on stdout; threads collect them and the tail of its stderr."""

    def __init__(self, name: str, process: subprocess.Popen, log_lines: int = 60):
        self.name, self.process = name, process
        self.events: dict[str, dict] = {}
        self._arrived = threading.Condition()
        self._log: collections.deque[str] = collections.deque(maxlen=log_lines)
        threading.Thread(target=self._read_events, daemon=True).start()
        if process.stderr is not None:
            threading.Thread(target=lambda: self._log.extend(process.stderr), daemon=True).start()

    @property
    def log(self) -> str:
        return "".join(self._log)

    def _read_events(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                message = json.loads(line)
                with self._arrived:
                    self.events[message["event"]] = message
                    self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()

    def wait_for(self, event: str, timeout: float = 60.0) -> dict:
        """The peer's `event`; PhaseTimeout with its log if it exits or the deadline passes first."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while event not in self.events:
                left = deadline - time.monotonic()
                if self.process.poll() is not None or left <= 0:
                    break
                self._arrived.wait(min(left, 1.0))
        if event not in self.events:
            self.process.kill()
            self.process.wait()
            code = self.process.returncode
            why = f"exited with {code}" if code not in (None, -signal.SIGKILL) else f"timed out ({timeout} s)"
            raise PhaseTimeout(
                f"peer {self.name} {why} before reporting {event!r}; its log:\n{self.log}", phase=event
            )
        return self.events[event]

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def finish(self) -> None:
        """Close its stdin: the peer's signal to wrap up."""
        self.process.stdin.close()


def emit(event: str, **fields) -> None:
    """Report one event from inside a peer process (the other end of `PeerProcess`)."""
    print(json.dumps({"event": event, **fields}), flush=True)
