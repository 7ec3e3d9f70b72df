"""The WAN lab's delay-and-loss forwarder: every IP packet through a TUN device, held or dropped by its path.

Theory of operation. The lab's core router sends every packet that arrives from a peer's link into
a TUN device. This process reads each IP packet from it, finds the packet's path by its (source,
destination) addresses, drops it with the path's loss probability, and otherwise holds it for the
path's one-way delay (plus a jitter sample) before writing it back into the TUN device, from where
the kernel routes it on towards the destination's link. Packets are never parsed beyond their
addresses and no connection is terminated, so TCP's congestion control sees the configured RTT and
loss as it would on a real path. Bandwidth is not enforced here: the lab shapes with kernel
qdiscs before and after the forwarder.

Order. With jitter, a packet never overtakes an earlier one of its path: its release time is at
least that of the path's previous packet (real paths rarely reorder, and TCP reads reordering as
loss). At high packet rates this lifts the mean delay towards `delay + jitter`; probes sent a few
milliseconds apart see the configured mean and spread.

Time. Held packets wait in a timer wheel: slots of `tick` seconds (a dict from slot number to a
list of packets) and a heap of the slot numbers in use. Holding a packet is a dict lookup and an
append; the next deadline is a heap peek. Release times are rounded to the nearest slot, so each
packet leaves within half a tick of its time and the mean delay is exact.

Cost. A TUN device hands out one packet per read, so each packet costs one read, one write, a dict
lookup and a random number; the driver reads every packet waiting (up to READ_BATCH) before it
releases the due ones, and sleeps in `select` with a microsecond timeout in between (with the
timer slack lowered). Large MTUs make per-packet work per byte small.

`DelayLine` is the core (no I/O; time is an argument). `main()` is the driver, run by the lab as
`python forwarder.py --dev tun0` inside the router namespace: the first line on stdin is the
configuration (JSON: the path table, the tick and the random seed); each later line "stats" is
answered with the counters on stdout; end of stdin ends the forwarder, so it never outlives the
lab that started it. It imports only the standard library, so it starts in milliseconds.
"""

import argparse
import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import socket
import struct
import sys
import time

DEFAULT_TICK = 50e-6
READ_BATCH = 256
MAX_HELD_PACKETS = 1 << 20  # a bound on memory: past it packets are dropped and counted as overflow
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
PR_SET_TIMERSLACK = 29


class _Path:
    __slots__ = ("delay", "jitter", "loss", "last", "packets", "dropped")

    def __init__(self, delay: float, jitter: float, loss: float):
        if delay < 0 or jitter < 0 or not 0 <= loss <= 1:
            raise ValueError(f"a path needs delay >= 0, jitter >= 0 and loss in [0, 1], got "
                             f"{delay}, {jitter}, {loss}")
        self.delay, self.jitter, self.loss = delay, jitter, loss
        self.last = float("-inf")
        self.packets = self.dropped = 0


