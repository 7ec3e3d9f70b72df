"""The WAN lab's measuring tool, run inside a peer's namespace: plain TCP and UDP, no Plexus.

    python probe.py serve [--port 5201]             TCP and UDP services, until stdin ends
    python probe.py rtt HOST [--count 20]            TCP round trips of 32 bytes (TCP_NODELAY)
    python probe.py setup HOST [--count 10]          fresh connections: connect, then a first answer
    python probe.py tcp HOST [--seconds 5]           one TCP stream's throughput at the receiver
    python probe.py udp HOST [--count 2000]          one-way delay and loss of paced UDP datagrams

`--reverse` makes the server the sender (tcp, udp), so that a peer behind a NAT can measure its
downlink: it connects out, as it must. Results are one JSON line each (`{"event": "rtt", ...}`)
with the raw samples, so the caller computes its own statistics. All namespaces of a lab share
the machine's clock, so a datagram's one-way delay is its arrival time minus the send time it
carries; the arrival time is the kernel's (SO_TIMESTAMPNS), so a receiver that waits for a core
does not add that wait to the path's delay.

TCP services, picked by the first byte: E echoes; S sinks and answers the byte count per 0.1 s
bin from the first byte on (so slow start can be told apart); R sends for the requested seconds;
U answers what the UDP receiver recorded of a session, once all its datagrams came or a deadline
passed. A UDP request datagram Q asks the server to send a paced session back to its source
(through the requester's NAT, as a reply). Imports only the standard library, so it starts in
milliseconds.
"""

import argparse
import itertools
import json
import os
import socket
import struct
import sys
import threading
import time

