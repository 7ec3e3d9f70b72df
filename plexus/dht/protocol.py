"""The DHT protocol core: what a node answers, and what it learns from every message.

Theory of operation. `DHTProtocol.handle(sender, request, now)` turns one decoded request into its
response and a list of follow-up actions, updating storage and the routing table on the way; it
does no I/O and reads no clock. The node's driver performs the actions:
- `PingToEvict`: a bucket is full and may not split, or an entry we just named in a find answer
  has been silent for a while (liveness.py); ping that peer, and if that fails, `peer_failed`
  evicts it (a replacement, such as the newcomer, takes its place);
- `HandOver`: a new peer is now among the `num_replicas` nearest known peers of keys we are
  responsible for; send it those records (Kademlia's key transfer on join).
The routing table is updated from every request that names a sender id (client-mode senders name
none, so they never enter it) and, via `peer_seen`, from every answered outgoing request. Each
peer comes with its IP as the transport saw it (`ip_of`), for the table's diversity bounds; a
peer they turn away is logged (once a minute per network) and otherwise served as usual.
Ping with `validate` asks us to ping the caller back; the driver does that first and passes the
outcome as `available`, and the caller is added to the table only if it answered.

Records are validated before they are stored; the driver validates found records it receives with
`filter_found` (stores are refused and invalid found records dropped, one record at a time).
"""

import dataclasses
import logging
from collections.abc import Callable, Sequence

from ..p2p.identity import PeerID
from ..utils.logging import RateLimitedLog
from .liveness import LivenessChecker
from .messages import (
    FindRequest,
    FindResponse,
    FindResult,
    PingRequest,
    PingResponse,
    Request,
    Response,
    StoreItem,
    StoreRequest,
    StoreResponse,
)
from .records import PLAIN_VALUE_SUBKEY, make_record, merge_found
from .routing import DHTID, RoutingTable
from .storage import DHTLocalStorage, DictionaryDHTValue, ValueWithExpiration, describe_sender
from .validation import RecordValidatorBase

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PingToEvict:
    """Ping `node_id`; if it does not answer, evict it so a waiting replacement moves in."""

    node_id: DHTID
    peer_id: PeerID


@dataclasses.dataclass(frozen=True)
class HandOver:
    """Store `items` on the newly seen peer, which is now among the nearest to their keys."""

    node_id: DHTID
    peer_id: PeerID
    items: tuple[StoreItem, ...]


Action = PingToEvict | HandOver
__all__ = ["PLAIN_VALUE_SUBKEY", "Action", "DHTProtocol", "HandOver", "PingToEvict", "make_record"]


