"""Storing and finding values: the value layer of `DHTNode`, on top of its peer lookups.

Kept apart from node.py because it is one idea with its own rules, while the node is about
peers (requests, bans, routing, traversals). Writing a value looks up the nearest peers and
stores it on `num_replicas` of them, moving on to the next candidate only when one fails to
answer. Reading checks local storage and cache first, shares one search among concurrent readers
of the same key (`_pending_gets`), merges what the peers return (the newest value wins, and the
entries of dictionary values found on different peers are merged), caches the result, pushes it
to the nearest peers that lacked it, and schedules cached keys that are being read for a re-fetch
shortly before they expire (the node's `_refresh_cache_loop` does the re-fetch).

`StoreAndGet` is a mixin of `DHTNode` and holds no state of its own: it uses the node's storage,
cache, protocol and settings and the `_pending_gets`, `_refresh_queue` and `_refresh_wakeup` made
in `DHTNode.create`, and sends through `find_nearest_nodes`, `_traverse` and `_send_items`.
"""

import asyncio
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from ..p2p.identity import PeerID
from ..utils.serializer import MSGPackSerializer
from ..utils.timed_storage import ValueWithExpiration
from ..utils.timing import DHTExpiration, get_dht_time
from .cache_refresh import CacheRefreshQueue
from .messages import FindResult, StoreItem
from .protocol import DHTProtocol, make_record
from .records import merge_found, store_items_of, unpack_found
from .routing import DHTID
from .storage import DHTLocalStorage
from .traverse import Traversal, TraversalRequest
from .validation import RecordValidatorBase

DHTKey = Any
Subkey = Any


