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

Scheduling. A forwarder that waits for a core adds the wait to every packet it holds, and a busy
machine makes that milliseconds: TCP takes it for queueing (HyStart leaves slow start, the RTT
estimate grows). With `--realtime` the forwarder runs under SCHED_FIFO, so it is on a core within
microseconds of a packet's arrival or release time; it only uses CPU while the lab's traffic
flows, and the kernel's real-time throttling caps it below a full core in any case.

Cost. A TUN device hands out one packet per read, so each costs a read, a write, a dict lookup
and a random number; the driver reads every packet waiting (up to READ_BATCH) before it releases
the due ones, and sleeps in `select` with a microsecond timeout in between (with the timer slack
lowered). To keep that per-packet work off most bytes, the device is opened with a virtio-net
header and TCP segmentation offload: the kernel hands over a TCP burst of up to 64 KiB as one
super-packet (and takes one back), as a NIC with TSO and GRO would, while the links keep their
MTU. Loss stays per segment: each segment of a super-packet draws its own loss, and when some are
lost the super-packet is cut into its segments (`split_tcp`, headers rewritten, the TCP checksum
left to the kernel as the offload allows) and only those are dropped.

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
TUNSETIFF, TUNSETOFFLOAD = 0x400454CA, 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
PR_SET_TIMERSLACK = 29
REALTIME_PRIORITY = 10  # SCHED_FIFO; above every normal process, below the kernel's own threads
# struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset (little-endian)
VNET_HEADER = struct.Struct("<BBHHHH")
NEEDS_CSUM, GSO_NONE, GSO_TCPV4, GSO_ECN = 0x01, 0x00, 0x01, 0x80
TCP_FIN, TCP_PSH, TCP_CWR = 0x01, 0x08, 0x80
MAX_READ = 65536


class _Path:
    __slots__ = ("delay", "dropped", "jitter", "last", "loss", "packets")

    def __init__(self, delay: float, jitter: float, loss: float):
        if delay < 0 or jitter < 0 or not 0 <= loss <= 1:
            raise ValueError(
                f"a path needs delay >= 0, jitter >= 0 and loss in [0, 1], got {delay}, {jitter}, {loss}"
            )
        self.delay, self.jitter, self.loss = delay, jitter, loss
        self.last = float("-inf")
        self.packets = self.dropped = 0


