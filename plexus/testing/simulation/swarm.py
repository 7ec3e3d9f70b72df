"""A volunteer swarm's DHT in the simulator: churn, a steady workload, and what it costs.

The swarm starts in its steady state: every peer is online with the rest of its session still to
run (`Internet.residual_session`) and a routing table such as joining would have built (its
nearest ids and a random sample of the others, through `RoutingTable.add_or_update_node`). The
few bootstrap peers are servers that never leave. When a peer's session ends it goes silent, and
a newcomer (a fresh identity, with a fresh session length) joins through the bootstrap peers as
`DHTNode` does, so the population stays at `peers`.

Each online peer stores its own record every `store_interval` (a training peer reporting its
progress) and gets a random live record every `get_interval`, both at random phases. A get
succeeds when it returns the record; it is fresh when the record is at least as new as the last
version its owner had stored when the get began.
"""

import dataclasses
import statistics

from ...dht.routing import DHTID
from ...p2p.identity import PeerID
from .dht_node import DHTOptions, LookupStats, SimDHTNode
from .events import Simulator
from .internet import Internet, InternetOptions

SHA256_MULTIHASH = bytes([0x12, 32])
RECORD_SIZE = 64


@dataclasses.dataclass
class SwarmOptions:
    """A simulated swarm. Times in seconds of virtual time."""

    peers: int = 10_000
    """Peers online at any moment (departures are replaced by newcomers)."""
    bootstrap_peers: int = 3
    """Stable servers every newcomer joins through."""
    bootstrap_rate: float = 1e9
    """Uplink and downlink of a bootstrap server, bit/s."""
    duration: float = 3600.0
    churn: bool = True
    workload: bool = True
    """Stores and gets of progress records (off when another workload, such as matchmaking, runs)."""
    store_interval: float = 600.0
    get_interval: float = 600.0
    record_ttl: float = 1200.0
    """Records expire this long after they are stored."""
    latest: bool = True
    """Gets ask for the newest record (`get(latest=True)`, what progress tracking uses)."""
    warm_neighbours: int = 40
    """Peers nearest by id each routing table starts with (half on either side)."""
    warm_random: int = 160
    """Random other peers each routing table starts with."""
    seed: int = 0
    dht: DHTOptions = dataclasses.field(default_factory=DHTOptions)
    internet: InternetOptions = dataclasses.field(default_factory=InternetOptions)


@dataclasses.dataclass
class Operation:
    kind: str  # "store", "get", "join"
    stats: LookupStats
    ok: bool
    fresh: bool = True
    rtt: float = 0.0
    """The median RTT from the peer to the bootstrap servers, to express durations in RTTs."""


