"""`plexus.DHT`: the synchronous, hivemind-compatible face of a DHT peer.

A DHT owns a libp2p Host and a DHTNode, both living on the process's background event loop
(`plexus.utils.background_loop`): no forked process, so a killed peer leaves nothing behind, and
averagers and optimizers in the same process share the host and loop. Every blocking method
(`get`, `store`, `run_coroutine`, ...) submits a coroutine to that loop; with `return_future=True`
it returns a `concurrent.futures.Future` instead (await it from asyncio with
`asyncio.wrap_future`). Asyncio users can also call the `*_async` methods on the loop itself.
"""

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..p2p.host import Host
from ..p2p.identity import PeerID, PrivateKey, load_or_create_identity
from ..p2p.multiaddr import Multiaddr
from ..utils.background_loop import get_background_loop
from ..utils.logging import get_logger
from ..utils.timed_storage import ValueWithExpiration
from .node import DHTBootstrapError, DHTNode
from .p2p_transport import HostDHTTransport
from .routing import DHTID
from .validation import CompositeValidator, RecordValidatorBase

logger = get_logger(__name__)

DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)


class DHT:
    """A DHT peer: `DHT(initial_peers=[...], start=True)`, then `store`/`get`; `shutdown()` when done."""

    def __init__(self, initial_peers: Sequence[str | Multiaddr] | None = None, *, start: bool = False,
                 client_mode: bool = False, host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
                 announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                 record_validators: Iterable[RecordValidatorBase] = (), num_workers: int = 4,
                 startup_timeout: float = 30.0, shutdown_timeout: float = 3.0, await_ready: bool = True,
                 **node_options):
        self.initial_peers = [Multiaddr(addr) for addr in initial_peers or ()]
        self.client_mode = client_mode
        self.host_maddrs = tuple(host_maddrs) if not client_mode else ()
        self.announce_maddrs = tuple(announce_maddrs)
        self.private_key = load_or_create_identity(identity_path) if identity_path else PrivateKey.generate()
        self.peer_id: PeerID = self.private_key.peer_id
        self._record_validator = CompositeValidator(record_validators)
        self.num_workers, self.startup_timeout, self.shutdown_timeout = num_workers, startup_timeout, shutdown_timeout
        self._node_options = node_options
        self.host: Host | None = None
        self.node: DHTNode | None = None
        self._background = get_background_loop()
        self._ready: concurrent.futures.Future | None = None
        if start:
            self.run_in_background(await_ready=await_ready)

    # --- life cycle --------------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the host and join the DHT on the background loop; wait for it unless told not to."""
        if self._ready is None:
            self._ready = self._background.submit(self._start())
        if await_ready:
            self.wait_until_ready(timeout)

    start = run_in_background

    def wait_until_ready(self, timeout: float | None = None) -> None:
        try:
            self._ready.result(timeout if timeout is not None else self.startup_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the DHT did not start within {timeout or self.startup_timeout} s") from None

    async def _start(self) -> None:
        self.host = await Host(self.private_key, host_maddrs=self.host_maddrs,
                               announce_maddrs=self.announce_maddrs).start()
        try:
            initial_peer_ids = await self._connect_to_initial_peers()
            self.node = await DHTNode.create(
                node_id=DHTID.generate(source=self.peer_id.to_bytes()),
                initial_peers=initial_peer_ids, rpc=HostDHTTransport(self.host), client_mode=self.client_mode,
                record_validator=self._record_validator, num_workers=self.num_workers, **self._node_options,
            )
        except BaseException:
            await self.host.shutdown()
            raise
        self.host.peer_router = self._find_peer
        logger.debug(f"DHT peer {self.peer_id} is ready")

    async def _connect_to_initial_peers(self) -> list[PeerID]:
        """Dial every initial peer at once; fail, naming each address and why, if none answers."""
        if not self.initial_peers:
            return []
        timeout = self._node_options.get("bootstrap_timeout") or self._node_options.get("wait_timeout", 3.0) * 3
        results = await asyncio.gather(*(self._dial(addr, timeout) for addr in self.initial_peers),
                                       return_exceptions=True)
        connected = [result for result in results if isinstance(result, PeerID)]
        if not connected and self._node_options.get("ensure_bootstrap_success", True):
            reasons = "; ".join(f"{addr}: {result}" for addr, result in zip(self.initial_peers, results))
            raise DHTBootstrapError(f"could not reach any initial peer (tried {reasons}). "
                                    f"Are the addresses right and the ports open?")
        return list(dict.fromkeys(connected))

    async def _find_peer(self, peer_id: PeerID) -> None:
        """Peer routing: node ids are hashes of peer ids, so a lookup of that id reaches the peer
        itself or its neighbours, and their answers carry its addresses into our host."""
        await self.node.find_nearest_nodes([DHTID.generate(source=peer_id.to_bytes())], exclude_self=True)

    async def _dial(self, addr: Multiaddr, timeout: float) -> PeerID:
        connection = await self.host.connect(addr, timeout=timeout)
        return connection.remote_peer

    def shutdown(self) -> None:
        """Leave the DHT and close the host. Idempotent; call it from any thread but the loop's."""
        ready, self._ready = self._ready, None
        if ready is None:
            return
        try:
            ready.result(self.startup_timeout)
        except Exception:  # it never started, so there is nothing to close
            return
        self._background.run(self._shutdown(), timeout=self.shutdown_timeout + 5)

    async def _shutdown(self) -> None:
        if self.node is not None:
            await self.node.shutdown()
        await self.host.shutdown()

    def is_alive(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    def __enter__(self) -> "DHT":
        if self._ready is None:
            self.run_in_background()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # --- the API -----------------------------------------------------------------------------------

    def _call(self, coroutine, return_future: bool):
        if self._ready is None:
            coroutine.close()
            raise RuntimeError("the DHT is not running: create it with start=True or call run_in_background()")
        future = self._background.submit(coroutine)
        return future if return_future else future.result()

    def get(self, key: Any, latest: bool = False, return_future: bool = False) -> ValueWithExpiration | None:
        """The value stored under `key` (or None); with `latest=True`, the newest one in the swarm."""
        return self._call(self.get_async(key, latest), return_future)

    async def get_async(self, key: Any, latest: bool = False) -> ValueWithExpiration | None:
        return await self.node.get(key, latest=latest)

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> bool:
        """Store `value` until `expiration_time` (absolute DHT time); with `subkey`, one entry of a dictionary."""
        return self._call(self.store_async(key, value, expiration_time, subkey), return_future)

    async def store_async(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        return await self.node.store(key, value, expiration_time, subkey=subkey)

    def run_coroutine(self, coroutine: Callable[["DHT", DHTNode], Any], return_future: bool = False):
        """Run `await coroutine(dht, node)` on the DHT's event loop and return its result."""
        return self._call(coroutine(self, self.node), return_future)

    def add_validators(self, record_validators: Iterable[RecordValidatorBase]) -> None:
        self._record_validator.extend(record_validators)

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """Addresses other peers can use as `initial_peers` to reach this one."""
        if self.client_mode:
            return []
        self.wait_until_ready()
        return self.host.get_visible_maddrs(include_observed=latest)

    def __repr__(self) -> str:
        return f"<DHT {self.peer_id} {'running' if self.is_alive() else 'stopped'}>"
