"""A hostile peer for tests and benchmarks: many connections to one host, each holding a silent stream.

`ConnectionFlood` dials the target again and again (several dials at once), completes the real
handshake on each connection (Noise, yamux) under one peer id or several, opens one stream per
connection, proposes a protocol (ping by default) and then sends nothing more. It counts what the
target let it keep and what it refused, and holds every connection that stays open until `stop()`.
Run it against a host of your own to check that it keeps serving others meanwhile.
"""

import asyncio
import itertools

from ..p2p.connection import Connection, host_decrypt_buffers
from ..p2p.identity import PeerID, PrivateKey
from ..p2p.multiaddr import Multiaddr, parse_host_port
from ..p2p.ping import PING_PROTOCOL
from ..p2p.protocols.errors import ProtocolError
from ..p2p.protocols.multistream import MultistreamDialer


class ConnectionFlood:
    """Open connections to `target` (…/p2p/<id>), `concurrency` at a time, under `identities` peer ids
    taken in turn (None: a fresh one for every connection)."""

    def __init__(
        self,
        target: Multiaddr | str,
        *,
        identities: int | None = 1,
        protocol: str = PING_PROTOCOL,
        concurrency: int = 32,
        dial_timeout: float = 10.0,
    ):
        self.target = Multiaddr(target) if isinstance(target, str) else target
        peer = self.target.peer_id
        if peer is None:
            raise ValueError(f"{self.target}: the target address must end in /p2p/<peer id>")
        self.peer: PeerID = peer
        self.host, self.port, _ = parse_host_port(self.target.without_peer_id())
        self.keys = [PrivateKey.generate() for _ in range(identities)] if identities is not None else []
        self.protocol, self.concurrency, self.dial_timeout = protocol, concurrency, dial_timeout
        self.held: list[Connection] = []
        self.opened = self.refused = 0
        self._buffers = host_decrypt_buffers()

    async def run(self, attempts: int) -> None:
        """Make `attempts` connections (each ends held, or refused by the target)."""
        keys = itertools.cycle(self.keys) if self.keys else iter(PrivateKey.generate, None)
        pending = iter(range(attempts))

        async def worker() -> None:
            for _ in pending:
                await self._one(next(keys))

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    async def _one(self, key: PrivateKey) -> None:
        connection = Connection(key, initiator=True, expected_peer=self.peer, decrypt_buffers=self._buffers)
        try:
            async with asyncio.timeout(self.dial_timeout):
                await asyncio.get_running_loop().create_connection(lambda: connection, self.host, self.port)
                await connection.upgrade()
                stream = connection.open_stream()
                await stream.write(MultistreamDialer([self.protocol]).data_to_send())  # and then: silence
        except (OSError, TimeoutError, ProtocolError):  # the target closed or refused it
            connection.abort("flood: refused")
            self.refused += 1
            return
        self.opened += 1
        self.held.append(connection)
        self.held = [held for held in self.held if not held.is_closed]

    @property
    def alive(self) -> int:
        """Connections the target still keeps open."""
        return sum(not connection.is_closed for connection in self.held)

    async def stop(self) -> None:
        for connection in self.held:
            connection.abort("flood over")
        self.held.clear()