DEFAULT_PORT = 5201
BIN = 0.1  # seconds per throughput bin
CHUNK = 1 << 20
DATAGRAM = struct.Struct("!8sId")  # session, sequence number, send time (time.time(), the kernel's clock)
TIMESPEC = struct.Struct("@ll")  # what SO_TIMESTAMPNS hands over: seconds, nanoseconds
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value on x86 and ARM; Python 3.11 lacks it
QUERY = struct.Struct("!8sId")  # session, datagrams sent, seconds to wait for the missing ones
UDP_REQUEST = struct.Struct("!c8sIdI")  # b"Q", session, count, interval, size
SECONDS = struct.Struct("!d")
MAX_SESSIONS, MAX_DATAGRAMS = 64, 1 << 20  # bounds on what the UDP receiver remembers
TIMEOUT = 60.0


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def recv_exactly(connection: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = connection.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed early")
        data += chunk
    return data


def recv_json(connection: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            raise ConnectionError("connection closed before the answer was complete")
        data += chunk
    return json.loads(data)


def sink(connection: socket.socket) -> dict:
    """Read to end of stream: the total and the bytes per BIN seconds from the first byte."""
    buffer = bytearray(CHUNK)
    bins: list[int] = []
    total, first = 0, None
    while n := connection.recv_into(buffer):
        now = time.monotonic()
        first = now if first is None else first
        index = int((now - first) / BIN)
        bins.extend([0] * (index + 1 - len(bins)))
        bins[index] += n
        total += n
    return {"bytes": total, "bins": bins, "bin": BIN}


def source(connection: socket.socket, seconds: float) -> int:
    chunk, sent = memoryview(os.urandom(CHUNK)), 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        connection.sendall(chunk)
        sent += len(chunk)
    connection.shutdown(socket.SHUT_WR)
    return sent


def send_datagrams(
    sock: socket.socket, address, session: bytes, count: int, interval: float, size: int
) -> None:
    padding = b"\0" * max(0, size - DATAGRAM.size)
    started = time.monotonic()
    for sequence in range(count):
        if (wait := started + sequence * interval - time.monotonic()) > 0:
            time.sleep(wait)  # pacing the datagrams, not waiting for anything
        sock.sendto(DATAGRAM.pack(session, sequence, time.time()) + padding, address)


def stamped_socket() -> socket.socket:
    """A UDP socket whose datagrams carry the kernel's arrival time, with room to queue a session."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def receive_stamped(sock: socket.socket) -> tuple[bytes, tuple, float]:
    """One datagram, its sender and its arrival time (the kernel's; ours if it gave none)."""
    data, ancillary, _, address = sock.recvmsg(65536, socket.CMSG_SPACE(TIMESPEC.size))
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = TIMESPEC.unpack(value[: TIMESPEC.size])
            return data, address, seconds + nanoseconds * 1e-9
    return data, address, time.time()


def udp_result(count: int, record: list[tuple[int, float]]) -> dict:
    return {
        "sent": count,
        "received": len(record),
        "delays": [delay for _, delay in record],
        "reordered": sum(1 for (a, _), (b, _) in itertools.pairwise(record) if b < a),
    }


# --- the server -------------------------------------------------------------------------------------


class Server:
    def __init__(self, port: int):
        self.tcp = socket.create_server(("0.0.0.0", port))
        self.udp = stamped_socket()
        self.udp.bind(("0.0.0.0", port))
        self.sessions: dict[bytes, list[tuple[int, float]]] = {}
        self.arrived = threading.Condition()

    def serve(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._receive_udp, daemon=True).start()

    def _accept(self) -> None:
        while True:
            connection, _ = self.tcp.accept()
            connection.settimeout(TIMEOUT)
            threading.Thread(target=self._session, args=(connection,), daemon=True).start()

    def _session(self, connection: socket.socket) -> None:
        with connection:
            try:
                mode = connection.recv(1)
                if mode == b"E":
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    while data := connection.recv(4096):
                        connection.sendall(data)
                elif mode == b"S":
                    connection.sendall(json.dumps(sink(connection)).encode() + b"\n")
                elif mode == b"R":
                    (seconds,) = SECONDS.unpack(recv_exactly(connection, SECONDS.size))
                    source(connection, min(seconds, TIMEOUT))
                elif mode == b"U":
                    session, count, drain = QUERY.unpack(recv_exactly(connection, QUERY.size))
                    record = self._wait_for_datagrams(session, count, min(drain, TIMEOUT))
                    connection.sendall(json.dumps({"datagrams": record}).encode() + b"\n")
            except OSError:
                pass  # the client went away; nobody is left to tell

    def _receive_udp(self) -> None:
        while True:
            data, address, now = receive_stamped(self.udp)
            if len(data) == UDP_REQUEST.size and data[:1] == b"Q":
                _, session, count, interval, size = UDP_REQUEST.unpack(data)
                count = min(count, MAX_DATAGRAMS)
                threading.Thread(
                    target=send_datagrams,
                    daemon=True,
                    args=(self.udp, address, session, count, interval, size),
                ).start()
            elif len(data) >= DATAGRAM.size:
                session, sequence, sent = DATAGRAM.unpack_from(data)
                with self.arrived:
                    record = self.sessions.get(session)
                    if record is None:
                        if len(self.sessions) >= MAX_SESSIONS:
                            self.sessions.pop(next(iter(self.sessions)))
                        record = self.sessions[session] = []
                    if len(record) < MAX_DATAGRAMS:
                        record.append((sequence, now - sent))
                    self.arrived.notify_all()

    def _wait_for_datagrams(self, session: bytes, count: int, drain: float) -> list:
        """The session's record once all `count` datagrams came, or `drain` seconds from now."""
        deadline = time.monotonic() + drain
        with self.arrived:
            while len(self.sessions.get(session, ())) < count and (left := deadline - time.monotonic()) > 0:
                self.arrived.wait(left)
            return self.sessions.pop(session, [])


# --- the clients ------------------------------------------------------------------------------------


def measure_rtt(host: str, port: int, count: int, interval: float) -> list[float]:
    with socket.create_connection((host, port), timeout=TIMEOUT) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sendall(b"E")
        samples, payload = [], b"x" * 32
        for _ in range(count):
            started = time.monotonic()
            connection.sendall(payload)
            recv_exactly(connection, len(payload))
            samples.append(time.monotonic() - started)
            time.sleep(interval)  # pacing, so that probes never queue behind each other
        return samples


def measure_setup(host: str, port: int, count: int) -> list[tuple[float, float]]:
    """For fresh connections: (seconds to connect, seconds to the first 32-byte answer)."""
    samples = []
    for _ in range(count):
        started = time.monotonic()
        with socket.create_connection((host, port), timeout=TIMEOUT) as connection:
            connected = time.monotonic()
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(b"E" + b"x" * 31)
            recv_exactly(connection, 31)
            samples.append((connected - started, time.monotonic() - started))
    return samples


def measure_tcp(host: str, port: int, seconds: float, reverse: bool) -> dict:
    with socket.create_connection((host, port), timeout=TIMEOUT) as connection:
        if reverse:
            connection.sendall(b"R" + SECONDS.pack(seconds))
            return sink(connection)
        connection.sendall(b"S")
        sent = source(connection, seconds)
        return dict(recv_json(connection), sent=sent)


def measure_udp(
    host: str, port: int, count: int, interval: float, size: int, drain: float, reverse: bool
) -> dict:
    session = os.urandom(8)
    with stamped_socket() as sock:
        if reverse:
            record = _receive_session(sock, (host, port), session, count, interval, size, drain)
            return udp_result(count, record)
        send_datagrams(sock, (host, port), session, count, interval, size)
    with socket.create_connection((host, port), timeout=TIMEOUT + drain) as connection:
        connection.sendall(b"U" + QUERY.pack(session, count, drain))
        return udp_result(count, recv_json(connection)["datagrams"])


def _receive_session(sock, address, session: bytes, count: int, interval: float, size: int, drain: float):
    """Ask the server for a session and record it, until all came or `drain` s after the last was due."""
    sock.sendto(UDP_REQUEST.pack(b"Q", session, count, interval, size), address)
    deadline = time.monotonic() + count * interval + drain
    record: list[tuple[int, float]] = []
    while len(record) < count and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, _, received = receive_stamped(sock)
        except TimeoutError:
            break
        if len(data) >= DATAGRAM.size and data[:8] == session:
            _, sequence, sent = DATAGRAM.unpack_from(data)
            record.append((sequence, received - sent))
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serve", "rtt", "setup", "tcp", "udp"))
    parser.add_argument("host", nargs="?", help="the server's address (not for serve)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--count", type=int, default=None, help="round trips (20), connections (10) or datagrams (2000)"
    )
    parser.add_argument("--interval", type=float, default=None, help="seconds between probes (0.01 / 0.001)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the TCP stream sends")
    parser.add_argument("--size", type=int, default=100, help="bytes per UDP datagram")
    parser.add_argument("--drain", type=float, default=1.0, help="how long to wait for datagrams still due")
    parser.add_argument("--reverse", action="store_true", help="the server sends (tcp, udp)")
    parser.add_argument("--lab", default="", help="the lab's name (only to tell its processes apart)")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        Server(args.port).serve()
        emit("ready", port=args.port)
        sys.stdin.read()  # serve until the lab closes our stdin
        return
    if args.host is None:
        parser.error(f"{args.mode} needs the server's address")
    if args.mode == "rtt":
        emit("rtt", samples=measure_rtt(args.host, args.port, args.count or 20, args.interval or 0.01))
    elif args.mode == "setup":
        emit("setup", samples=measure_setup(args.host, args.port, args.count or 10))
    elif args.mode == "tcp":
        emit("tcp", **measure_tcp(args.host, args.port, args.seconds, args.reverse))
    else:
        emit(
            "udp",
            **measure_udp(
                args.host,
                args.port,
                args.count or 2000,
                args.interval or 0.001,
                args.size,
                args.drain,
                args.reverse,
            ),
        )


if __name__ == "__main__":
    main()