class DHTProtocol:
    """One node's storage, cache and routing table, and the rules that connect them to messages."""

    def __init__(
        self,
        node_id: DHTID,
        routing_table: RoutingTable,
        storage: DHTLocalStorage,
        cache: DHTLocalStorage,
        validator: RecordValidatorBase | None = None,
        num_replicas: int = 5,
        client_mode: bool = False,
        addresses_of: Callable[[PeerID], Sequence[bytes]] | None = None,
        ip_of: Callable[[PeerID], str | None] | None = None,
        liveness: LivenessChecker | None = None,
    ):
        self.node_id, self.routing_table, self.storage, self.cache = node_id, routing_table, storage, cache
        self.validator, self.num_replicas, self.client_mode = validator, num_replicas, client_mode
        self.addresses_of, self.ip_of, self.liveness = addresses_of, ip_of, liveness
        self._refusals = RateLimitedLog(logger)

    @property
    def record_validator(self) -> RecordValidatorBase | None:
        """The validator, by the name hivemind code reaches it with (`node.protocol.record_validator`)."""
        return self.validator

    @property
    def own_id(self) -> DHTID | None:
        """The id we put in our messages: none in client mode, so nobody adds us to their table."""
        return None if self.client_mode else self.node_id

    # server side

    def handle(
        self, sender: PeerID, request: Request, now: float, available: bool = False
    ) -> tuple[Response, list[Action]]:
        actions: list[Action] = []
        if request.node_id is not None and request.node_id != self.node_id:
            if not (isinstance(request, PingRequest) and request.validate and not available):
                actions = self.peer_seen(request.node_id, sender, now)
        if isinstance(request, PingRequest):
            return PingResponse(self.own_id, now, available), actions
        if isinstance(request, StoreRequest):
            stored = tuple(self.store_item(item, now, sender.to_bytes()) for item in request.items)
            return StoreResponse(self.own_id, stored), actions
        if isinstance(request, FindRequest):
            results = tuple(self._find(key, request.node_id, now) for key in request.keys)
            if self.liveness is not None:
                named = dict.fromkeys(entry for result in results for entry in result.nearest)
                due = self.liveness.to_check(named, self.routing_table.last_seen, now)
                actions.extend(PingToEvict(node_id, peer_id) for node_id, peer_id in due)
            return FindResponse(self.own_id, results, self._addresses(results)), actions
        raise TypeError(f"not a DHT request: {type(request).__name__}")

    def is_valid(self, key: DHTID, subkey: bytes | None, value: bytes, expiration_time: float) -> bool:
        return self.validator is None or self.validator.validate(
            make_record(key, subkey, value, expiration_time)
        )

    def store_item(self, item: StoreItem, now: float, sender: bytes | None = None) -> bool:
        """Validate and keep one record (in the cache if `in_cache`), booked to `sender` (the peer id
        bytes of whoever sent it; None: ourselves) for the storage limits; False if refused."""
        if not self.is_valid(item.key, item.subkey, item.value, item.expiration_time):
            self._refusals.warning(
                ("invalid record", sender),
                f"refused a record from {describe_sender(sender)}: "
                f"it fails validation (signature, schema or bounds)",
            )
            return False
        target = self.cache if item.in_cache else self.storage
        return target.store(item.key, item.value, item.expiration_time, now, item.subkey, sender)

    def lookup_local(self, key: DHTID, now: float) -> ValueWithExpiration | None:
        """What storage and cache hold for `key`, merged by the usual record rules."""
        stored, cached = self.storage.get(key, now), self.cache.get(key, now)
        if stored is None or cached is None:
            return cached if stored is None else stored
        merged = DHTLocalStorage()
        for found in (stored, cached):
            merge_found(merged, key, found, now)
        return merged.get(key, now)

    def _addresses(self, results: Sequence[FindResult]) -> tuple:
        """Dialable addresses of every peer the results name (when the transport knows them)."""
        if self.addresses_of is None:
            return ()
        peers = dict.fromkeys(peer for result in results for _, peer in result.nearest)
        return tuple((peer, tuple(addrs)) for peer in peers if (addrs := self.addresses_of(peer)))

    def _find(self, key: DHTID, requester: DHTID | None, now: float) -> FindResult:
        nearest = tuple(
            self.routing_table.get_nearest_neighbors(key, self.routing_table.bucket_size, requester)
        )
        found = self.lookup_local(key, now)
        if found is None:
            return FindResult(None, None, float("-inf"), nearest)
        if isinstance(found.value, DictionaryDHTValue):
            entries = tuple(
                (subkey, item.value, item.expiration_time)
                for subkey, item in self.storage.reply_items(found.value, now)
            )
            return FindResult(None, entries, found.expiration_time, nearest)
        return FindResult(found.value, None, found.expiration_time, nearest)

    # routing-table bookkeeping, for requests we serve and answers we get

    def peer_seen(self, node_id: DHTID, peer_id: PeerID, now: float) -> list[Action]:
        is_new = node_id not in self.routing_table
        ip = self.ip_of(peer_id) if self.ip_of is not None else None
        if is_new and (refusal := self.routing_table.refusal(node_id, ip)) is not None:
            diversity = self.routing_table.diversity
            group = None if diversity is None else diversity.group_of(ip)
            self._refusals.log(
                logging.INFO,
                ("routing diversity", group),
                f"not adding {peer_id} at {ip} to the routing table: {refusal}",
            )
            return []
        to_ping = self.routing_table.add_or_update_node(node_id, peer_id, now, ip)
        actions: list[Action] = []
        if to_ping is not None:
            actions.append(PingToEvict(*to_ping))
        if is_new and node_id in self.routing_table and not self.client_mode:
            items = self.items_to_hand_over(node_id, now)
            if items:
                actions.append(HandOver(node_id, peer_id, tuple(items)))
        return actions

    def peer_failed(self, peer_id: PeerID) -> None:
        self.routing_table.remove_peer(peer_id)

    def items_to_hand_over(self, new_node_id: DHTID, now: float) -> list[StoreItem]:
        """Records the new peer should now hold: it is among the `num_replicas` nearest known peers
        of the key, and we are nearer to the key than any other peer we know (so one node sends)."""
        items: list[StoreItem] = []
        for key, (value, expiration_time) in self.storage.items(now):
            neighbours = self.routing_table.get_nearest_neighbors(
                key, self.num_replicas, exclude=self.node_id
            )
            if new_node_id not in (node_id for node_id, _ in neighbours):
                continue
            others = [node_id ^ key for node_id, _ in neighbours if node_id != new_node_id]
            if others and (self.node_id ^ key) > min(others):
                continue
            if isinstance(value, DictionaryDHTValue):
                items.extend(
                    StoreItem(key, sub, item.value, item.expiration_time) for sub, item in value.items(now)
                )
            else:
                items.append(StoreItem(key, None, value, expiration_time))
        return items

    # client side: what we accept from the answers of others

    def filter_found(self, key: DHTID, result: FindResult, now: float) -> FindResult:
        """The result without records that fail validation or have already expired."""
        if result.value is not None:
            if result.expiration_time > now and self.is_valid(
                key, None, result.value, result.expiration_time
            ):
                return result
            return dataclasses.replace(result, value=None, expiration_time=float("-inf"))
        if result.entries is not None:
            entries = tuple(
                (subkey, value, expiration)
                for subkey, value, expiration in result.entries
                if expiration > now and self.is_valid(key, subkey, value, expiration)
            )
            if not entries:
                return dataclasses.replace(result, entries=None, expiration_time=float("-inf"))
            return dataclasses.replace(result, entries=entries, expiration_time=max(e[2] for e in entries))
        return result
