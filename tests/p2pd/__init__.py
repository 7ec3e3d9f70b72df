"""The Go libp2p daemon (p2pd) as an interoperability test fixture.

`p2pd_factory` starts daemons on demand and kills every one of them at teardown:

    def test_something(p2pd_factory):
        async def main():
            a, b = await p2pd_factory.start_many(2)
            ...
        asyncio.run(main())

Without the binary (run `scripts/fetch_p2pd.py`) the test skips, except under CI=true where a
missing fixture must not pass silently: there it fails.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from .client import ControlClient, DaemonError, PeerInfo, StreamInfo, decode_multiaddr, encode_multiaddr
from .daemon import Daemon, find_binary

__all__ = [
    "ControlClient", "Daemon", "DaemonError", "DaemonFactory", "PeerInfo", "StreamInfo",
    "decode_multiaddr", "encode_multiaddr", "find_binary", "p2pd_factory",
]  # fmt: skip


class DaemonFactory:
    """Starts daemons for one test and remembers them so teardown can kill them all."""

    def __init__(self, binary):
        self.binary = binary
        self.daemons: list[Daemon] = []

    async def start(self, **options) -> Daemon:
        """Start one daemon; `options` are `Daemon`'s keyword arguments (dht=True, relay=True...)."""
        daemon = Daemon(self.binary, **options)
        self.daemons.append(daemon)
        return await daemon.start()

    async def start_many(self, count: int, **options) -> list[Daemon]:
        return list(await asyncio.gather(*(self.start(**options) for _ in range(count))))

    def stop_all(self) -> None:
        for daemon in self.daemons:
            daemon.stop()


@pytest.fixture
def p2pd_factory():
    binary = find_binary()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        reason = f"p2pd binary not found at {binary}: run scripts/fetch_p2pd.py (or set P2PD_BINARY)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " -- CI must run the interop tests", pytrace=False)
        pytest.skip(reason)
    factory = DaemonFactory(binary)
    try:
        yield factory
    finally:
        factory.stop_all()
