"""hivemind's `P2P` handle, over a Plexus `Host`, and the error names hivemind code catches.

hivemind's P2P is a handle to a go-libp2p daemon. Plexus has no daemon: a `Host` on the process's
background loop is the peer. `P2P` keeps the part of the handle's API that means something without
a daemon (create, identities, addresses, peers, shutdown); its coroutines run on the background loop
and can be awaited from any event loop. `replicate()` hands out the same host: in one process
everything shares it. `DHT(p2p=...)` and `RemoteExpert(info, p2p)` accept a `P2P` or a `Host`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from ..dht.p2p_transport import dial_initial_peers
from ..p2p.host import Host, HostOptions, PeerInfo
from ..p2p.identity import PeerID, PrivateKey, load_or_create_identity
from ..p2p.multiaddr import Multiaddr
from ..p2p.rpc import RPCError
from ..utils.background_loop import get_background_loop

P2PDaemonError = ConnectionError
"""What hivemind raises when its daemon cannot start or reach its bootstrap peers. Plexus raises
`DHTBootstrapError` (a ConnectionError) when no initial peer answers, and DialError (also one)
when a peer cannot be reached, so `except P2PDaemonError` catches both."""

P2PHandlerError = RPCError
"""A remote handler failed; the message is the handler's own error text."""

DEFAULT_BOOTSTRAP_TIMEOUT = 15.0


class P2P:
    """A started Host, seen through hivemind's P2P API. Create with `await P2P.create(...)`."""

    def __init__(self, host: Host, owned: bool = True):
        self.host, self._owned = host, owned

    @classmethod
    async def create(
        cls,
        initial_peers: Sequence[str | Multiaddr] | None = None,
        *,
        host_maddrs: Sequence[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str | Multiaddr] = (),
        identity_path: str | None = None,
        startup_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT,
        no_listen: bool = False,
        **unused_options,
    ) -> P2P:
        """Start a host (listening on `host_maddrs`, unless `no_listen`) and connect to `initial_peers`.

        hivemind's daemon options that have no Plexus meaning (`tls`, `quic`, ...) are accepted
        and ignored; see `DHT` for what each would have done."""
        key = load_or_create_identity(identity_path) if identity_path else PrivateKey.generate()
        options = HostOptions(
            host_maddrs=() if no_listen else tuple(str(addr) for addr in host_maddrs),
            announce_maddrs=tuple(str(addr) for addr in announce_maddrs),
        )

        async def start() -> Host:
            host = await Host(key, options).start()
            try:
                await dial_initial_peers(
                    host,
                    [Multiaddr(str(addr)) for addr in initial_peers or ()],
                    startup_timeout,
                    ensure_success=True,
                )
            except BaseException:
                await host.shutdown()
                raise
            return host

        return cls(await get_background_loop().submit(start()))

    @classmethod
    async def replicate(cls, p2p: P2P | Host) -> P2P:
        """The same host, not owned: shutting the replica down leaves the original running."""
        return cls(p2p.host if isinstance(p2p, P2P) else p2p, owned=False)

    @staticmethod
    def generate_identity(identity_path: str) -> None:
        """Write a new private key to `identity_path` (its directory must exist)."""
        directory = os.path.dirname(os.path.abspath(identity_path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"The directory {directory} for the identity does not exist")
        if os.path.exists(identity_path):
            raise FileExistsError(f"{identity_path} exists already; remove it first to replace the identity")
        load_or_create_identity(identity_path)

    @property
    def peer_id(self) -> PeerID:
        return self.host.peer_id

    async def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        return self.host.get_visible_maddrs(include_observed=latest)

    async def list_peers(self) -> list[PeerInfo]:
        return [self.host.peer_info(peer) or PeerInfo(peer) for peer in self.host.connected_peers()]

    async def wait_for_at_least_n_peers(self, n_peers: int, attempts: int = 3, delay: float = 1.0) -> None:
        """Wait until this many peers are connected (hivemind's attempts and delay)."""
        for _ in range(attempts):
            if len(self.host.connected_peers()) >= n_peers:
                return
            await asyncio.sleep(delay)  # polling with a bounded number of attempts, as hivemind does
        raise RuntimeError(f"Not enough peers: {len(self.host.connected_peers())} < {n_peers}")

    async def shutdown(self) -> None:
        if self._owned:
            await get_background_loop().submit(self.host.shutdown())

    def __repr__(self) -> str:
        return f"<P2P over {self.host!r}>"


__all__ = ["P2P", "P2PDaemonError", "P2PHandlerError", "PeerID", "PeerInfo"]
