"""Transport benchmark: one Plexus stream (TCP + Noise + yamux) against plain asyncio TCP and TLS 1.3,
with the Noise suite Plexus peers agree on (AESGCM) and libp2p's "/noise" (ChaChaPoly).

Run: `.venv/bin/python benchmarks/transport.py [--bulk-mib 256] [--rounds 1000] [--setups 50]`

Everything runs on 127.0.0.1 in one run: the receiving side lives in a second process (spawned),
so each end has a core, and both report their CPU time. Printed per variant: connection set-up
(ms), 1 KiB round trip (µs), bulk one-way throughput (MiB/s, and the ratio to plain TCP measured
in the same run) and CPU seconds per GiB for both ends together (bulk figures: the median of
BULK_RUNS).
"""

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import ssl
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from plexus.p2p.host import Host
from plexus.p2p.identity import PeerID

CHUNK = 1 << 20
BULK_RUNS = 3
SINK, ECHO = "/bench/sink/1.0.0", "/bench/echo/1.0.0"


def make_certificate(directory: str) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


# --- the receiving process ----------------------------------------------------------------------


async def tcp_session(reader, writer) -> None:
    """First byte picks the mode: b"S" sink (count bytes, answer the total), b"E" echo 1 KiB."""
    mode = await reader.read(1)
    if not mode:  # a set-up probe: connected and closed
        writer.close()
        return
    if mode == b"S":
        total = 0
        while data := await reader.read(CHUNK):
            total += len(data)
        writer.write(total.to_bytes(8, "big"))
    else:
        while True:
            try:
                writer.write(await reader.readexactly(1024))
            except asyncio.IncompleteReadError:
                break
    await writer.drain()
    writer.close()


async def plexus_sink(stream) -> None:
    total = 0
    while data := await stream.read():
        total += len(data)
    await stream.write(total.to_bytes(8, "big"))
    await stream.close()


async def plexus_echo(stream) -> None:
    while True:
        try:
            await stream.write(await stream.readexactly(1024))
        except asyncio.IncompleteReadError:
            break
    await stream.close()


def receiver(conn, cert_path: str, key_path: str) -> None:
    async def main():
        plain = await asyncio.start_server(tcp_session, "127.0.0.1", 0)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(cert_path, key_path)
        tls = await asyncio.start_server(tcp_session, "127.0.0.1", 0, ssl=context)
        host = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        host.set_stream_handler(SINK, plexus_sink)
        host.set_stream_handler(ECHO, plexus_echo)
        conn.send(
            {
                "plain": plain.sockets[0].getsockname()[1],
                "tls": tls.sockets[0].getsockname()[1],
                "plexus": str(host.get_visible_maddrs()[0]),
            }
        )
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def control():  # answers CPU-time queries while the loop serves
            while conn.recv() != "stop":
                conn.send(time.process_time())
            loop.call_soon_threadsafe(done.set)

        threading.Thread(target=control, daemon=True).start()
        await done.wait()
        await host.shutdown()

    asyncio.run(main())


# --- the sending side ---------------------------------------------------------------------------


