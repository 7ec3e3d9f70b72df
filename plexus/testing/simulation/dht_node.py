"""A DHT node for the simulator: Plexus's sans-I/O DHT cores, driven by callbacks in virtual time.

What runs unchanged: `DHTProtocol` (answers, storage, routing-table updates and the actions it
asks for), `RoutingTable`, `Traversal` (the beam search, stragglers included), `Blacklist`,
`LatencyEstimator`, `DHTLocalStorage` and the record merging of `records.py`. Messages are the
DHT's own dataclasses, passed as objects (their size on the wire is estimated, not encoded).

What is reproduced here, because it lives in the asyncio driver (`DHTNode`, `StoreAndGet`) and
not in a core: the bookkeeping around each request (ban and evict a peer that did not answer,
`peer_seen` for one that did, the ping-back of a validating ping), the loop that keeps a
traversal's requests in flight and feeds it answers and straggler timers, bootstrap (ping the
initial peers, then look ourselves up), choosing replicas for a store (the nearest that answer,
moving on past the silent ones), and a get's merging, local caching and push of the value to the
nearest peer that lacked it. Left out: sharing one search among concurrent gets of a key, the
background refresh of cached keys and of stale buckets, and record validators (signatures).

Every operation reports a `LookupStats`: its duration, the requests it sent, and its hops (the
depth at which the answer was found: 1 for a peer we knew, 2 for a peer one of those named...).
"""

import dataclasses
from collections.abc import Callable

from ...dht.blacklist import Blacklist
from ...dht.latency import DEFAULT_FLOOR, LatencyEstimator
from ...dht.messages import (
    MAX_KEYS_PER_REQUEST,
    FindRequest,
    FindResponse,
    PingRequest,
    StoreItem,
    StoreRequest,
)
from ...dht.protocol import DHTProtocol, HandOver, PingToEvict
from ...dht.records import merge_found, store_items_of
from ...dht.routing import DHTID, RoutingTable
from ...dht.storage import DHTLocalStorage
from ...dht.traverse import Traversal

ID_SIZE, PEER_SIZE, FRAME = 21, 40, 32  # bytes on the wire, roughly: a DHT id, a peer id, framing


@dataclasses.dataclass
class DHTOptions:
    """The node's settings, as `DHTNode.create` takes them."""

    bucket_size: int = 20
    num_replicas: int = 5
    depth_modulo: int = 5
    num_workers: int = 4
    wait_timeout: float = 3.0
    cache_locally: bool = True
    cache_nearest: int = 1
    blacklist_time: float = 5.0
    backoff_rate: float = 2.0


@dataclasses.dataclass
class LookupStats:
    seconds: float
    requests: int
    hops: int | None
    """Depth of the peer that had the value (gets) or of the nearest peer found; None if none."""


def wire_size(message) -> int:
    """About how many bytes a DHT message takes on the wire (msgpack of ids, values, peers); the
    entries of a dictionary value, or the items of a store, are taken to be alike in size."""
    if isinstance(message, FindRequest):
        return FRAME + ID_SIZE * (1 + len(message.keys))
    if isinstance(message, FindResponse):
        size = FRAME
        for result in message.results:
            size += 12 + (ID_SIZE + PEER_SIZE) * len(result.nearest) + len(result.value or b"")
            if result.entries:
                subkey, value, _ = result.entries[0]
                size += len(result.entries) * (len(subkey) + len(value) + 12)
        return size
    if isinstance(message, StoreRequest):
        item = message.items[0]
        return FRAME + len(message.items) * (ID_SIZE + 12 + len(item.value) + len(item.subkey or b""))
    return FRAME + ID_SIZE + 8 * len(getattr(message, "results", ()))


