"""`plexus.DHT`: the synchronous, hivemind-compatible face of a DHT peer.

A DHT owns a libp2p Host and a DHTNode, both living on the process's background event loop
(`plexus.utils.background_loop`): no forked process, so a killed peer leaves nothing behind, and
averagers and optimizers in the same process share the host and loop. Every blocking method
(`get`, `store`, `run_coroutine`, ...) submits a coroutine to that loop; with `return_future=True`
it returns a `concurrent.futures.Future` instead (await it from asyncio with
`asyncio.wrap_future`). Asyncio users can also call the `*_async` methods on the loop itself.

Peers behind NAT (hivemind's P2P options, same names and defaults). Every peer can dial through
circuit relays (`use_relay`) and serves AutoNAT dial-backs (`auto_nat`) and, unless it is private,
a bounded relay (`relay_service`). What a peer does about its own reachability is decided once,
while it starts, and only when something depends on it (`client_mode=None` or `use_auto_relay`):
it asks its initial peers to dial it back (AutoNAT), unless `force_reachability` says. A private
peer with `use_auto_relay` reserves slots on relays (`relays`, else initial peers that relay, else
relays announced in the DHT under RELAY_KEY by verified public peers) and advertises
/p2p-circuit addresses; relayed connections are then upgraded to direct ones by hole punching
(DCUtR) when the NATs allow. With `client_mode=None` a private peer without relays becomes a
client: it only dials out. Peers listening on 127.0.0.1 with the default options never probe,
so local swarms start as fast as before. `use_ipfs` finds initial peers given as `/p2p/<id>`
through a libp2p Kademlia DHT (the public IPFS one unless `ipfs_bootstrap_peers` says otherwise).
"""

import asyncio
import concurrent.futures
import os
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..p2p.auth import AuthorizerBase
from ..p2p.autonat import AutoNAT, AutoNATService
from ..p2p.dcutr import HolePuncher
from ..p2p.host import DialError, Host, HostOptions
from ..p2p.identity import PeerID, PrivateKey, load_or_create_identity
from ..p2p.multiaddr import Multiaddr, MultiaddrError
from ..p2p.protocols import autonat as autonat_core
from ..p2p.protocols.autonat import Reachability
from ..p2p.protocols.errors import ProtocolError
from ..p2p.protocols.relay import HOP_PROTOCOL, RelayLimits
from ..p2p.relay import RelayClient, RelayError, RelayService
from ..utils.background_loop import get_background_loop
from ..utils.logging import get_logger, use_default_log_handler
from ..utils.timed_storage import ValueWithExpiration
from ..utils.timing import get_dht_time
from .node import DHTNode
from .p2p_transport import HostDHTTransport, dial_initial_peers
from .routing import DHTID
from .validation import CompositeValidator, RecordValidatorBase

if TYPE_CHECKING:  # imported when first used: only use_ipfs needs it
    from ..p2p.kad import KademliaClient

logger = get_logger(__name__)

DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
# hivemind options (mostly its daemon's) that mean nothing here, and why: accepted with a warning
HIVEMIND_OPTIONS_WITHOUT_EFFECT = {
    "tls": "connections are always encrypted and authenticated with Noise",
    "quic": "Plexus speaks TCP",
    "use_relay_hop": "see relay_service",
    "use_relay_discovery": "see relays",
    "conn_manager": "idle connections are closed by the host",
    "idle_timeout": "see HostOptions",
    "dht_mode": "there is no libp2p daemon DHT to configure",
    "nat_port_map": "Plexus does no UPnP/NAT-PMP",
    "relay_hop_limit": "see relay_service",
    "persistent_conn_max_msg_size": "message bounds are per protocol",
    "check_if_identity_free": "there is no daemon whose identity could collide",
    "daemon": "the DHT runs in this process, not in a child process",
}
RELAY_KEY = "_plexus.relays"  # {peer id: [its addresses]} of verified public peers that relay
RELAY_ANNOUNCE_PERIOD = 300.0  # seconds between announcements; each lasts twice as long
MAX_RELAYS = 2  # reservations a private peer keeps
MAX_RELAY_CANDIDATES = 8  # relays tried before giving up
MAX_AUTONAT_SERVERS = 5