class StoreAndGet:
    """`store`/`get` and their many-key forms for `DHTNode` (see the module docstring)."""

    # What this mixin uses of the node, all set in `DHTNode.create`; declared so the checker knows them.
    node_id: DHTID
    bucket_size: int
    num_replicas: int
    cache_locally: bool
    cache_nearest: int
    cache_on_store: bool
    cache_refresh_before_expiry: float
    reuse_get_requests: bool
    record_validator: RecordValidatorBase | None
    storage: DHTLocalStorage
    cache: DHTLocalStorage
    protocol: DHTProtocol
    _pending_gets: dict[DHTID, tuple[DHTExpiration, asyncio.Future]]
    _refresh_queue: CacheRefreshQueue
    _refresh_wakeup: asyncio.Event

    if TYPE_CHECKING:  # the node's lookups and sends, defined in node.py

        async def find_nearest_nodes(
            self,
            queries: Collection[DHTID],
            k_nearest: int | None = None,
            beam_size: int | None = None,
            num_workers: int | None = None,
            exclude_self: bool = False,
        ) -> dict[DHTID, dict[DHTID, PeerID]]: ...

        async def _send_items(self, peer_id: PeerID, items: Sequence[StoreItem]) -> list[bool] | None: ...

        def _new_traversal(
            self, queries: Collection[DHTID], beam_size: int, num_workers: int | None
        ) -> Traversal: ...

        async def _traverse(
            self,
            traversal: Traversal,
            on_result: Callable[[TraversalRequest, DHTID, FindResult], None] | None = None,
        ) -> None: ...

        def _spawn(self, coroutine: Coroutine[Any, Any, Any], essential: bool = False) -> None: ...

    # store

    async def store(
        self, key: DHTKey, value: Any, expiration_time: DHTExpiration, subkey: Subkey | None = None, **kwargs
    ) -> bool:
        """Store `value` under `key` (one entry of a dictionary value if `subkey` is given) on the
        `num_replicas` nearest peers. True if at least one of them accepted it."""
        result = await self.store_many([key], [value], expiration_time, subkeys=[subkey], **kwargs)
        return next(iter(result.values()))

    async def store_many(
        self,
        keys: Sequence[DHTKey],
        values: Sequence[Any],
        expiration_time: DHTExpiration | Sequence[DHTExpiration],
        subkeys: Sequence[Subkey | None] | None = None,
        exclude_self: bool = False,
    ) -> dict[Any, bool]:
        """Store many records at once: one lookup for all keys, one request per peer.

        Returns {key: ok} for plain values and {(key, subkey): ok} for dictionary entries; ok means
        at least one replica accepted the record (a replica refuses an older or invalid record)."""
        if isinstance(expiration_time, (int, float)):
            expiration_time = [expiration_time] * len(keys)
        subkeys = [None] * len(keys) if subkeys is None else list(subkeys)
        if not len(keys) == len(values) == len(expiration_time) == len(subkeys):
            raise ValueError("keys, values, expiration_time and subkeys must have the same length")
        now = get_dht_time()
        items, names = [], []
        for key, value, expiration, subkey in zip(keys, values, expiration_time, subkeys):
            key_id = DHTID.generate(source=key)
            subkey_bytes = None if subkey is None else MSGPackSerializer.dumps(subkey)
            value_bytes = MSGPackSerializer.dumps(value)
            if self.record_validator is not None:
                value_bytes = self.record_validator.sign_value(
                    make_record(key_id, subkey_bytes, value_bytes, expiration)
                )
            items.append(StoreItem(key_id, subkey_bytes, value_bytes, float(expiration)))
            names.append(key if subkey is None else (key, subkey))
        live = [i for i, item in enumerate(items) if item.expiration_time > now]
        nearest = await self.find_nearest_nodes(
            {items[i].key for i in live}, k_nearest=self.bucket_size, exclude_self=exclude_self
        )
        accepted = await self._store_on_replicas([items[i] for i in live], nearest)
        ok = dict.fromkeys(names, False)
        for i, stored in zip(live, accepted):
            ok[names[i]] = ok[names[i]] or stored
            if self.cache_on_store:
                item = items[i]
                if stored:
                    self.cache.store(
                        item.key, item.value, item.expiration_time, get_dht_time(), subkey=item.subkey
                    )
                else:  # a newer record exists somewhere: do not keep answering from a stale copy
                    self.cache.remove(item.key)
        return ok

    async def _store_on_replicas(
        self, items: list[StoreItem], nearest: dict[DHTID, dict[DHTID, PeerID]]
    ) -> list[bool]:
        """Store each item on its nearest candidates, moving on to the next candidate only when one
        fails to answer (a refusal is an answer), until `num_replicas` answered or candidates run out."""
        candidates = [list(nearest[item.key].items()) for item in items]
        answered, accepted = [0] * len(items), [False] * len(items)
        while True:
            batches: dict[PeerID, list[int]] = {}
            for i, item in enumerate(items):
                wanted = self.num_replicas - answered[i]
                chosen, candidates[i] = candidates[i][:wanted], candidates[i][wanted:]
                for node_id, peer_id in chosen:
                    if node_id == self.node_id:
                        answered[i] += 1
                        accepted[i] |= self.protocol.store_item(item, get_dht_time())
                    else:
                        batches.setdefault(peer_id, []).append(i)
            if not batches:
                return accepted
            peers = list(batches)
            outcomes = await asyncio.gather(
                *(self._send_items(p, [items[i] for i in batches[p]]) for p in peers)
            )
            for peer_id, outcome in zip(peers, outcomes):
                if outcome is not None:
                    for i, stored in zip(batches[peer_id], outcome):
                        answered[i] += 1
                        accepted[i] |= stored

    # get

    async def get(self, key: DHTKey, latest: bool = False, **kwargs) -> ValueWithExpiration | None:
        """The value under `key` with its expiration, or None. Stops at the first value that has not
        expired; with `latest=True` searches the whole beam and returns the newest, merging the
        entries of dictionary values found on different peers. A dictionary value comes back as
        {subkey: ValueWithExpiration(value, expiration_time)}."""
        result = await self.get_many([key], latest=latest, **kwargs)
        return result[key]

    async def get_many(
        self,
        keys: Collection[DHTKey],
        sufficient_expiration_time: DHTExpiration | None = None,
        latest: bool = False,
        **kwargs,
    ) -> dict[DHTKey, ValueWithExpiration | None]:
        """`get` for many keys in one lookup. A value is good enough once it expires no earlier than
        `sufficient_expiration_time` (default: now, i.e. any live value; `latest`: never)."""
        if latest:
            sufficient_expiration_time = float("inf")
        key_ids = {key: DHTID.generate(source=key) for key in keys}
        found = await self.get_many_by_id(list(key_ids.values()), sufficient_expiration_time, **kwargs)
        now = get_dht_time()
        return {
            key: unpack_found(key_id, found[key_id], self.record_validator, now)
            for key, key_id in key_ids.items()
        }

    async def get_many_by_id(
        self,
        key_ids: Collection[DHTID],
        sufficient_expiration_time: DHTExpiration | None = None,
        num_workers: int | None = None,
        beam_size: int | None = None,
        _is_refresh: bool = False,
    ) -> dict[DHTID, ValueWithExpiration | None]:
        """Raw records (validated, still serialized and signed) for DHT ids; see `get_many`."""
        now = get_dht_time()
        sufficient = now if sufficient_expiration_time is None else sufficient_expiration_time
        merged = DHTLocalStorage()
        to_search = []
        for key_id in dict.fromkeys(key_ids):
            stored, cached = self.storage.get(key_id, now), self.cache.get(key_id, now)
            for local in (stored, cached):
                if local is not None:
                    merge_found(merged, key_id, local, now)
            if cached is not None and not _is_refresh and self.cache_refresh_before_expiry > 0:
                if self._refresh_queue.schedule(
                    key_id, cached.expiration_time - self.cache_refresh_before_expiry
                ):
                    self._refresh_wakeup.set()
            best = merged.get(key_id, now)
            if best is None or best.expiration_time < sufficient:
                to_search.append(key_id)

        loop = asyncio.get_running_loop()
        reused, own = {}, []
        for key_id in to_search:
            pending = self._pending_gets.get(key_id)
            if self.reuse_get_requests and pending is not None and pending[0] >= sufficient:
                reused[key_id] = pending[1]
            else:
                own.append(key_id)
        futures = {key_id: loop.create_future() for key_id in own}
        for key_id, future in futures.items():
            if key_id not in self._pending_gets or self._pending_gets[key_id][0] < sufficient:
                self._pending_gets[key_id] = (sufficient, future)
        try:
            if own:
                await self._search(own, merged, sufficient, num_workers, beam_size)
        finally:
            now = get_dht_time()
            for key_id, future in futures.items():
                if not future.done():
                    future.set_result(merged.get(key_id, now))
                if self._pending_gets.get(key_id, (None, None))[1] is future:
                    del self._pending_gets[key_id]
        for key_id, future in reused.items():
            try:
                shared = await asyncio.shield(future)
            except asyncio.CancelledError:
                if not future.cancelled():
                    raise  # we were cancelled ourselves
                shared = None  # the other search was cancelled; we keep what we have
            if shared is not None:
                merge_found(merged, key_id, shared, get_dht_time())
        now = get_dht_time()
        return {key_id: merged.get(key_id, now) for key_id in key_ids}

    async def _search(
        self, key_ids: list[DHTID], merged: DHTLocalStorage, sufficient: float, num_workers, beam_size
    ) -> None:
        beam_size = beam_size or self.bucket_size
        traversal = self._new_traversal(key_ids, beam_size, num_workers)
        answers: dict[DHTID, list[tuple[float, DHTID, PeerID]]] = {key_id: [] for key_id in key_ids}

        def on_result(request: TraversalRequest, key_id: DHTID, result: FindResult) -> None:
            now = get_dht_time()
            merge_found(merged, key_id, result, now, sender=request.peer_id.to_bytes())
            answers[key_id].append((result.expiration_time, request.node_id, request.peer_id))
            best = merged.get(key_id, now)
            if best is not None and best.expiration_time >= sufficient:
                traversal.finish(key_id)

        await self._traverse(traversal, on_result)
        now = get_dht_time()
        for key_id in key_ids:
            best = merged.get(key_id, now)
            if best is None:
                continue
            if self.cache_locally:
                merge_found(self.cache, key_id, best, now)
            if self.cache_nearest > 0:
                lacking = sorted(
                    (
                        (node_id, peer_id)
                        for expiration, node_id, peer_id in answers[key_id]
                        if expiration < best.expiration_time
                    ),
                    key=lambda item: item[0] ^ key_id,
                )
                items = store_items_of(key_id, best, now, in_cache=True)
                for _, peer_id in lacking[: self.cache_nearest]:
                    self._spawn(self._send_items(peer_id, items))
