"""DHTNode: one Kademlia participant on asyncio, driving the sans-I/O cores over a transport.

The node is the driver: it decodes requests and hands them to `DHTProtocol`, runs `Traversal`
lookups with several requests in flight, and performs the follow-ups the cores ask for (evicting
dead peers, handing keys over to new peers, refreshing cached keys shortly before they expire).
Decisions live in the cores; here are the awaits, the timeouts and the bookkeeping of which peer
failed. Storing and finding values (replicas, merging, caching on the way back) is the mixin
`StoreAndGet` in store_and_get.py, on top of these lookups.

Every outgoing request goes through `_request`: a failure bans the peer for a doubling backoff
(`Blacklist`) and removes it from the routing table; an answer clears the ban and refreshes the
peer in the table. All background work runs as tasks owned by the node and ends at `shutdown()`.
"""

import asyncio
import logging
import random
from typing import Any, Collection, Iterable, Sequence

from ..p2p.identity import PeerID
from ..utils.timing import DHTExpiration, get_dht_time
from .blacklist import Blacklist
from .cache_refresh import CacheRefreshQueue
from .latency import DEFAULT_FLOOR, LatencyEstimator
from .messages import (
    MAX_KEYS_PER_REQUEST,
    DHTProtocolError,
    ErrorResponse,
    FindRequest,
    FindResponse,
    Message,
    PingRequest,
    PingResponse,
    StoreItem,
    StoreRequest,
    StoreResponse,
    decode_request,
    decode_response,
)
from .protocol import DHTProtocol, HandOver, PingToEvict
from .routing import DHTID, RoutingTable
from .storage import DHTLocalStorage, StorageLimits
from .store_and_get import StoreAndGet
from .transport import DHTTransport
from .traverse import Traversal, TraversalRequest

logger = logging.getLogger(__name__)

MAX_DHT_TIME_DISCREPANCY_SECONDS = 3.0
DEFAULT_PARALLEL_RPC = 256  # cap on concurrent outgoing requests when parallel_rpc is None
MAX_BACKGROUND_TASKS = 1024


class DHTBootstrapError(ConnectionError):
    """None of the initial peers answered; the message names each one and why it failed."""


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if str(error) else text


