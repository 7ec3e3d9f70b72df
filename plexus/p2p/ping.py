"""Ping (`/ipfs/ping/1.0.0`) over a Host: echo 32-byte payloads, and measure round trips.

A peer may keep one ping stream open and ping on it again and again; we echo each payload. The
bounds: at most MAX_STREAMS_PER_PEER ping streams per peer at once (the spec asks for one, we allow
a spare), each payload must arrive within the host's `request_timeout` of the previous echo, and a
peer may ping `HostOptions.ping_rate` times a second on average (`ping_burst` at once). A peer past
its rate has its stream reset, and the refusal is logged (rate-limited) with its peer id.
"""

import asyncio
import os
import time

from .identity import PeerID
from .limits import TokenBucket
from .multiaddr import Multiaddr
from .protocols.errors import ProtocolError
from .stream import Stream

PING_PROTOCOL = "/ipfs/ping/1.0.0"
PING_SIZE = 32
MAX_STREAMS_PER_PEER = 2


class PingService:
    """Serves ping for one host and pings others (`Host.ping`)."""

    def __init__(self, host):
        self.host = host
        self.rate = TokenBucket(host.options.ping_rate, host.options.ping_burst)
        host.set_stream_handler(PING_PROTOCOL, self._serve, max_per_peer=MAX_STREAMS_PER_PEER)

    async def _serve(self, stream: Stream) -> None:
        peer = stream.remote_peer
        while True:
            try:
                async with asyncio.timeout(self.host.options.request_timeout):
                    payload = await stream.readexactly(PING_SIZE)
            except asyncio.IncompleteReadError:
                break
            except TimeoutError:
                if stream.is_reset:  # the host's first-bytes deadline came first, and said so
                    return
                self.host.refused(
                    ("ping timeout", peer),
                    f"{peer} sent no ping for "
                    f"{self.host.options.request_timeout} s on an open ping stream; reset it",
                )
                stream.reset()
                return
            if not self.rate.allow(peer, time.monotonic()):
                self.host.refused(
                    ("ping rate", peer),
                    f"{peer} pings faster than ping_rate="
                    f"{self.host.options.ping_rate}/s; reset its ping stream",
                )
                stream.reset()
                return
            await stream.write(payload)
        await stream.close()

    async def ping(self, peer: PeerID | Multiaddr | str, timeout: float | None = 10.0) -> float:
        async with asyncio.timeout(timeout):
            stream = await self.host.new_stream(peer, PING_PROTOCOL)
            payload = os.urandom(PING_SIZE)
            started = time.perf_counter()
            await stream.write(payload)
            echo = await stream.readexactly(PING_SIZE)
            rtt = time.perf_counter() - started
            await stream.close()
        if echo != payload:
            raise ProtocolError(f"{peer} answered our ping with different bytes")
        return rtt