class DHT:
    """A DHT peer: `DHT(initial_peers=[...], start=True)`, then `store`/`get`; `shutdown()` when done."""

    def __init__(
        self,
        initial_peers: Sequence[str | Multiaddr] | None = None,
        *,
        start: bool = False,
        client_mode: bool | None = False,
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        announce_maddrs: Sequence[str] = (),
        identity_path: str | None = None,
        record_validators: Iterable[RecordValidatorBase] = (),
        num_workers: int = 4,
        startup_timeout: float = 30.0,
        shutdown_timeout: float = 3.0,
        await_ready: bool = True,
        use_relay: bool = True,
        use_auto_relay: bool = False,
        relays: Sequence[str | Multiaddr] = (),
        auto_nat: bool = True,
        force_reachability: str | None = None,
        relay_service: bool | RelayLimits = True,
        hole_punching: bool = True,
        use_ipfs: bool = False,
        ipfs_bootstrap_peers: Sequence[str | Multiaddr] | None = None,
        noise_ciphers: Sequence[str] = HostOptions.noise_ciphers,
        swarm_key: bytes | None = None,
        authorizer: AuthorizerBase | None = None,
        p2p: Host | None = None,
        no_listen: bool = False,
        **node_options,
    ):
        """Names and defaults are hivemind's; the NAT, cipher and private-swarm options are Plexus's.

        Args:
            initial_peers: multiaddrs of peers already in the swarm (…/p2p/<peer id>); none: start one.
            start: start at once (else call `run_in_background()`).
            host_maddrs: addresses to listen on; port 0 lets the OS pick one.
            announce_maddrs: addresses to advertise instead (e.g. a public IP behind port forwarding).
            identity_path: a file holding this peer's Ed25519 key, created on first use, so that the
                peer id stays the same across restarts.
            record_validators: checks every stored and returned record passes (signatures, schemas).
            num_workers: requests a lookup keeps in flight at once.
            startup_timeout: the longest start-up (joining the initial peers included) may take.
            shutdown_timeout: the longest `shutdown()` waits for the node to stop cleanly.
            await_ready: with `start`, wait until the DHT is up before returning.
            p2p: run on this started Host (or anything with a `.host`, such as what
                `replicate_p2p()` returns) instead of a new one; the DHT leaves it running at shutdown.
            no_listen: accept no incoming connections (no host_maddrs), as hivemind's P2P option.
            client_mode: True: only dial out, take part as a client; None: decide at start (a peer
                that AutoNAT finds private and that has no relay becomes a client).
            use_relay: dial peers through circuit relays and accept circuits from our relays.
            use_auto_relay: when private, reserve slots on relays and advertise relayed addresses.
            relays: relays to use (…/p2p/<relay id>); default: initial peers that relay, then the DHT's.
            auto_nat: serve AutoNAT dial-backs, and ask initial peers for them when a choice depends on it.
            force_reachability: "public" or "private": skip AutoNAT and take this as the verdict.
            relay_service: relay for others (bounded by RelayLimits; pass one to change the bounds)
                unless we are private or a client.
            hole_punching: upgrade relayed connections to direct ones (DCUtR) when `use_relay`.
            use_ipfs: find initial peers given as /p2p/<peer id> through the libp2p Kademlia DHT.
            ipfs_bootstrap_peers: where to join that DHT (default: the public IPFS bootstrap peers).
            noise_ciphers: Noise cipher functions to offer, most preferred first (`HostOptions`); put
                "ChaChaPoly" first on a CPU without AES instructions.
            swarm_key: a private network's 32-byte pre-shared key (`plexus.p2p.pnet.load_swarm_key`
                reads a swarm.key file): only peers holding it can connect at all.
            authorizer: admit only peers it accepts (e.g. `SignedTokenAuthorizer`, access tokens signed
                by the run's authority), on every protocol of this peer's host: DHT, averaging, experts.
            **node_options: passed on to `DHTNode.create`, e.g. `storage_limits`, a
                `plexus.dht.storage.StorageLimits`: the bounds of what this peer stores for others
                (per sender, per owner, per key, in all).
        """
        if "PLEXUS_LOGLEVEL" in os.environ:  # asked for in the environment: shown even in a bare script
            use_default_log_handler()
        if force_reachability not in (None, "public", "private"):
            raise ValueError(
                f"force_reachability must be None, 'public' or 'private', not {force_reachability!r}"
            )
        for option in [name for name in node_options if name in HIVEMIND_OPTIONS_WITHOUT_EFFECT]:
            reason = HIVEMIND_OPTIONS_WITHOUT_EFFECT[option]
            logger.warning(f"DHT({option}=...) has no effect in Plexus: {reason}")
            node_options.pop(option)
        self.initial_peers = [Multiaddr(addr) for addr in initial_peers or ()]
        self._client_mode = client_mode
        self._given_host: Host | None = getattr(p2p, "host", p2p)
        self.host_maddrs = tuple(host_maddrs) if client_mode is not True and not no_listen else ()
        self.announce_maddrs = tuple(announce_maddrs)
        self.use_relay, self.use_auto_relay, self.auto_nat = use_relay, use_auto_relay, auto_nat
        trusted_relays = node_options.pop("trusted_relays", None)  # hivemind's name for them
        self.relays = [Multiaddr(addr) for addr in relays or trusted_relays or ()]
        self.force_reachability, self.hole_punching = force_reachability, hole_punching and use_relay
        self.host_options = HostOptions(  # checked here, not at start
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs,
            reuse_port=self.hole_punching and bool(self.host_maddrs),
            noise_ciphers=tuple(noise_ciphers),
            swarm_key=swarm_key,
        )
        self.relay_limits = (
            relay_service
            if isinstance(relay_service, RelayLimits)
            else RelayLimits()
            if relay_service
            else None
        )
        self.use_ipfs, self.ipfs_bootstrap_peers = use_ipfs, ipfs_bootstrap_peers
        self._reachability = Reachability(force_reachability) if force_reachability else Reachability.UNKNOWN
        self.relay_client: RelayClient | None = None
        self.relay_service: RelayService | None = None
        self.hole_puncher: HolePuncher | None = None
        self.autonat_service: AutoNATService | None = None
        self.autonat: AutoNAT | None = None
        self.kademlia: KademliaClient | None = None  # with use_ipfs
        self._announcer: asyncio.Task | None = None
        if self._given_host is not None:
            self.private_key = self._given_host.private_key
        elif identity_path:
            self.private_key = load_or_create_identity(identity_path)
        else:
            self.private_key = PrivateKey.generate()
        self.peer_id: PeerID = self.private_key.peer_id
        self._record_validator = CompositeValidator(record_validators)
        self.authorizer = authorizer
        self.num_workers, self.startup_timeout, self.shutdown_timeout = (
            num_workers,
            startup_timeout,
            shutdown_timeout,
        )
        self._node_options = node_options
        self.host: Host | None = None
        self.node: DHTNode | None = None
        self._background = get_background_loop()
        self._ready: concurrent.futures.Future | None = None
        if start:
            self.run_in_background(await_ready=await_ready)

    @property
    def _started_host(self) -> Host:
        """The host, for the code that runs once `_start` has made it."""
        if self.host is None:
            raise RuntimeError("the DHT has not started: its host does not exist yet")
        return self.host

    @property
    def _started_node(self) -> DHTNode:
        """The node, for the code that runs once `_start` has made it."""
        if self.node is None:
            raise RuntimeError(
                "the DHT is not running: create it with start=True or call run_in_background()"
            )
        return self.node

    # --- life cycle --------------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the host and join the DHT on the background loop; wait for it unless told not to."""
        if self._ready is None:
            self._ready = self._background.submit(self._start())
        if await_ready:
            self.wait_until_ready(timeout)

    start = run_in_background

    def wait_until_ready(self, timeout: float | None = None) -> None:
        if self._ready is None:
            raise RuntimeError(
                "the DHT is not running: create it with start=True or call run_in_background()"
            )
        try:
            self._ready.result(timeout if timeout is not None else self.startup_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the DHT did not start within {timeout or self.startup_timeout} s") from None

    async def _start(self) -> None:
        if self._given_host is not None:
            self.host = self._given_host
            listening = bool(self._started_host.get_listen_maddrs())
        else:
            listening = bool(self.host_maddrs)
            self.host = await Host(self.private_key, self.host_options, authorizer=self.authorizer).start()
        try:
            self._start_nat_components(listening)
            if self.use_ipfs:
                await self._join_kademlia()
            self._started_host.peer_router = self._find_peer
            initial_peer_ids = await self._connect_to_initial_peers()
            await self._decide_reachability(initial_peer_ids)
            private = self._reachability is Reachability.PRIVATE
            if private and self.use_auto_relay:
                await self._reserve_relays(await self._relay_candidates(initial_peer_ids, lookup=False))
            client_mode = self._client_mode
            if client_mode is None:  # "auto": a private peer is a client unless a relay makes it reachable
                if private and self.use_auto_relay and not self._is_relayed():
                    await self._reserve_relays(await self._relay_candidates(initial_peer_ids, lookup=True))
                client_mode = private and not self._is_relayed()
            self.node = await self._create_node(initial_peer_ids, client_mode)
            self._client_mode = client_mode
            if private and self.use_auto_relay and not client_mode and not self._is_relayed():
                await self._reserve_relays(await self._relay_candidates(initial_peer_ids, lookup=True))
            self._advise(private, client_mode)
            if self.relay_limits is not None and listening and not client_mode and not private:
                self.relay_service = RelayService(self._started_host, self.relay_limits).start()
                if self._reachability is Reachability.PUBLIC:  # listed once we are ready, then kept listed
                    await self._announce_relay_once()
                    self._announcer = asyncio.get_running_loop().create_task(self._announce_relay())
        except BaseException:
            await self._shutdown()
            raise
        logger.debug(f"DHT peer {self.peer_id} is ready ({self.nat_mode}, reachability {self.reachability})")

    async def _create_node(self, initial_peer_ids: list[PeerID], client_mode: bool) -> DHTNode:
        return await DHTNode.create(
            node_id=DHTID.generate(source=self.peer_id.to_bytes()),
            initial_peers=initial_peer_ids,
            rpc=HostDHTTransport(self._started_host),
            client_mode=client_mode,
            record_validator=self._record_validator,
            num_workers=self.num_workers,
            **self._node_options,
        )

    # --- NAT traversal (see the module docstring) ----------------------------------------------------

    def _start_nat_components(self, listening: bool) -> None:
        if self.use_relay:
            if self.hole_punching and listening:
                self.hole_puncher = HolePuncher(self._started_host).start()
            on_inbound = self.hole_puncher.on_inbound_circuit if self.hole_puncher else None
            self.relay_client = RelayClient(self._started_host, on_inbound_circuit=on_inbound).start()
        if self.auto_nat and listening:
            self.autonat_service = AutoNATService(self._started_host).start()

    async def _decide_reachability(self, initial_peer_ids: list[PeerID]) -> None:
        """Ask initial peers to dial us back, when a choice depends on the answer."""
        needed = self._client_mode is None or self.use_auto_relay
        if self.force_reachability or not needed or not self.auto_nat or not self.host_maddrs:
            return
        servers = []
        for peer in initial_peer_ids[:MAX_AUTONAT_SERVERS]:
            connection = self._started_host.get_connection(peer)
            if connection is None or getattr(connection, "relayed", False):
                continue
            try:
                info = await self._started_host.identify(peer, timeout=self.startup_timeout / 4)
            except (TimeoutError, ConnectionError):
                continue
            if autonat_core.PROTOCOL in info.protocols:
                servers.append(peer)
        if not servers:
            logger.debug("no initial peer serves AutoNAT: reachability stays unknown")
            return
        self.autonat = AutoNAT(self._started_host, confidence=min(3, len(servers)))
        try:
            async with asyncio.timeout(self.startup_timeout / 2):
                self._reachability = await self.autonat.probe(servers, MAX_AUTONAT_SERVERS)
        except TimeoutError:
            logger.debug("AutoNAT probes timed out: reachability stays unknown")

    async def _relay_candidates(self, initial_peer_ids: list[PeerID], lookup: bool) -> list[list[Multiaddr]]:
        """Addresses of relays to try, one list per relay: `relays` if given, else initial peers that
        serve the relay protocol, then (with `lookup`) the relays announced in the DHT."""
        if self.relays:
            return [[addr] for addr in self.relays] if not lookup else []
        candidates: dict[PeerID, list[Multiaddr]] = {}
        if not lookup:
            for peer in initial_peer_ids:
                info = self._started_host.peer_info(peer)
                if info is not None and HOP_PROTOCOL in info.protocols and not self._is_reserved(peer):
                    candidates[peer] = [addr.with_peer_id(peer) for addr in info.addrs if not addr.is_circuit]
            return [addrs for addrs in candidates.values() if addrs]
        node = self.node or await self._create_node(initial_peer_ids, client_mode=True)
        try:
            found = await node.get(RELAY_KEY, latest=True)
        finally:
            if node is not self.node:
                await node.shutdown()
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, entry in entries.items():
            try:
                relay = PeerID.from_string(str(subkey))
                addrs = [Multiaddr(text) for text in entry.value][:MAX_RELAY_CANDIDATES]
            except (ValueError, TypeError, MultiaddrError):
                continue  # an announcement we cannot read: skip it
            if relay != self.peer_id and not self._is_reserved(relay):
                candidates[relay] = [addr for addr in addrs if addr.peer_id == relay and not addr.is_circuit]
        relays = [addrs for addrs in candidates.values() if addrs]
        random.shuffle(relays)  # spread private peers over the announced relays
        return relays

    def _is_relayed(self) -> bool:
        """Whether some relay holds a slot for us (never without use_relay: there is no relay client)."""
        return self.relay_client is not None and bool(self.relay_client.reservations)

    def _is_reserved(self, relay: PeerID) -> bool:
        return self.relay_client is not None and relay in self.relay_client.reservations

    async def _reserve_relays(self, candidates: list[list[Multiaddr]]) -> None:
        """Reserve on up to MAX_RELAYS of the candidates, a few at once; failures are logged, not raised."""
        if self.relay_client is None:
            if candidates:
                logger.warning("use_auto_relay needs use_relay=True; not reserving any relay")
            return

        relay_client = self.relay_client

        async def reserve(addrs: list[Multiaddr]) -> None:
            for addr in addrs[:MAX_RELAY_CANDIDATES]:
                try:
                    await relay_client.reserve(addr)
                    return
                except (
                    RelayError,
                    DialError,
                    ProtocolError,
                    ConnectionError,
                    TimeoutError,
                    ValueError,
                ) as error:
                    logger.debug(f"could not reserve a slot on relay {addr}: {error}")

        candidates = candidates[:MAX_RELAY_CANDIDATES]
        while candidates and len(relay_client.reservations) < MAX_RELAYS:
            batch_size = MAX_RELAYS - len(relay_client.reservations)
            batch, candidates = candidates[:batch_size], candidates[batch_size:]
            await asyncio.gather(*(reserve(addrs) for addrs in batch))

    def _advise(self, private: bool, client_mode: bool) -> None:
        if not private or client_mode or self._is_relayed():
            return
        if self.use_auto_relay:
            logger.warning(
                "other peers cannot connect to this one (AutoNAT) and no relay gave it a slot: it will "
                "miss incoming requests. Pass relays=[...] (--relays), or client_mode=True"
            )
        else:
            logger.warning(
                "other peers cannot connect to this one (AutoNAT): it will miss incoming requests. "
                "Forward its port and pass announce_maddrs, or use_auto_relay=True, or client_mode=True"
            )

    async def _announce_relay(self) -> None:
        """Keep this (verified public) peer listed under RELAY_KEY while its relay service runs."""
        while True:
            await asyncio.sleep(RELAY_ANNOUNCE_PERIOD)  # a periodic refresh, not synchronisation
            await self._announce_relay_once()

    async def _announce_relay_once(self) -> None:
        addrs = [str(addr) for addr in self._started_host.get_visible_maddrs() if not addr.is_circuit]
        try:
            await self._started_node.store(
                RELAY_KEY, addrs, get_dht_time() + 2 * RELAY_ANNOUNCE_PERIOD, subkey=str(self.peer_id)
            )
        except Exception as error:  # the next round tries again
            logger.debug(f"could not announce our relay service: {error!r}")

    @property
    def reachability(self) -> str:
        """ "public", "private" (AutoNAT or force_reachability) or "unknown" (not asked, or no answer)."""
        return self._reachability.value

    @property
    def nat_mode(self) -> str:
        """ "client" (dials out only), "relay" (reachable through relays) or "direct" (listens itself)."""
        if self._client_mode:
            return "client"
        return "relay" if self._is_relayed() else "direct"

    @property
    def client_mode(self) -> bool:
        if self._client_mode is None and self._ready is not None and not self._background.in_loop_thread():
            self.wait_until_ready()  # "auto" is decided while starting
        return bool(self._client_mode)

    async def check_reachability(self, peers: Sequence[PeerID] | None = None, timeout: float = 15.0) -> str:
        """Ask connected peers (or `peers`) to dial us back now; returns and records the verdict."""
        servers = [
            peer
            for peer in (peers or self._started_host.connected_peers())
            if (info := self._started_host.peer_info(peer)) and autonat_core.PROTOCOL in info.protocols
        ]
        self.autonat = AutoNAT(
            self._started_host, confidence=max(1, min(3, len(servers))), request_timeout=timeout
        )
        self._reachability = await self.autonat.probe(servers, MAX_AUTONAT_SERVERS)
        return self.reachability

    async def _join_kademlia(self) -> None:
        from ..p2p.kad import IPFS_BOOTSTRAP_PEERS, KademliaClient, KademliaError

        bootstrap = (
            self.ipfs_bootstrap_peers if self.ipfs_bootstrap_peers is not None else IPFS_BOOTSTRAP_PEERS
        )
        self.kademlia = KademliaClient(self._started_host, serve=bool(self.host_maddrs)).start()
        try:
            await self.kademlia.bootstrap(
                [Multiaddr(addr) for addr in bootstrap], timeout=self.startup_timeout / 3
            )
        except KademliaError as error:  # initial peers given by address still work
            logger.warning(
                f"use_ipfs: {error}. Peers given as /p2p/<id> alone cannot be found; "
                f"check the network, or pass ipfs_bootstrap_peers"
            )

    async def _connect_to_initial_peers(self) -> list[PeerID]:
        """Dial every initial peer at once; fail, naming each address and why, if none answers."""
        timeout = (
            self._node_options.get("bootstrap_timeout") or self._node_options.get("wait_timeout", 3.0) * 3
        )
        ensure_success = self._node_options.get("ensure_bootstrap_success", True)
        return await dial_initial_peers(
            self._started_host, self.initial_peers, timeout, ensure_success, dial=self._dial
        )

    async def _find_peer(self, peer_id: PeerID) -> None:
        """Peer routing: node ids are hashes of peer ids, so a lookup of that id reaches the peer
        itself or its neighbours, and their answers carry its addresses into our host. With
        `use_ipfs`, the Kademlia DHT is asked too (before we have a node, it is the only way)."""
        if self.node is not None:
            await self.node.find_nearest_nodes([DHTID.generate(source=peer_id.to_bytes())], exclude_self=True)
        info = self._started_host.peer_info(peer_id)
        if self.kademlia is not None and not (info and info.addrs):
            await self.kademlia.find_peer(peer_id)

    async def _dial(self, addr: Multiaddr, timeout: float) -> PeerID:
        if addr.protocols() == ["p2p"] and addr.peer_id is not None:  # /p2p/<id> alone: look it up
            if self.kademlia is None:
                raise DialError(
                    f"{addr} has no address to dial: give one, or pass use_ipfs=True to look it up"
                )
            try:
                connection = await self._started_host.connect(addr.peer_id, timeout=timeout)
            except DialError as error:
                raise DialError(f"{error} (looked up through the Kademlia DHT)") from None
        else:
            connection = await self._started_host.connect(addr, timeout=timeout)
        return connection.peer

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
        if self._announcer is not None:
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        if self.node is not None:
            await self.node.shutdown()
        for component in (
            self.relay_service,
            self.relay_client,
            self.hole_puncher,
            self.autonat_service,
            self.kademlia,
        ):
            if component is not None:
                await component.stop()
        if self.host is not None and self.host is not self._given_host:
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
            raise RuntimeError(
                "the DHT is not running: create it with start=True or call run_in_background()"
            )
        future = self._background.submit(coroutine)
        return future if return_future else future.result()

    def get(self, key: Any, latest: bool = False, return_future: bool = False) -> ValueWithExpiration | None:
        """The value stored under `key` (or None); with `latest=True`, the newest one in the swarm."""
        return self._call(self.get_async(key, latest), return_future)

    async def get_async(self, key: Any, latest: bool = False) -> ValueWithExpiration | None:
        return await self._started_node.get(key, latest=latest)

    def store(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False
    ) -> bool:
        """Store `value` until `expiration_time` (absolute DHT time); with `subkey`, one entry of a dictionary."""
        return self._call(self.store_async(key, value, expiration_time, subkey), return_future)

    async def store_async(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        return await self._started_node.store(key, value, expiration_time, subkey=subkey)

    def run_coroutine(self, coroutine: Callable[["DHT", DHTNode], Any], return_future: bool = False):
        """Run `await coroutine(dht, node)` on the DHT's event loop and return its result."""
        return self._call(coroutine(self, self._started_node), return_future)

    def add_validators(self, record_validators: Iterable[RecordValidatorBase]) -> None:
        self._record_validator.extend(record_validators)

    async def replicate_p2p(self) -> Host:
        """The DHT's own Host, for RemoteExpert and other protocols (hivemind replicates its daemon
        here; in Plexus everything in the process shares the host and the event loop)."""
        if not self._background.in_loop_thread():
            self.wait_until_ready()
        return self._started_host

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """Addresses other peers can use as `initial_peers` to reach this one."""
        if self.client_mode:
            return []
        self.wait_until_ready()
        return self._started_host.get_visible_maddrs(include_observed=latest)

    def __repr__(self) -> str:
        return f"<DHT {self.peer_id} {'running' if self.is_alive() else 'stopped'}>"