class TCPVariant:
    def __init__(self, port: int, ssl_context=None):
        self.port, self.ssl_context = port, ssl_context

    async def connect(self):
        return await asyncio.open_connection(
            "127.0.0.1",
            self.port,
            ssl=self.ssl_context,
            server_hostname="localhost" if self.ssl_context else None,
        )

    async def setup(self) -> None:
        _reader, writer = await self.connect()
        writer.close()

    async def send_bulk(self, total: int):
        reader, writer = await self.connect()
        writer.write(b"S")
        payload = memoryview(os.urandom(CHUNK))
        for _ in range(total // CHUNK):
            writer.write(payload)
            await writer.drain()
        return reader, writer

    async def bulk(self, total: int) -> int:
        reader, writer = await self.send_bulk(total)
        writer.write_eof()
        received = int.from_bytes(await reader.readexactly(8), "big")
        writer.close()
        return received

    async def round_trips(self, count: int) -> None:
        reader, writer = await self.connect()
        writer.write(b"E")
        payload = os.urandom(1024)
        for _ in range(count):
            writer.write(payload)
            await reader.readexactly(1024)
        writer.close()


class TLSVariant(TCPVariant):
    async def bulk(self, total: int) -> int:
        # TLS over asyncio has no half-close, so the sink cannot answer a count: close once sent
        _reader, writer = await self.send_bulk(total)
        writer.close()
        await writer.wait_closed()
        return total


class PlexusVariant:
    def __init__(self, maddr: str, noise_ciphers: tuple[str, ...]):
        self.maddr = maddr
        self.peer = PeerID.from_string(maddr.rsplit("/", 1)[1])
        self.noise_ciphers = noise_ciphers  # what the dialer offers; the receiver accepts either

    async def setup(self) -> None:
        host = await Host(host_maddrs=(), noise_ciphers=self.noise_ciphers).start()
        await host.connect(self.maddr)
        await host.shutdown()

    async def bulk(self, total: int) -> int:
        async with Host(host_maddrs=(), noise_ciphers=self.noise_ciphers) as host:
            stream = await host.new_stream(self.maddr, SINK)
            payload = memoryview(os.urandom(CHUNK))
            for _ in range(total // CHUNK):
                await stream.write(payload)
            await stream.close()
            return int.from_bytes(await stream.readexactly(8), "big")

    async def round_trips(self, count: int) -> None:
        async with Host(host_maddrs=(), noise_ciphers=self.noise_ciphers) as host:
            stream = await host.new_stream(self.maddr, ECHO)
            payload = os.urandom(1024)
            for _ in range(count):
                await stream.write(payload)
                await stream.readexactly(1024)
            await stream.close()


async def measure(name: str, variant, conn, args) -> dict:
    started = time.perf_counter()
    for _ in range(args.setups):
        await variant.setup()
    setup_ms = (time.perf_counter() - started) / args.setups * 1e3
    started = time.perf_counter()
    await variant.round_trips(args.rounds)
    rtt_us = (time.perf_counter() - started) / args.rounds * 1e6
    total = args.bulk_mib * CHUNK
    runs = []  # (MiB/s, CPU-s/GiB): the median of BULK_RUNS, as one run on loopback varies by 2x
    for _ in range(BULK_RUNS):
        conn.send("cpu")
        remote_cpu = conn.recv()
        local_cpu = time.process_time()
        started = time.perf_counter()
        received = await variant.bulk(total)
        elapsed = time.perf_counter() - started
        local_cpu = time.process_time() - local_cpu
        conn.send("cpu")
        remote_cpu = conn.recv() - remote_cpu
        assert received == total, f"{name}: sent {total} bytes, receiver counted {received}"
        runs.append((total / CHUNK / elapsed, (local_cpu + remote_cpu) / (total / (1 << 30))))
    mib_s, cpu_per_gib = (statistics.median(column) for column in zip(*runs))
    return {"name": name, "setup_ms": setup_ms, "rtt_us": rtt_us, "mib_s": mib_s, "cpu_per_gib": cpu_per_gib}


async def run(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = make_certificate(tmp)
        parent, child = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=receiver, args=(child, cert_path, key_path))
        process.start()
        ports = parent.recv()
        client_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_tls.minimum_version = ssl.TLSVersion.TLSv1_3
        client_tls.load_verify_locations(cert_path)
        results = []
        try:
            results.append(await measure("plain asyncio TCP", TCPVariant(ports["plain"]), parent, args))
            results.append(
                await measure("asyncio + TLS 1.3", TLSVariant(ports["tls"], client_tls), parent, args)
            )
            for ciphers, name in (
                (("AESGCM",), "plexus (Noise AESGCM + yamux)"),
                (("ChaChaPoly",), "plexus (libp2p /noise ChaChaPoly + yamux)"),
            ):
                results.append(await measure(name, PlexusVariant(ports["plexus"], ciphers), parent, args))
        finally:
            parent.send("stop")
            process.join(10)
    baseline = results[0]["mib_s"]
    print(
        f"\n{args.bulk_mib} MiB one way (median of {BULK_RUNS}), {args.rounds} x 1 KiB round trips, {args.setups} connection set-ups, 127.0.0.1"
    )
    print("| variant | set-up ms | 1 KiB RTT µs | bulk MiB/s | x plain TCP | CPU-s/GiB (both ends) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['setup_ms']:.2f} | {r['rtt_us']:.0f} | {r['mib_s']:,.0f} | "
            f"{r['mib_s'] / baseline:.2f} | {r['cpu_per_gib']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bulk-mib", type=int, default=256, help="MiB sent one way in the bulk test")
    parser.add_argument("--rounds", type=int, default=1000, help="1 KiB round trips")
    parser.add_argument("--setups", type=int, default=50, help="connections set up and closed")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