class DelayLine:
    """Holds packets for their path's delay and drops them with its loss (see the module docstring).

    `paths`: (source IPv4, destination IPv4, one-way delay s, jitter s, loss probability) entries.
    Packets of other paths, or not IPv4, are released at once and counted as `unknown`. With
    `header` (VNET_HEADER.size), each buffer starts with a virtio-net header, and a TCP
    super-packet counts (and loses) as the segments it stands for."""

    def __init__(
        self,
        paths,
        tick: float = DEFAULT_TICK,
        rng: random.Random | None = None,
        max_held: int = MAX_HELD_PACKETS,
        header: int = 0,
    ):
        if tick <= 0:
            raise ValueError(f"tick must be positive, got {tick}")
        if header not in (0, VNET_HEADER.size):
            raise ValueError(f"header must be 0 or {VNET_HEADER.size} bytes, got {header}")
        self.tick, self.max_held, self.header = tick, max_held, header
        rng = rng or random.Random()
        self._random, self._uniform = rng.random, rng.uniform
        self._paths: dict[bytes, _Path] = {}
        for src, dst, delay, jitter, loss in paths:
            self._paths[socket.inet_aton(src) + socket.inet_aton(dst)] = _Path(delay, jitter, loss)
        self._wheel: dict[int, list[bytes]] = {}
        self._slots: list[int] = []  # heap of the slot numbers in the wheel
        self.received = self.delivered = self.held = 0  # buffers
        self.dropped = 0  # segments
        self.unknown = self.overflow = 0  # buffers

    def push(self, packet: bytes, now: float) -> None:
        """Take one buffer that arrived at `now`: drop it, or hold it (or what is left of it) until
        its release time."""
        self.received += 1
        ip = self.header
        path = self._paths.get(packet[ip + 12 : ip + 20]) if packet[ip] >> 4 == 4 else None
        if path is None:
            self.unknown += 1
            self._hold(packet, now)
            return
        segments = tcp_segments(packet) if ip else 1
        path.packets += segments
        pieces = None
        if path.loss:
            if segments == 1:
                if self._random() < path.loss:
                    path.dropped += 1
                    self.dropped += 1
                    return
            else:
                lost = {i for i in range(segments) if self._random() < path.loss}
                if lost:
                    path.dropped += len(lost)
                    self.dropped += len(lost)
                    if len(lost) == segments:
                        return
                    pieces = [piece for i, piece in enumerate(split_tcp(packet)) if i not in lost]
        due = now + path.delay
        if path.jitter:
            due += self._uniform(-path.jitter, path.jitter)
            if due < path.last:
                due = path.last
            path.last = due
        if pieces is None:
            self._hold(packet, due)
        else:
            for piece in pieces:
                self._hold(piece, due)

    def _hold(self, packet: bytes, due: float) -> None:
        if self.held >= self.max_held:
            self.overflow += 1
            return
        slot = int(due / self.tick + 0.5)
        packets = self._wheel.get(slot)
        if packets is None:
            packets = self._wheel[slot] = []
            heapq.heappush(self._slots, slot)
        packets.append(packet)
        self.held += 1

    def pop_due(self, now: float) -> list[bytes]:
        """The packets whose release time has come by `now`, in release order."""
        released: list[bytes] = []
        slots, tick = self._slots, self.tick
        while slots and slots[0] * tick <= now:  # the same product as next_deadline(): due when woken then
            released.extend(self._wheel.pop(heapq.heappop(slots)))
        self.delivered += len(released)
        self.held -= len(released)
        return released

    def next_deadline(self) -> float | None:
        """When the next held packet is due; None when nothing is held."""
        return self._slots[0] * self.tick if self._slots else None

    def stats(self) -> dict:
        paths = {
            f"{socket.inet_ntoa(key[:4])}>{socket.inet_ntoa(key[4:])}": [path.packets, path.dropped]
            for key, path in self._paths.items()
            if path.packets
        }
        return {
            "received": self.received,
            "delivered": self.delivered,
            "dropped": self.dropped,
            "unknown": self.unknown,
            "overflow": self.overflow,
            "held": self.held,
            "paths": paths,
        }


# --- TCP super-packets ------------------------------------------------------------------------------


def _tcp_layout(buffer: bytes) -> tuple[int, int, int] | None:
    """(IP header length, TCP header length, segment size) of an IPv4 TCP super-packet, else None."""
    _, gso_type, _, gso_size, _, _ = VNET_HEADER.unpack_from(buffer)
    if gso_type & ~GSO_ECN != GSO_TCPV4 or gso_size == 0:
        return None
    ip = VNET_HEADER.size
    ihl = (buffer[ip] & 0x0F) * 4
    thl = (buffer[ip + ihl + 12] >> 4) * 4
    return ihl, thl, gso_size


