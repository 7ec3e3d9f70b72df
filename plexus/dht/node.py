"""DHTNode: one Kademlia participant on asyncio, driving the sans-I/O cores over a transport.

The node is the driver: it decodes requests and hands them to `DHTProtocol`, runs `Traversal`
lookups with several requests in flight, and performs the follow-ups the cores ask for (evicting
dead peers, handing keys over to new peers, refreshing cached keys shortly before they expire).
Decisions live in the cores; here are the awaits, the timeouts and the bookkeeping of which peer
failed. Storing and finding values (replicas, merging, caching on the way back) is the mixin
`StoreAndGet` in store_and_get.py, on top of these lookups.

Every outgoing request goes through `_request`: a failure bans the peer for a doubling backoff
(`Blacklist`) and removes it from the routing table; an answer clears the ban and refreshes the
peer in the table. A request's timeout follows the answers of recent ones (`LatencyEstimator.
request_timeout`, at most `wait_timeout`), and a peer that has left a request unanswered past the
straggler limit is not asked again by any lookup until it answers or fails (`Unanswered`). A
request that fails starts a sweep of the entries silent since it was sent, and entries we name
in find answers are checked once they have been quiet a while (liveness.py). So a crowd of frozen
peers costs the lookups of a node little more than their first silence, and leaves its table in
a few seconds. The table admits at most a few peers per network (`DiversityOptions`), so one
machine cannot fill it with ids to begin with. All background work runs as tasks owned by the
node and ends at `shutdown()`.
"""

import asyncio
import logging
import random
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from typing import Any

from ..p2p.identity import PeerID
from ..utils.timing import MAX_DHT_TIME_DISCREPANCY_SECONDS, get_dht_time
from .blacklist import Blacklist
from .cache_refresh import CacheRefreshQueue
from .diversity import DiversityOptions
from .latency import DEFAULT_FLOOR, DEFAULT_MIN_REQUEST_TIMEOUT, LatencyEstimator, Unanswered
from .liveness import LivenessChecker, LivenessOptions
from .messages import (
    MAX_KEYS_PER_REQUEST,
    DHTProtocolError,
    ErrorResponse,
    FindRequest,
    FindResponse,
    FindResult,
    Message,
    PingRequest,
    PingResponse,
    ResponseT,
    StoreItem,
    StoreRequest,
    StoreResponse,
    decode_request,
    decode_response,
)
from .p2p_transport import open_host_transport
from .protocol import DHTProtocol, HandOver, PingToEvict
from .routing import DHTID, RoutingTable
from .storage import DHTLocalStorage, StorageLimits
from .store_and_get import StoreAndGet
from .transport import DHTBootstrapError, DHTTransport
from .traverse import Traversal, TraversalRequest
from .validation import RecordValidatorBase

logger = logging.getLogger(__name__)

DEFAULT_PARALLEL_RPC = 256  # cap on concurrent outgoing requests when parallel_rpc is None
MAX_BACKGROUND_TASKS = 1024


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if str(error) else text