class SimDHTNode:
    """One DHT participant on the simulated internet (see the module docstring)."""

    def __init__(self, swarm, peer, peer_id, node_id: DHTID, options: DHTOptions | None = None):
        self.swarm, self.sim, self.internet = swarm, swarm.sim, swarm.internet
        self.peer, self.peer_id, self.node_id = peer, peer_id, node_id
        self.options = o = options or DHTOptions()
        self.routing_table = RoutingTable(node_id, o.bucket_size, o.depth_modulo)
        self.storage, self.cache = DHTLocalStorage(), DHTLocalStorage()
        self.protocol = DHTProtocol(
            node_id, self.routing_table, self.storage, self.cache, None, o.num_replicas
        )
        self.blacklist = Blacklist(o.blacklist_time, o.backoff_rate)
        self.latency = LatencyEstimator(ceiling=o.wait_timeout, floor=min(DEFAULT_FLOOR, o.wait_timeout))
        self.alive = True
        self._evicting: set[DHTID] = set()
        self.services: dict[type, Callable[..., None]] = {}
        """Handlers `(sender_id, message, reply)` for messages that are not the DHT's, by type."""
        peer.handler = self._serve

    # --- requests ---------------------------------------------------------------------------------

    def request(self, peer_id, message, on_done) -> None:
        """Send one request; `on_done(response or None)`. A failure bans and evicts the peer."""
        if self.blacklist.is_banned(peer_id, self.sim.now):
            on_done(None)
            return
        sent_at = self.sim.now
        target = self.swarm.peers_by_id[peer_id]

        def answered(response) -> None:
            if not self.alive:
                return
            now = self.sim.now
            if response is None:
                self.blacklist.register_failure(peer_id, now)
                self.protocol.peer_failed(peer_id)
                on_done(None)
                return
            self.latency.observe(now - sent_at)
            self.blacklist.register_success(peer_id)
            if response.node_id is not None:
                self._perform(self.protocol.peer_seen(response.node_id, peer_id, now))
            on_done(response)

        self.internet.call(
            self.peer,
            target,
            (self.peer_id, message),
            wire_size(message),
            self.options.wait_timeout,
            answered,
        )

    def _serve(self, sender, envelope, reply) -> None:
        sender_id, request = envelope
        service = self.services.get(type(request))
        if service is not None:
            service(sender_id, request, reply)
            return

        def answer(available: bool) -> None:
            if not self.alive:
                return
            response, actions = self.protocol.handle(sender_id, request, self.sim.now, available)
            self._perform(actions)
            reply(response, wire_size(response))

        if isinstance(request, PingRequest) and request.validate and request.node_id is not None:
            self.request(
                sender_id,
                PingRequest(self.node_id),
                lambda pong: answer(pong is not None and pong.node_id == request.node_id),
            )
        else:
            answer(False)

    def _perform(self, actions) -> None:
        for action in actions:
            if isinstance(action, PingToEvict) and action.node_id not in self._evicting:
                self._evicting.add(action.node_id)
                self.request(
                    action.peer_id,
                    PingRequest(self.node_id),
                    lambda _, node_id=action.node_id: self._evicting.discard(node_id),
                )
            elif isinstance(action, HandOver):
                self._send_items(action.peer_id, list(action.items), lambda _: None)

    def _send_items(self, peer_id, items: list[StoreItem], on_done, flags: list[bool] | None = None) -> None:
        """Store items on one peer, MAX_KEYS_PER_REQUEST a request; `on_done(flags or None)`."""
        flags = [] if flags is None else flags
        chunk = tuple(items[len(flags) : len(flags) + MAX_KEYS_PER_REQUEST])
        if not chunk:
            on_done(flags)
            return

        def stored(response) -> None:
            if response is None or len(response.results) != len(chunk):
                on_done(None)
                return
            flags.extend(response.results)
            self._send_items(peer_id, items, on_done, flags)

        self.request(peer_id, StoreRequest(self.node_id, chunk), stored)

    # --- lookups ----------------------------------------------------------------------------------

    def _initial_nodes(self, queries, count: int) -> dict:
        now = self.sim.now
        return {
            query: [
                (node_id, peer_id)
                for node_id, peer_id in self.routing_table.get_nearest_neighbors(
                    query, count, exclude=self.node_id
                )
                if not self.blacklist.is_banned(peer_id, now)
            ]
            for query in queries
        }

    def _lookup(self, queries, beam_size: int, on_result, on_done) -> "_Lookup":
        initial = self._initial_nodes(queries, beam_size)
        traversal = Traversal(
            queries,
            initial,
            beam_size,
            self.options.num_workers,
            exclude=[self.node_id],
            straggler_timeout=self.latency.straggler_timeout(),
            min_straggler_timeout=self.latency.floor,
        )
        return _Lookup(self, traversal, initial, on_result, on_done)

    def find_nearest_nodes(self, queries, on_done, k: int | None = None, exclude_self: bool = False) -> None:
        """`on_done(nearest, stats)`: for each query, {node_id: peer_id} of the k nearest, nearest first."""
        queries = list(dict.fromkeys(queries))
        k = k or self.options.bucket_size

        def finished(stats: LookupStats) -> None:
            nearest = {}
            for query in queries:
                found = lookup.traversal.nearest(query)
                if not exclude_self:
                    found.append((self.node_id, self.peer_id))
                found.sort(key=lambda item: item[0] ^ query)
                nearest[query] = dict(found[:k])
            on_done(nearest, stats)

        lookup = self._lookup(queries, max(k, self.options.bucket_size), None, finished)
        lookup.start()

    def store(
        self, key_id: DHTID, value: bytes, expiration: float, on_done, subkey: bytes | None = None
    ) -> None:
        """Store on the `num_replicas` nearest peers that answer; `on_done(accepted, stats)`."""
        item = StoreItem(key_id, subkey, value, expiration)
        started = self.sim.now

        def found(nearest, stats: LookupStats) -> None:
            candidates = list(nearest[key_id].items())
            state = {"answered": 0, "accepted": False, "requests": stats.requests}

            def next_round() -> None:
                wanted = self.options.num_replicas - state["answered"]
                chosen, candidates[:] = candidates[:wanted], candidates[wanted:]
                remote = []
                for node_id, peer_id in chosen:
                    if node_id == self.node_id:
                        state["answered"] += 1
                        state["accepted"] |= self.protocol.store_item(item, self.sim.now)
                    else:
                        remote.append(peer_id)
                if not remote:
                    seconds = self.sim.now - started
                    on_done(state["accepted"], LookupStats(seconds, state["requests"], stats.hops))
                    return
                waiting = [len(remote)]

                def stored(flags) -> None:
                    if flags is not None:
                        state["answered"] += 1
                        state["accepted"] |= flags[0]
                    waiting[0] -= 1
                    if waiting[0] == 0 and self.alive:
                        next_round()

                for peer_id in remote:
                    state["requests"] += 1
                    self._send_items(peer_id, [item], stored)

            next_round()

        self.find_nearest_nodes([key_id], found, k=self.options.bucket_size)

    def get(self, key_id: DHTID, on_done, latest: bool = False) -> None:
        """`on_done(value or None, stats)`: the first live value, or with `latest` the newest in the beam."""
        now = started = self.sim.now
        sufficient = float("inf") if latest else now
        merged = DHTLocalStorage()
        for local in (self.storage.get(key_id, now), self.cache.get(key_id, now)):
            if local is not None:
                merge_found(merged, key_id, local, now)
        best = merged.get(key_id, now)
        if best is not None and best.expiration_time >= sufficient:
            on_done(best, LookupStats(0.0, 0, 0))
            return
        answers = []
        found_at: list[int] = []

        def on_result(request, depth: int, result) -> None:
            now = self.sim.now
            merge_found(merged, key_id, self.protocol.filter_found(key_id, result, now), now)
            answers.append((result.expiration_time, request.node_id, request.peer_id))
            if result.found and not found_at:
                found_at.append(depth)
            best = merged.get(key_id, now)
            if best is not None and best.expiration_time >= sufficient:
                lookup.traversal.finish(key_id)

        def finished(stats: LookupStats) -> None:
            now = self.sim.now
            best = merged.get(key_id, now)
            if best is not None:
                if self.options.cache_locally:
                    merge_found(self.cache, key_id, best, now)
                lacking = sorted(
                    (
                        (node_id, peer_id)
                        for expiration, node_id, peer_id in answers
                        if expiration < best.expiration_time
                    ),
                    key=lambda item: item[0] ^ key_id,
                )
                items = store_items_of(key_id, best, now, in_cache=True)
                for _, peer_id in lacking[: self.options.cache_nearest]:
                    self._send_items(peer_id, items, lambda _: None)
            on_done(best, LookupStats(now - started, stats.requests, found_at[0] if found_at else None))

        lookup = self._lookup([key_id], self.options.bucket_size, on_result, finished)
        lookup.start()

    def bootstrap(self, initial_peers, on_done) -> None:
        """Ping the initial peers (asking each to ping us back); once one answers and the others
        had `wait_timeout` to, look ourselves up. `on_done(joined, stats)`."""
        started, pending = self.sim.now, set(initial_peers)
        state = {"answered": False, "over": False}

        def join() -> None:
            if state["over"] or not self.alive:
                return
            state["over"] = True
            if not state["answered"]:
                on_done(False, LookupStats(self.sim.now - started, len(initial_peers), None))
                return
            self.find_nearest_nodes(
                [self.node_id],
                lambda _, stats: on_done(
                    True, LookupStats(self.sim.now - started, stats.requests + len(initial_peers), stats.hops)
                ),
            )

        def pinged(peer_id, response) -> None:
            pending.discard(peer_id)
            if response is not None and not state["answered"]:
                state["answered"] = True
                self.sim.after(self.options.wait_timeout, join)
            if not pending:
                join()

        for peer_id in initial_peers:
            self.request(
                peer_id,
                PingRequest(self.node_id, validate=True),
                lambda response, peer_id=peer_id: pinged(peer_id, response),
            )

    def leave(self) -> None:
        """Go silent, as a volunteer's machine does: nothing is said, every pending call is void."""
        self.alive = False
        self.peer.alive = False

    def __repr__(self) -> str:
        return f"<SimDHTNode {self.peer.index} {len(self.routing_table)} peers {len(self.storage)} keys>"