class DHTSwarm:
    """Builds the swarm, runs it for `duration`, keeps every operation (see the module docstring)."""

    def __init__(self, options: SwarmOptions | None = None, sim: Simulator | None = None):
        self.options = o = options or SwarmOptions()
        self.sim = sim or Simulator(o.seed)
        self.rng = self.sim.rng
        self.internet = Internet(self.sim, o.internet)
        self.peers_by_id: dict[PeerID, object] = {}
        self.nodes: list[SimDHTNode] = []  # every node ever, in order of creation
        self.online: dict[int, SimDHTNode] = {}  # peer index -> node
        self.joined_at: dict[int, float] = {}
        self.left_at: dict[int, float] = {}
        self.operations: list[Operation] = []
        self.records: dict[DHTID, tuple[int, float]] = {}  # key -> (latest stored version, expiration)
        self.record_keys: list[DHTID] = []
        self.bootstrap = [self._new_node(o.bootstrap_rate) for _ in range(o.bootstrap_peers)]

    def _new_node(self, rate: float | None = None) -> SimDHTNode:
        peer = self.internet.add_peer(up=rate, down=rate)
        peer_id = PeerID(SHA256_MULTIHASH + self.rng.randbytes(32))
        node = SimDHTNode(self, peer, peer_id, DHTID(self.rng.getrandbits(160)), self.options.dht)
        self.peers_by_id[peer_id] = peer
        self.nodes.append(node)
        self.online[peer.index] = node
        self.joined_at[peer.index] = self.sim.now
        return node

    # --- the steady state at time 0 ---------------------------------------------------------------

    def populate(self) -> None:
        """Bring `peers` peers online with warm routing tables and their workload scheduled."""
        o = self.options
        members = [self._new_node() for _ in range(o.peers)]
        everyone = self.bootstrap + members
        ordered = sorted(everyone, key=lambda node: node.node_id)
        half = o.warm_neighbours // 2
        for position, node in enumerate(ordered):
            table = node.routing_table
            nearby = ordered[max(0, position - half) : position + half + 1]
            sample = self.rng.sample(everyone, min(o.warm_random, len(everyone)))
            for other in nearby + sample + self.bootstrap:
                if other is not node:
                    table.add_or_update_node(other.node_id, other.peer_id, 0.0)
        for node in members:
            if o.workload:
                self._schedule_work(node, first=True)
            if o.churn:
                self.sim.after(self.internet.residual_session(), self._leave, node)

    # --- churn ----------------------------------------------------------------------------------

    def _leave(self, node: SimDHTNode) -> None:
        node.leave()
        del self.online[node.peer.index]
        self.left_at[node.peer.index] = self.sim.now
        self._join()

    def _join(self) -> None:
        node = self._new_node()
        rtt = self._rtt(node)

        def joined(ok: bool, stats: LookupStats) -> None:
            self.operations.append(Operation("join", stats, ok, rtt=rtt))
            if ok and self.options.workload:
                self._schedule_work(node, first=True)

        node.bootstrap([b.peer_id for b in self.bootstrap], joined)
        self.sim.after(self.internet.session_length(), self._leave, node)

    def _rtt(self, node: SimDHTNode) -> float:
        return statistics.median(self.internet.rtt(node.peer, b.peer) for b in self.bootstrap)

    # --- the workload ---------------------------------------------------------------------------

    def _schedule_work(self, node: SimDHTNode, first: bool = False) -> None:
        o, rng = self.options, self.rng
        self.sim.after(rng.uniform(0, o.store_interval) if first else o.store_interval, self._store, node)
        self.sim.after(rng.uniform(0, o.get_interval) if first else o.get_interval, self._get, node)

    def _store(self, node: SimDHTNode) -> None:
        if not node.alive:
            return
        key = _record_key(node.peer.index)
        version = self.records.get(key, (0, 0.0))[0] + 1
        expiration = self.sim.now + self.options.record_ttl
        value = version.to_bytes(8, "big").ljust(RECORD_SIZE, b"\0")
        rtt = self._rtt(node)

        def stored(ok: bool, stats: LookupStats) -> None:
            self.operations.append(Operation("store", stats, ok, rtt=rtt))
            if ok:
                if key not in self.records:
                    self.record_keys.append(key)
                self.records[key] = (version, expiration)

        node.store(key, value, expiration, stored)
        self.sim.after(self.options.store_interval, self._store, node)

    def _get(self, node: SimDHTNode) -> None:
        if not node.alive:
            return
        self.sim.after(self.options.get_interval, self._get, node)
        now = self.sim.now
        for _ in range(8):  # a few tries to pick a record that is still alive
            if not self.record_keys:
                return
            key = self.rng.choice(self.record_keys)
            version, expiration = self.records[key]
            if expiration > now + 1.0:
                break
        else:
            return
        rtt = self._rtt(node)

        def got(found, stats: LookupStats) -> None:
            ok = found is not None and found.expiration_time > self.sim.now
            fresh = ok and int.from_bytes(found.value[:8], "big") >= version
            self.operations.append(Operation("get", stats, ok, fresh, rtt=rtt))

        node.get(key, got, latest=self.options.latest)

    def run(self) -> None:
        """Populate and run for `duration` of virtual time."""
        self.populate()
        self.sim.run(self.options.duration)


def _record_key(index: int) -> DHTID:
    return DHTID.generate(source=f"progress-{index}".encode())