class DelayLine:
    """Holds packets for their path's delay and drops them with its loss (see the module docstring).

    `paths`: (source IPv4, destination IPv4, one-way delay s, jitter s, loss probability) entries.
    Packets of other paths, or not IPv4, are released at once and counted as `unknown`."""

    def __init__(self, paths, tick: float = DEFAULT_TICK, rng: random.Random | None = None,
                 max_held: int = MAX_HELD_PACKETS):
        if tick <= 0:
            raise ValueError(f"tick must be positive, got {tick}")
        self.tick, self.max_held = tick, max_held
        rng = rng or random.Random()
        self._random, self._uniform = rng.random, rng.uniform
        self._paths: dict[bytes, _Path] = {}
        for src, dst, delay, jitter, loss in paths:
            self._paths[socket.inet_aton(src) + socket.inet_aton(dst)] = _Path(delay, jitter, loss)
        self._wheel: dict[int, list[bytes]] = {}
        self._slots: list[int] = []  # heap of the slot numbers in the wheel
        self.received = self.delivered = self.dropped = self.unknown = self.overflow = 0

    @property
    def held(self) -> int:
        return self.received - self.delivered - self.dropped - self.overflow

    def push(self, packet: bytes, now: float) -> None:
        """Take one IP packet that arrived at `now`: drop it, or hold it until its release time."""
        self.received += 1
        path = self._paths.get(packet[12:20]) if packet[0] >> 4 == 4 else None
        if path is None:
            self.unknown += 1
            due = now
        else:
            path.packets += 1
            if path.loss and self._random() < path.loss:
                path.dropped += 1
                self.dropped += 1
                return
            due = now + path.delay
            if path.jitter:
                due += self._uniform(-path.jitter, path.jitter)
                if due < path.last:
                    due = path.last
                path.last = due
        if self.received - self.delivered - self.dropped - self.overflow > self.max_held:
            self.overflow += 1
            return
        slot = int(due / self.tick + 0.5)
        packets = self._wheel.get(slot)
        if packets is None:
            packets = self._wheel[slot] = []
            heapq.heappush(self._slots, slot)
        packets.append(packet)

    def pop_due(self, now: float) -> list[bytes]:
        """The packets whose release time has come by `now`, in release order."""
        released: list[bytes] = []
        slots, tick = self._slots, self.tick
        while slots and slots[0] * tick <= now:  # the same product as next_deadline(): due when woken then
            released.extend(self._wheel.pop(heapq.heappop(slots)))
        self.delivered += len(released)
        return released

    def next_deadline(self) -> float | None:
        """When the next held packet is due; None when nothing is held."""
        return self._slots[0] * self.tick if self._slots else None

    def stats(self) -> dict:
        paths = {f"{socket.inet_ntoa(key[:4])}>{socket.inet_ntoa(key[4:])}": [path.packets, path.dropped]
                 for key, path in self._paths.items() if path.packets}
        return {"received": self.received, "delivered": self.delivered, "dropped": self.dropped,
                "unknown": self.unknown, "overflow": self.overflow, "held": self.held, "paths": paths}


# --- the driver -------------------------------------------------------------------------------------


def open_tun(name: str) -> int:
    """A non-blocking TUN device without packet information: each read is one bare IP packet."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _lower_timer_slack() -> None:
    """Wake from select within microseconds of the deadline instead of the default 50 µs slack."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000)
    except (OSError, AttributeError):
        pass


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class _Lines:
    """Lines from a file descriptor read with os.read, so `select` on it never misses buffered data."""

    def __init__(self, fd: int):
        self.fd, self._buffer = fd, b""

    def read_available(self) -> tuple[list[str], bool]:
        """The complete lines now available, and whether end of file came."""
        data = os.read(self.fd, 65536)
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line.decode() for line in lines], not data

    def read_line(self) -> str:
        while b"\n" not in self._buffer:
            data = os.read(self.fd, 65536)
            if not data:
                raise EOFError("stdin closed before the forwarder's configuration arrived")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


def forward(tun: int, line: DelayLine, control: _Lines, read_size: int) -> None:
    """Move packets until end of stdin; answer "stats" lines."""
    read, write, clock = os.read, os.write, time.monotonic
    inputs = [tun, control.fd]
    while True:
        deadline = line.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - clock())
        readable, _, _ = select.select(inputs, [], [], timeout)
        if readable:
            now = clock()
            if tun in readable:
                for _ in range(READ_BATCH):
                    try:
                        packet = read(tun, read_size)
                    except BlockingIOError:
                        break
                    line.push(packet, now)
            if control.fd in readable:
                commands, closed = control.read_available()
                for command in commands:
                    if command.strip() == "stats":
                        _emit("stats", **line.stats())
                if closed:
                    return
        for packet in line.pop_due(clock()):
            write(tun, packet)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dev", default="tun0", help="name of the TUN device to create")
    parser.add_argument("--read-size", type=int, default=65536, help="largest packet to read (the MTU)")
    parser.add_argument("--lab", default="", help="the lab's name (only to tell its processes apart)")
    args = parser.parse_args(argv)
    control = _Lines(sys.stdin.fileno())
    config = json.loads(control.read_line())
    line = DelayLine(config["paths"], config.get("tick", DEFAULT_TICK), random.Random(config.get("seed")))
    tun = open_tun(args.dev)
    _lower_timer_slack()
    _emit("ready", dev=args.dev, paths=len(config["paths"]))
    forward(tun, line, control, args.read_size)


if __name__ == "__main__":
    main()