class _Lookup:
    """Drives one Traversal as `DHTNode._traverse` does: requests in flight, answers fed back,
    straggler timers; `on_result(request, depth, result)` sees every answer, `on_done(stats)` ends it."""

    def __init__(self, node: SimDHTNode, traversal: Traversal, initial: dict, on_result, on_done):
        self.node, self.traversal, self.on_result, self.on_done = node, traversal, on_result, on_done
        self.started, self.requests, self.pending, self.over = node.sim.now, 0, 0, False
        self.depth = {node_id: 1 for nodes in initial.values() for node_id, _ in nodes}  # hops from us
        self.timer = None

    def start(self) -> None:
        self._pump()

    def _pump(self) -> None:
        node, traversal = self.node, self.traversal
        if self.over or not node.alive:
            return
        for request in traversal.next_queries(node.sim.now):
            self.requests += 1
            self.pending += 1
            node.request(
                request.peer_id,
                FindRequest(node.node_id, request.queries),
                lambda response, request=request: self._answered(request, response),
            )
        if traversal.done or not self.pending:
            self._finish()
            return
        if self.timer is not None:
            self.timer.cancel()
        deadline = traversal.next_deadline()
        self.timer = None if deadline is None else node.sim.at(deadline, self._pump)

    def _answered(self, request, response) -> None:
        self.pending -= 1
        if self.over:
            return  # a straggler's late answer: the request bookkeeping already used it
        traversal, node = self.traversal, self.node
        if response is None or len(response.results) != len(request.queries):
            traversal.on_failure(request)
        else:
            depth = self.depth.get(request.node_id, 1)
            now, banned = node.sim.now, node.blacklist.is_banned
            check_bans = len(node.blacklist) > 0
            neighbours = {}
            for query, result in zip(request.queries, response.results):
                neighbours[query] = [
                    (node_id, peer_id)
                    for node_id, peer_id in result.nearest
                    if node_id != node.node_id and not (check_bans and banned(peer_id, now))
                ]
                for node_id, _ in neighbours[query]:
                    self.depth.setdefault(node_id, depth + 1)
                if self.on_result is not None:
                    self.on_result(request, depth, result)
            traversal.on_response(request, neighbours, now)
        self._pump()

    def _finish(self) -> None:
        self.over = True
        if self.timer is not None:
            self.timer.cancel()
        traversal = self.traversal
        nearest = [node_id for query in traversal.queries for node_id, _ in traversal.nearest(query)[:1]]
        hops = self.depth.get(nearest[0]) if nearest else None
        self.on_done(LookupStats(self.node.sim.now - self.started, self.requests, hops))