class DHTNode(StoreAndGet):
    """A DHT participant. Create with `await DHTNode.create(rpc=transport, initial_peers=[...])`."""

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
        record_validator=None,
        ensure_bootstrap_success: bool = True,
        bootstrap_timeout: float | None = None,
        storage_limits: StorageLimits | None = None,
    ) -> "DHTNode":
        """Start serving on `rpc` (unless `client_mode`), then join through `initial_peers`.

        `storage_limits` bounds what this node stores and caches for others (default: `StorageLimits()`).

        Raises DHTBootstrapError when initial peers were given, none answered a ping and
        `ensure_bootstrap_success` is set; the message lists every peer tried and why it failed."""
        if rpc is None:
            raise TypeError("DHTNode.create needs rpc=<a DHTTransport>, e.g. MemoryNetwork().create_transport()")
        self = cls(_private=True)
        self.node_id = node_id if node_id is not None else DHTID.generate()
        self.rpc, self.peer_id = rpc, rpc.local_peer_id
        self.bucket_size, self.num_replicas, self.num_workers = bucket_size, num_replicas, num_workers
        self.wait_timeout, self.chunk_size, self.client_mode = wait_timeout, chunk_size, client_mode
        self.cache_locally, self.cache_nearest, self.cache_on_store = cache_locally, cache_nearest, cache_on_store
        self.cache_refresh_before_expiry, self.reuse_get_requests = cache_refresh_before_expiry, reuse_get_requests
        self.refresh_timeout = refresh_timeout
        self.record_validator = record_validator
        self.routing_table = RoutingTable(self.node_id, bucket_size, depth_modulo)
        self.storage_limits = StorageLimits() if storage_limits is None else storage_limits
        self.storage = DHTLocalStorage(limits=self.storage_limits)
        self.cache = DHTLocalStorage(maxsize=cache_size, limits=self.storage_limits)
        self.protocol = DHTProtocol(
            self.node_id, self.routing_table, self.storage, self.cache, record_validator, num_replicas, client_mode,
            addresses_of=rpc.known_addresses,
        )
        self.blacklist = Blacklist(blacklist_time, backoff_rate)
        self.latency = LatencyEstimator(ceiling=wait_timeout, floor=min(DEFAULT_FLOOR, wait_timeout))
        self._rpc_slots = asyncio.Semaphore(parallel_rpc or DEFAULT_PARALLEL_RPC)
        self._tasks: set[asyncio.Task] = set()
        self._pending_gets: dict[DHTID, tuple[DHTExpiration, asyncio.Future]] = {}
        self._evicting: set[DHTID] = set()
        self._refresh_queue = CacheRefreshQueue(max_size=cache_size or 10000)
        self._refresh_wakeup = asyncio.Event()
        self.is_alive = True
        if not client_mode:
            rpc.serve(self._handle_rpc)
        if cache_locally and cache_refresh_before_expiry > 0:
            self._spawn(self._refresh_cache_loop(), essential=True)
        if refresh_timeout is not None:
            self._spawn(self._refresh_buckets_loop(), essential=True)
        try:
            await self._bootstrap(list(initial_peers), ensure_bootstrap_success, bootstrap_timeout or wait_timeout)
        except BaseException:
            await self.shutdown()
            raise
        return self

    def __repr__(self) -> str:
        mode = "client" if self.client_mode else "server"
        return f"DHTNode({self.peer_id.short()}, {mode}, {len(self.routing_table)} peers, {len(self.storage)} keys)"

    # background tasks

    def _spawn(self, coroutine, essential: bool = False) -> None:
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

    async def _request(self, peer_id: PeerID, request: Message, expected: type[Message]) -> Any:
        """Send one request; on any failure ban the peer and drop it from the table, then re-raise."""
        try:
            async with self._rpc_slots:
                loop = asyncio.get_running_loop()
                sent_at = loop.time()
                data = await self.rpc.call(peer_id, request.encode(), self.wait_timeout)
                self.latency.observe(loop.time() - sent_at)
            response = decode_response(data, expected)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            ban = self.blacklist.register_failure(peer_id, get_dht_time())
            self.protocol.peer_failed(peer_id)
            logger.debug(f"{self!r}: {type(request).__name__} to {peer_id} failed ({_describe(error)}); ban {ban:.1f}s")
            raise
        self.blacklist.register_success(peer_id)
        if response.node_id is not None and not isinstance(response, ErrorResponse):
            self._perform(self.protocol.peer_seen(response.node_id, peer_id, get_dht_time()))
        return response

    async def _call(self, peer_id: PeerID, request: Message, expected: type[Message]) -> Any:
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
        if not sent_at - MAX_DHT_TIME_DISCREPANCY_SECONDS <= response.dht_time <= received_at + MAX_DHT_TIME_DISCREPANCY_SECONDS:
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
        try:
            await self._call(action.peer_id, PingRequest(self.protocol.own_id), PingResponse)
        finally:  # on failure `_request` already evicted it and a replacement moved in
            self._evicting.discard(action.node_id)

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
            tried = "; ".join(f"{peer_id}: {failures.get(peer_id, 'no answer')}" for peer_id in dict.fromkeys(initial_peers))
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

    def _initial_nodes(self, queries: Collection[DHTID], count: int) -> dict[DHTID, list[tuple[DHTID, PeerID]]]:
        now = get_dht_time()
        return {
            query: [
                (node_id, peer_id)
                for node_id, peer_id in self.routing_table.get_nearest_neighbors(query, count, exclude=self.node_id)
                if not self.blacklist.is_banned(peer_id, now)
            ]
            for query in queries
        }

    async def _traverse(self, traversal: Traversal, on_result=None) -> None:
        """Drive a Traversal: keep its requests in flight, feed it answers, stop when it is done.
        `on_result(request, query, filtered_result)` sees every answer for every query.

        Requests outstanding past the traversal's straggler timeout stop holding the lookup up
        (see traverse.py). When the lookup ends, stragglers are left to finish in the background
        (bounded by `wait_timeout`), so a silent peer is still banned and dropped from the routing
        table, and a slow one refreshed in it; the other requests still in flight are cancelled."""
        pending: dict[asyncio.Task, TraversalRequest] = {}
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
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                now = get_dht_time()
                for task in finished:
                    request = pending.pop(task)
                    response: FindResponse | None = task.result()
                    if response is None or len(response.results) != len(request.queries):
                        traversal.on_failure(request)
                        continue
                    if response.addresses:
                        self.rpc.add_addresses(response.addresses)
                    neighbours = {}
                    check_bans = len(self.blacklist) > 0
                    for query, result in zip(request.queries, response.results):
                        neighbours[query] = [
                            (node_id, peer_id)
                            for node_id, peer_id in result.nearest
                            if node_id != self.node_id
                            and not (check_bans and self.blacklist.is_banned(peer_id, now))
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

    def _new_traversal(self, queries: Collection[DHTID], beam_size: int,
                       num_workers: int | None) -> Traversal:
        return Traversal(
            queries, self._initial_nodes(queries, beam_size), beam_size, num_workers or self.num_workers,
            exclude=[self.node_id], straggler_timeout=self.latency.straggler_timeout(),
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
            except asyncio.TimeoutError:
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

    async def _refresh_buckets_loop(self) -> None:
        """Look up a random id in every bucket nobody was seen in for `refresh_timeout` seconds."""
        while self.is_alive:
            await asyncio.sleep(self.refresh_timeout)
            now = get_dht_time()
            stale = self.routing_table.stale_buckets(now, self.refresh_timeout)
            queries = [DHTID(random.randrange(bucket.lower, bucket.upper)) for bucket in stale]
            if queries:
                try:
                    await self.find_nearest_nodes(queries)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.warning(f"{self!r}: refreshing {len(queries)} stale buckets failed", exc_info=True)