class DHTNode(StoreAndGet):
    """A DHT participant. Create with `await DHTNode.create(rpc=transport, initial_peers=[...])`."""

    # Set once in `create` (the constructor is private); declared so the checker knows them (the ones
    # the value layer uses too are declared on `StoreAndGet`).
    rpc: DHTTransport
    peer_id: PeerID
    num_workers: int
    wait_timeout: float
    chunk_size: int
    client_mode: bool
    refresh_timeout: float | None
    routing_table: RoutingTable
    storage_limits: StorageLimits
    blacklist: Blacklist
    latency: LatencyEstimator
    liveness: LivenessChecker
    _unanswered: Unanswered
    _rpc_slots: asyncio.Semaphore
    _tasks: set[asyncio.Task]
    _evicting: set[DHTID]
    _sweeping: bool
    is_alive: bool

    def __init__(self, *, _private: bool = False):
        if not _private:
            raise TypeError("use `await DHTNode.create(...)` to make a DHTNode")

    @classmethod
    async def create(
        cls,
        node_id: DHTID | None = None,
        initial_peers: Sequence[PeerID] = (),
        rpc: DHTTransport | None = None,
        bucket_size: int = 20,
        num_replicas: int = 5,
        depth_modulo: int = 5,
        parallel_rpc: int | None = None,
        wait_timeout: float = 3,
        cache_locally: bool = True,
        cache_nearest: int = 1,
        cache_size: int | None = None,
        cache_refresh_before_expiry: float = 5,
        cache_on_store: bool = True,
        reuse_get_requests: bool = True,
        num_workers: int = 4,
        chunk_size: int = 16,
        blacklist_time: float = 5.0,
        backoff_rate: float = 2.0,
        refresh_timeout: float | None = None,
        client_mode: bool = False,
        record_validator: RecordValidatorBase | None = None,
        ensure_bootstrap_success: bool = True,
        bootstrap_timeout: float | None = None,
        storage_limits: StorageLimits | None = None,
        diversity: DiversityOptions | None = None,
        min_request_timeout: float = DEFAULT_MIN_REQUEST_TIMEOUT,
        liveness: LivenessOptions | None = None,
        p2p=None,
        **host_options,
    ) -> "DHTNode":
        """Start serving on `rpc` (unless `client_mode`), then join through `initial_peers`.

        `storage_limits` bounds what this node stores and caches for others (default: `StorageLimits()`).
        `wait_timeout` bounds every request; once requests have been answered, a request fails
        sooner, at a multiple of their recent latency but not before `min_request_timeout`.
        `diversity` bounds routing-table entries per network (default `DiversityOptions()`: 2 per
        k-bucket and 8 in all per public /24 or /48 or private address, loopback unlimited; pass
        `DiversityOptions(max_per_bucket=None, max_per_table=None)` to lift the bounds).
        `liveness` says when entries that went silent are pinged and evicted (default
        `LivenessOptions()`; see liveness.py).

        Without `rpc` the node runs over a libp2p host, as in hivemind: `p2p` (a started Host, or
        anything with a `.host`), else one of its own that listens on `host_maddrs` (default
        127.0.0.1 only; also `announce_maddrs`, `identity_path`) and closes with the node. Initial
        peers may then be multiaddrs, which are dialed first.

        Raises DHTBootstrapError when initial peers were given, none answered a ping and
        `ensure_bootstrap_success` is set; the message lists every peer tried and why it failed."""
        if rpc is None:
            rpc, initial_peers = await open_host_transport(
                getattr(p2p, "host", p2p),
                initial_peers,
                bootstrap_timeout or wait_timeout * 3,
                ensure_bootstrap_success,
                **host_options,
            )
        elif p2p is not None or host_options:
            raise TypeError(f"DHTNode.create takes rpc= or host options, not both: {sorted(host_options)}")
        self = cls(_private=True)
        self.node_id = node_id if node_id is not None else DHTID.generate()
        self.rpc, self.peer_id = rpc, rpc.local_peer_id
        self.bucket_size, self.num_replicas, self.num_workers = bucket_size, num_replicas, num_workers
        self.wait_timeout, self.chunk_size, self.client_mode = wait_timeout, chunk_size, client_mode
        self.cache_locally, self.cache_nearest, self.cache_on_store = (
            cache_locally,
            cache_nearest,
            cache_on_store,
        )
        self.cache_refresh_before_expiry, self.reuse_get_requests = (
            cache_refresh_before_expiry,
            reuse_get_requests,
        )
        self.refresh_timeout = refresh_timeout
        self.record_validator = record_validator
        self.routing_table = RoutingTable(
            self.node_id, bucket_size, depth_modulo, DiversityOptions() if diversity is None else diversity
        )
        self.storage_limits = StorageLimits() if storage_limits is None else storage_limits
        self.storage = DHTLocalStorage(limits=self.storage_limits)
        self.cache = DHTLocalStorage(maxsize=cache_size, limits=self.storage_limits)
        self.liveness = LivenessChecker(LivenessOptions() if liveness is None else liveness)
        self.protocol = DHTProtocol(
            self.node_id,
            self.routing_table,
            self.storage,
            self.cache,
            record_validator,
            num_replicas,
            client_mode,
            addresses_of=rpc.known_addresses,
            ip_of=rpc.remote_ip,
            liveness=self.liveness,
        )
        self.blacklist = Blacklist(blacklist_time, backoff_rate)
        self.latency = LatencyEstimator(
            ceiling=wait_timeout,
            floor=min(DEFAULT_FLOOR, wait_timeout),
            min_request_timeout=min_request_timeout,
        )
        self._unanswered = Unanswered()
        self._rpc_slots = asyncio.Semaphore(parallel_rpc or DEFAULT_PARALLEL_RPC)
        self._tasks = set()
        self._pending_gets = {}
        self._evicting = set()
        self._sweeping = False
        self._refresh_queue = CacheRefreshQueue(max_size=cache_size or 10000)
        self._refresh_wakeup = asyncio.Event()
        self.is_alive = True
        if not client_mode:
            rpc.serve(self._handle_rpc)
        if cache_locally and cache_refresh_before_expiry > 0:
            self._spawn(self._refresh_cache_loop(), essential=True)
        if refresh_timeout is not None:
            self._spawn(self._refresh_buckets_loop(refresh_timeout), essential=True)
        try:
            await self._bootstrap(
                list(initial_peers), ensure_bootstrap_success, bootstrap_timeout or wait_timeout
            )
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def get_visible_maddrs(self, latest: bool = False) -> list:
        """Addresses other peers can use as `initial_peers` for this node (empty off a libp2p host)."""
        host = getattr(self.rpc, "host", None)
        return [] if host is None else host.get_visible_maddrs(include_observed=latest)

    def __repr__(self) -> str:
        mode = "client" if self.client_mode else "server"
        return f"DHTNode({self.peer_id.short()}, {mode}, {len(self.routing_table)} peers, {len(self.storage)} keys)"

    # background tasks

    def _spawn(self, coroutine: Coroutine[Any, Any, Any], essential: bool = False) -> None:
        if not essential and len(self._tasks) >= MAX_BACKGROUND_TASKS:
            coroutine.close()
            logger.debug(f"{self!r}: too many background tasks, skipping one")
            return
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        """Stop serving and every background task; the node cannot be used afterwards."""
        self.is_alive = False
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, future in self._pending_gets.values():
            future.cancel()
        await self.rpc.close()

    # outgoing requests

    async def _request(self, peer_id: PeerID, request: Message, expected: type[ResponseT]) -> ResponseT:
        """Send one request; on any failure ban the peer and drop it from the table, then re-raise."""
        sent_at_dht = get_dht_time()
        try:
            async with self._rpc_slots:
                loop = asyncio.get_running_loop()
                sent_at = loop.time()
                self._unanswered.sent(peer_id, sent_at)
                answered = False
                try:
                    data = await self.rpc.call(peer_id, request.encode(), self.latency.request_timeout())
                    answered = True
                finally:
                    self._unanswered.finished(peer_id, loop.time(), answered)
                self.latency.observe(loop.time() - sent_at)
            response = decode_response(data, expected)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            now = get_dht_time()
            ban = self.blacklist.register_failure(peer_id, now)
            self.protocol.peer_failed(peer_id)
            logger.debug(
                f"{self!r}: {type(request).__name__} to {peer_id} failed ({_describe(error)}); ban {ban:.1f}s"
            )
            if isinstance(error, OSError):  # timed out or unreachable (not a refusal): others may be gone too
                self._sweep_after_failure(sent_at_dht, now)
            raise
        self.blacklist.register_success(peer_id)
        if response.node_id is not None:  # (an ErrorResponse was raised as DHTRPCError)
            self._perform(self.protocol.peer_seen(response.node_id, peer_id, get_dht_time()))
        return response

    async def _call(self, peer_id: PeerID, request: Message, expected: type[ResponseT]) -> ResponseT | None:
        """Like `_request`, but None instead of an exception, and banned peers are not asked."""
        if self.blacklist.is_banned(peer_id, get_dht_time()):
            return None
        try:
            return await self._request(peer_id, request, expected)
        except asyncio.CancelledError:
            raise
        except Exception:
            return None

    async def call_ping(self, peer_id: PeerID, validate: bool = False) -> DHTID | None:
        """Ping a peer and return its DHT id (None if it failed or is a client). Warns on clock skew
        and, with `validate`, when the peer could not reach us back."""
        sent_at = get_dht_time()
        response = await self._request(peer_id, PingRequest(self.protocol.own_id, validate), PingResponse)
        self._check_ping_response(peer_id, response, sent_at, get_dht_time(), validate)
        return response.node_id

    def _check_ping_response(self, peer_id, response: PingResponse, sent_at, received_at, validate) -> None:
        if (
            not sent_at - MAX_DHT_TIME_DISCREPANCY_SECONDS
            <= response.dht_time
            <= received_at + MAX_DHT_TIME_DISCREPANCY_SECONDS
        ):
            logger.warning(
                f"Clock of {peer_id} differs from ours by more than {MAX_DHT_TIME_DISCREPANCY_SECONDS} s "
                f"(ours: {sent_at:.3f}, theirs: {response.dht_time:.3f}); records may expire early or late. "
                f"Synchronise clocks with NTP."
            )
        if validate and not self.client_mode and not response.available:
            logger.warning(
                f"{peer_id} could not reach this node back; other peers may not reach it either. "
                f"Make sure its address is public and the port is open, or run in client mode."
            )

    def _perform(self, actions: Iterable[Any]) -> None:
        for action in actions:
            if isinstance(action, PingToEvict) and action.node_id not in self._evicting:
                self._evicting.add(action.node_id)
                self._spawn(self._ping_to_evict(action))
            elif isinstance(action, HandOver):
                self._spawn(self._send_items(action.peer_id, action.items))

    async def _ping_to_evict(self, action: PingToEvict) -> None:
        sent_at = get_dht_time()
        try:
            answer = await self._call(action.peer_id, PingRequest(self.protocol.own_id), PingResponse)
        finally:  # on failure `_request` already evicted it and a replacement moved in
            self._evicting.discard(action.node_id)
        if answer is None:
            self._sweep_after_failure(sent_at, get_dht_time(), quiet_entry=True)

    def _sweep_after_failure(self, sent_at: float, now: float, quiet_entry: bool = False) -> None:
        if not self._sweeping:
            since = self.liveness.sweep_after_failure(sent_at, now, quiet_entry)
            if since is not None:
                self._sweeping = True
                self._spawn(self._sweep(since), essential=True)  # one at a time: bounded

    async def _sweep(self, since: float) -> None:
        """Ping every entry silent since `since`, a few at a time; a ping that fails evicts its entry."""
        try:
            quiet = [
                (node_id, peer_id)
                for node_id, peer_id in self.routing_table.not_seen_since(since)
                if node_id not in self._evicting
            ]
            slots = asyncio.Semaphore(self.liveness.options.sweep_concurrency)

            async def check(node_id: DHTID, peer_id: PeerID) -> None:
                async with slots:
                    await self._ping_to_evict(PingToEvict(node_id, peer_id))

            before = len(self.routing_table)
            self._evicting.update(node_id for node_id, _ in quiet)
            await asyncio.gather(*(check(node_id, peer_id) for node_id, peer_id in quiet))
        finally:
            self._sweeping = False
        evicted = sum(node_id not in self.routing_table for node_id, _ in quiet)
        logger.log(
            logging.INFO if evicted else logging.DEBUG,
            f"{self!r}: a failed request started a liveness sweep: {evicted} of {len(quiet)} quiet "
            f"entries did not answer and were evicted (table: {before} -> {len(self.routing_table)})",
        )

    async def _send_items(self, peer_id: PeerID, items: Sequence[StoreItem]) -> list[bool] | None:
        """Store `items` on one peer in requests of at most MAX_KEYS_PER_REQUEST: one flag per item,
        or None if the peer did not answer."""
        results: list[bool] = []
        for start in range(0, len(items), MAX_KEYS_PER_REQUEST):
            chunk = tuple(items[start : start + MAX_KEYS_PER_REQUEST])
            response = await self._call(peer_id, StoreRequest(self.protocol.own_id, chunk), StoreResponse)
            if response is None or len(response.results) != len(chunk):
                return None
            results.extend(response.results)
        return results

    # serving

    async def _handle_rpc(self, sender: PeerID, data: bytes) -> bytes:
        """Answer one request; malformed input gets an ErrorResponse and nothing else changes."""
        try:
            request = decode_request(data)
        except DHTProtocolError as error:
            logger.debug(f"{self!r}: bad request from {sender}: {error}")
            return ErrorResponse(str(error)).encode()
        available = False
        if isinstance(request, PingRequest) and request.validate and request.node_id is not None:
            try:  # the caller asks whether we can reach it back (does it have a public address?)
                reply = await self._request(sender, PingRequest(self.protocol.own_id), PingResponse)
                available = reply.node_id == request.node_id
            except asyncio.CancelledError:
                raise
            except Exception:
                available = False
        try:
            response, actions = self.protocol.handle(sender, request, get_dht_time(), available)
            encoded = response.encode()
        except Exception as error:
            logger.exception(f"{self!r}: failed to serve {type(request).__name__} from {sender}")
            return ErrorResponse(f"internal error while serving {type(request).__name__}: {error!r}").encode()
        self._perform(actions)
        return encoded

    # joining

    async def _bootstrap(self, initial_peers: list[PeerID], ensure_success: bool, timeout: float) -> None:
        if not initial_peers:
            return
        failures: dict[PeerID, str] = {}

        async def ping(peer_id: PeerID) -> bool:
            try:
                await self.call_ping(peer_id, validate=not self.client_mode)
                return True
            except asyncio.CancelledError:
                failures[peer_id] = "did not answer before bootstrap ended"
                raise
            except Exception as error:
                failures[peer_id] = _describe(error)
                return False

        tasks = [asyncio.ensure_future(ping(peer_id)) for peer_id in dict.fromkeys(initial_peers)]
        try:
            answered = False
            for next_done in asyncio.as_completed(tasks):
                if await next_done:
                    answered = True
                    break
            if answered:  # give the others a little longer, then join with whoever answered
                await asyncio.wait(tasks, timeout=timeout)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not answered:
            tried = "; ".join(
                f"{peer_id}: {failures.get(peer_id, 'no answer')}" for peer_id in dict.fromkeys(initial_peers)
            )
            message = (
                f"DHTNode bootstrap failed: none of the {len(tasks)} initial peers answered a ping ({tried}). "
                f"Check that the addresses are right and those peers are running and reachable."
            )
            if ensure_success:
                raise DHTBootstrapError(message)
            logger.warning(message)
            return
        await self.find_nearest_nodes([self.node_id])

    # lookups

    def _is_silent(self, peer_id: PeerID, now: float) -> bool:
        """The peer has left a request unanswered past the straggler limit (`now`: loop time)."""
        return self._unanswered.silent_for(peer_id, now) > self.latency.straggler_timeout()

    def _askable(self, peer_id: PeerID, now: float, loop_now: float) -> bool:
        return not self.blacklist.is_banned(peer_id, now) and not self._is_silent(peer_id, loop_now)

    def _initial_nodes(
        self, queries: Collection[DHTID], count: int
    ) -> dict[DHTID, list[tuple[DHTID, PeerID]]]:
        """The `count` nearest entries to each query that may be asked (banned and silent ones are
        passed over, so a table crowded with dead entries still starts a lookup with live ones)."""
        now, loop_now = get_dht_time(), asyncio.get_running_loop().time()
        initial = {}
        for query in queries:
            wanted = count
            while True:
                nearest = self.routing_table.get_nearest_neighbors(query, wanted, exclude=self.node_id)
                askable = [
                    (node_id, peer_id)
                    for node_id, peer_id in nearest
                    if self._askable(peer_id, now, loop_now)
                ]
                if len(askable) >= count or len(nearest) < wanted:
                    break
                wanted *= 2
            initial[query] = askable[:count]
        return initial

    async def _traverse(
        self,
        traversal: Traversal,
        on_result: Callable[[TraversalRequest, DHTID, FindResult], None] | None = None,
    ) -> None:
        """Drive a Traversal: keep its requests in flight, feed it answers, stop when it is done.
        `on_result(request, query, filtered_result)` sees every answer for every query.

        Requests outstanding past the traversal's straggler timeout stop holding the lookup up
        (see traverse.py). When the lookup ends, stragglers are left to finish in the background
        (bounded by the request timeout), so a silent peer is still banned and dropped from the
        routing table, and a slow one refreshed in it; the other requests still in flight are
        cancelled. Peers that are banned or silent are not taken as candidates."""
        pending: dict[asyncio.Task, TraversalRequest] = {}
        failures: dict[DHTID, int] = {}
        loop = asyncio.get_running_loop()
        try:
            while True:
                for request in traversal.next_queries(loop.time()):
                    find = FindRequest(self.protocol.own_id, request.queries)
                    pending[loop.create_task(self._call(request.peer_id, find, FindResponse))] = request
                if traversal.done or not pending:
                    return
                deadline = traversal.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                finished, _ = await asyncio.wait(
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                now = get_dht_time()
                for task in finished:
                    request = pending.pop(task)
                    response: FindResponse | None = task.result()
                    if response is None or len(response.results) != len(request.queries):
                        traversal.on_failure(request)
                        for query in request.queries:  # reach past the dead: more of our own table
                            failures[query] = failures.get(query, 0) + 1
                            more = self._initial_nodes([query], traversal.beam_size + failures[query])[query]
                            traversal.add_candidates(query, more)
                        continue
                    if response.addresses:
                        self.rpc.add_addresses(response.addresses)
                    neighbours = {}
                    check = len(self.blacklist) > 0 or len(self._unanswered) > 0
                    loop_now = loop.time()
                    for query, result in zip(request.queries, response.results):
                        neighbours[query] = [
                            (node_id, peer_id)
                            for node_id, peer_id in result.nearest
                            if node_id != self.node_id
                            and not (check and not self._askable(peer_id, now, loop_now))
                        ]
                        if on_result is not None:
                            on_result(request, query, self.protocol.filter_found(query, result, now))
                    traversal.on_response(request, neighbours, loop.time())
        finally:
            cancelled = []
            for task, request in pending.items():
                detach = self.is_alive and len(self._tasks) < MAX_BACKGROUND_TASKS
                if detach and traversal.is_straggler(request):
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    task.cancel()
                    cancelled.append(task)
            if cancelled:
                await asyncio.gather(*cancelled, return_exceptions=True)

    def _new_traversal(
        self, queries: Collection[DHTID], beam_size: int, num_workers: int | None
    ) -> Traversal:
        return Traversal(
            queries,
            self._initial_nodes(queries, beam_size),
            beam_size,
            num_workers or self.num_workers,
            exclude=[self.node_id],
            straggler_timeout=self.latency.straggler_timeout(),
            min_straggler_timeout=self.latency.floor,
        )

    async def find_nearest_nodes(
        self,
        queries: Collection[DHTID],
        k_nearest: int | None = None,
        beam_size: int | None = None,
        num_workers: int | None = None,
        exclude_self: bool = False,
    ) -> dict[DHTID, dict[DHTID, PeerID]]:
        """For each query id, the k nearest live peers (this node included unless excluded or a
        client), nearest first, as {node_id: peer_id}."""
        queries = list(dict.fromkeys(queries))
        k_nearest = k_nearest or self.bucket_size
        beam_size = max(beam_size or self.bucket_size, k_nearest)
        traversal = self._new_traversal(queries, beam_size, num_workers)
        await self._traverse(traversal)
        nearest = {}
        for query in queries:
            found = traversal.nearest(query)
            if not exclude_self and not self.client_mode:
                found.append((self.node_id, self.peer_id))
            found.sort(key=lambda item: item[0] ^ query)
            nearest[query] = dict(found[:k_nearest])
        return nearest

    # maintenance

    async def _refresh_cache_loop(self) -> None:
        """Re-fetch cached keys that are being read, shortly before their cached copy expires."""
        while self.is_alive:
            next_time = self._refresh_queue.next_time()
            timeout = None if next_time is None else max(0.0, next_time - get_dht_time())
            try:
                await asyncio.wait_for(self._refresh_wakeup.wait(), timeout)
            except TimeoutError:
                pass
            self._refresh_wakeup.clear()
            now = get_dht_time()
            due = self._refresh_queue.pop_due(now)
            for start in range(0, len(due), self.chunk_size):
                chunk = due[start : start + self.chunk_size]
                try:  # anything newer than what we hold, and alive past the next refresh window
                    wanted = now + self.cache_refresh_before_expiry + 1
                    await self.get_many_by_id(chunk, sufficient_expiration_time=wanted, _is_refresh=True)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.warning(f"{self!r}: refreshing {len(chunk)} cached keys failed", exc_info=True)

    async def _refresh_buckets_loop(self, refresh_timeout: float) -> None:
        """Look up a random id in every bucket nobody was seen in for `refresh_timeout` seconds."""
        while self.is_alive:
            await asyncio.sleep(refresh_timeout)
            now = get_dht_time()
            stale = self.routing_table.stale_buckets(now, refresh_timeout)
            queries = [DHTID(random.randrange(bucket.lower, bucket.upper)) for bucket in stale]
            if queries:
                try:
                    await self.find_nearest_nodes(queries)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.warning(f"{self!r}: refreshing {len(queries)} stale buckets failed", exc_info=True)