def tcp_segments(buffer: bytes) -> int:
    """How many segments a buffer (with its virtio-net header) stands for: 1 unless a TCP super-packet."""
    layout = _tcp_layout(buffer)
    if layout is None:
        return 1
    ihl, thl, size = layout
    return max(1, -(-(len(buffer) - VNET_HEADER.size - ihl - thl) // size))


def _fold(total: int) -> int:
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _ip_checksum(header: bytes | bytearray) -> bytes:
    total = sum(int.from_bytes(header[i : i + 2], "big") for i in range(0, len(header), 2))
    return (~_fold(total) & 0xFFFF).to_bytes(2, "big")


def split_tcp(buffer: bytes) -> list[bytes]:
    """Cut a TCP super-packet into the packets it stands for, each with its own virtio-net header.

    Each segment gets the IP header with its own length, id and checksum, and the TCP header with
    its sequence number and flags (CWR on the first only, FIN and PSH on the last only); the TCP
    checksum field holds the pseudo-header sum and the header asks the kernel to finish it
    (NEEDS_CSUM), as for the super-packet itself. Anything else comes back whole."""
    layout = _tcp_layout(buffer)
    if layout is None or not buffer[0] & NEEDS_CSUM:
        return [buffer]
    ihl, thl, size = layout
    ip = VNET_HEADER.size
    template = bytearray(buffer[ip : ip + ihl + thl])
    ip_id = int.from_bytes(template[4:6], "big")
    sequence = int.from_bytes(template[ihl + 4 : ihl + 8], "big")
    flags = template[ihl + 13]
    addresses = template[12:20]
    address_sum = (
        sum(int.from_bytes(addresses[i : i + 2], "big") for i in range(0, 8, 2)) + socket.IPPROTO_TCP
    )
    payload = memoryview(buffer)[ip + ihl + thl :]
    count = max(1, -(-len(payload) // size))
    vnet = VNET_HEADER.pack(NEEDS_CSUM, GSO_NONE, 0, 0, ihl, 16)
    pieces = []
    for i in range(count):
        chunk = payload[i * size : (i + 1) * size]
        header = bytearray(template)
        header[2:4] = (ihl + thl + len(chunk)).to_bytes(2, "big")
        header[4:6] = ((ip_id + i) & 0xFFFF).to_bytes(2, "big")
        header[10:12] = b"\0\0"
        header[10:12] = _ip_checksum(header[:ihl])
        header[ihl + 4 : ihl + 8] = ((sequence + i * size) & 0xFFFFFFFF).to_bytes(4, "big")
        header[ihl + 13] = flags & ~(TCP_CWR if i else 0) & ~(0 if i == count - 1 else TCP_FIN | TCP_PSH)
        header[ihl + 16 : ihl + 18] = _fold(address_sum + thl + len(chunk)).to_bytes(2, "big")
        pieces.append(vnet + header + chunk)
    return pieces


# --- the driver -------------------------------------------------------------------------------------


def open_tun(name: str, offload: bool) -> int:
    """A non-blocking TUN device without packet information: each read is one IP packet, after a
    virtio-net header and possibly a TCP super-packet with `offload`."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    if offload:
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def _lower_timer_slack() -> None:
    """Wake from select within microseconds of the deadline instead of the default 50 µs slack."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000)
    except (OSError, AttributeError):
        pass


def _run_first() -> None:
    """Take a core the moment a packet arrives: SCHED_FIFO, or the highest nice value we may have."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (PermissionError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        except PermissionError:
            pass  # an unprivileged run: the delays will show the machine's scheduling


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
    parser.add_argument("--no-offload", action="store_true", help="one packet per read, of at most --mtu")
    parser.add_argument("--mtu", type=int, default=MAX_READ, help="the links' MTU (without offloads)")
    parser.add_argument("--realtime", action="store_true", help="run under SCHED_FIFO (else nice -10)")
    parser.add_argument("--lab", default="", help="the lab's name (only to tell its processes apart)")
    args = parser.parse_args(argv)
    if args.realtime:
        _run_first()
    control = _Lines(sys.stdin.fileno())
    config = json.loads(control.read_line())
    offload = not args.no_offload
    header = VNET_HEADER.size if offload else 0
    line = DelayLine(
        config["paths"], config.get("tick", DEFAULT_TICK), random.Random(config.get("seed")), header=header
    )
    tun = open_tun(args.dev, offload)
    _lower_timer_slack()
    _emit("ready", dev=args.dev, paths=len(config["paths"]), offload=offload)
    forward(tun, line, control, header + (MAX_READ if offload else args.mtu))


if __name__ == "__main__":
    main()
