"""The DHT wire messages on protocol `/plexus/dht/1.0.0`: ping, bulk store, bulk find.

Theory of operation. Every request and response is one msgpack array `[tag, field, ...]`; the tag
says which message it is, the fields follow in declaration order. A request carries the sender's
DHT node id, or nil for a client-mode node ("do not add me to your routing table"); the sender's
PeerID comes from the transport, which authenticated it, never from the message. A server that
cannot make sense of a request answers `ErrorResponse(message)` and keeps serving.

Everything from the wire is validated on decode, with every bound explicit: total size, keys per
request, neighbours per key, entries per dictionary, id and peer id lengths, finite expirations.
Any violation raises `DHTProtocolError` naming the message and field, so the driver can answer or
drop that peer and nothing else. Values and subkeys stay opaque bytes here (msgpack of the user's
data, produced by `MSGPackSerializer`); this module never deserializes user data.

Differences from hivemind's protobufs: no auth fields (peers are authenticated by the transport),
and a dictionary travels as a list of (subkey, value, expiration) entries rather than a nested
msgpack extension, so it is validated like everything else.
"""

import dataclasses
import math
from typing import Any, ClassVar, TypeVar

import msgpack

from ..errors import PeerError
from ..p2p.identity import IdentityError, PeerID
from ..p2p.protocols.errors import RemoteProtocolError
from .routing import DHTID, ID_BYTES

PROTOCOL_ID = "/plexus/dht/1.0.0"
MAX_MESSAGE_SIZE = 16 * 1024 * 1024
MAX_KEYS_PER_REQUEST = 1024
MAX_NEAREST_PER_KEY = 256
MAX_DICTIONARY_ENTRIES = 65536
MAX_PEER_ID_LENGTH = 64
MAX_ERROR_LENGTH = 1024
MAX_ADDRESSED_PEERS = 1024
MAX_ADDRESSES_PER_PEER = 8
MAX_ADDRESS_LENGTH = 1024


class DHTProtocolError(RemoteProtocolError):
    """A peer sent a DHT message that is malformed, oversized or of the wrong kind."""


class DHTRPCError(PeerError):
    """A DHT call failed on the remote side: it answered with an error (or the transport reports one)."""


def _fail(where: str, problem: str) -> DHTProtocolError:
    return DHTProtocolError(f"malformed DHT message: {where}: {problem}")


def _type_name(value: Any) -> str:
    return type(value).__name__


def _list(value: Any, where: str, max_length: int) -> list:
    if not isinstance(value, list):
        raise _fail(where, f"expected an array, got {_type_name(value)}")
    if len(value) > max_length:
        raise _fail(where, f"{len(value)} items exceed the limit of {max_length}")
    return value


def _fields(value: Any, where: str, count: int) -> list:
    items = _list(value, where, count)
    if len(items) != count:
        raise _fail(where, f"expected {count} fields, got {len(items)}")
    return items


def _bytes(value: Any, where: str, max_length: int = MAX_MESSAGE_SIZE) -> bytes:
    if not isinstance(value, bytes):
        raise _fail(where, f"expected bytes, got {_type_name(value)}")
    if len(value) > max_length:
        raise _fail(where, f"{len(value)} bytes exceed the limit of {max_length}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"expected a boolean, got {_type_name(value)}")
    return value


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(where, f"expected a finite number, got {value!r:.40}")
    return float(value)


def _node_id(value: Any, where: str) -> DHTID:
    raw = _bytes(value, where, ID_BYTES)
    if len(raw) != ID_BYTES:
        raise _fail(where, f"a DHT id has {ID_BYTES} bytes, got {len(raw)}")
    return DHTID.from_bytes(raw)


def _optional_node_id(value: Any, where: str) -> DHTID | None:
    return None if value is None else _node_id(value, where)


# Find responses repeat the same few peers, and parsing a PeerID costs a base58 encode: remember
# recent ones (bounded, oldest dropped first). Both caches hold only values that passed validation.
PEER_ID_CACHE_SIZE = 4096
_peer_id_cache: dict[bytes, PeerID] = {}
_neighbour_cache: dict[tuple[bytes, bytes], tuple[DHTID, PeerID]] = {}


def _peer_id(value: Any, where: str) -> PeerID:
    raw = _bytes(value, where, MAX_PEER_ID_LENGTH)
    peer_id = _peer_id_cache.get(raw)
    if peer_id is None:
        try:
            peer_id = PeerID(raw)
        except IdentityError as error:
            raise _fail(where, str(error)) from None
        if len(_peer_id_cache) >= PEER_ID_CACHE_SIZE:
            _peer_id_cache.pop(next(iter(_peer_id_cache)))
        _peer_id_cache[raw] = peer_id
    return peer_id


def _optional_node_id_bytes(node_id: DHTID | None) -> bytes | None:
    return None if node_id is None else node_id.to_bytes()


class Message:
    """Base of all DHT messages: `encode()` to bytes, `cls.decode(bytes)` validated."""

    TAG: ClassVar[int]

    def _to_wire(self) -> list:
        raise NotImplementedError

    @classmethod
    def _from_wire(cls, fields: list) -> "Message":
        raise NotImplementedError

    def encode(self) -> bytes:
        data = msgpack.packb([self.TAG, *self._to_wire()], use_bin_type=True)
        if len(data) > MAX_MESSAGE_SIZE:
            raise ValueError(
                f"{type(self).__name__} of {len(data)} bytes exceeds {MAX_MESSAGE_SIZE}; split it"
            )
        return data

    @classmethod
    def decode(cls, data: bytes) -> "Message":
        """Parse and validate; on the base class any message, on a subclass only that message."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DHTProtocolError(f"malformed DHT message: expected bytes, got {_type_name(data)}")
        if len(data) > MAX_MESSAGE_SIZE:
            raise DHTProtocolError(
                f"DHT message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_SIZE}"
            )
        try:
            raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            raise DHTProtocolError(f"malformed DHT message: not msgpack ({type(error).__name__})") from None
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], int) or isinstance(raw[0], bool):
            raise DHTProtocolError("malformed DHT message: expected an array that starts with a message tag")
        message_cls = MESSAGE_TYPES.get(raw[0])
        if message_cls is None:
            raise DHTProtocolError(f"malformed DHT message: unknown message tag {raw[0]}")
        if cls is not Message and message_cls is not cls:
            raise DHTProtocolError(f"expected {cls.__name__}, got {message_cls.__name__}")
        return message_cls._from_wire(raw[1:])


@dataclasses.dataclass(frozen=True)
class PingRequest(Message):
    """Are you alive, what is your DHT id and time? With `validate`, also: can you reach me back?"""

    TAG: ClassVar[int] = 1
    node_id: DHTID | None
    validate: bool = False

    def _to_wire(self) -> list:
        return [_optional_node_id_bytes(self.node_id), self.validate]

    @classmethod
    def _from_wire(cls, fields: list) -> "PingRequest":
        node_id, validate = _fields(fields, "PingRequest", 2)
        return cls(_optional_node_id(node_id, "PingRequest.node_id"), _bool(validate, "PingRequest.validate"))


@dataclasses.dataclass(frozen=True)
class PingResponse(Message):
    """The callee's id and clock; `available` says whether it could ping the caller back."""

    TAG: ClassVar[int] = 2
    node_id: DHTID | None
    dht_time: float
    available: bool = False

    def _to_wire(self) -> list:
        return [_optional_node_id_bytes(self.node_id), self.dht_time, self.available]

    @classmethod
    def _from_wire(cls, fields: list) -> "PingResponse":
        node_id, dht_time, available = _fields(fields, "PingResponse", 3)
        return cls(
            _optional_node_id(node_id, "PingResponse.node_id"),
            _time(dht_time, "PingResponse.dht_time"),
            _bool(available, "PingResponse.available"),
        )


@dataclasses.dataclass(frozen=True)
class StoreItem:
    """One record to store. `subkey` None: a plain value; else msgpack of the dictionary sub-key.
    `in_cache`: keep it in the callee's evictable cache rather than its primary storage."""

    key: DHTID
    subkey: bytes | None
    value: bytes
    expiration_time: float
    in_cache: bool = False

    def _to_wire(self) -> list:
        return [self.key.to_bytes(), self.subkey, self.value, self.expiration_time, self.in_cache]

    @classmethod
    def _from_wire(cls, fields: Any, where: str) -> "StoreItem":
        key, subkey, value, expiration_time, in_cache = _fields(fields, where, 5)
        return cls(
            _node_id(key, where + ".key"),
            None if subkey is None else _bytes(subkey, where + ".subkey"),
            _bytes(value, where + ".value"),
            _time(expiration_time, where + ".expiration_time"),
            _bool(in_cache, where + ".in_cache"),
        )


@dataclasses.dataclass(frozen=True)
class StoreRequest(Message):
    TAG: ClassVar[int] = 3
    node_id: DHTID | None
    items: tuple[StoreItem, ...]

    def __post_init__(self):
        if len(self.items) > MAX_KEYS_PER_REQUEST:
            raise ValueError(f"at most {MAX_KEYS_PER_REQUEST} items per StoreRequest, got {len(self.items)}")

    def _to_wire(self) -> list:
        return [_optional_node_id_bytes(self.node_id), [item._to_wire() for item in self.items]]

    @classmethod
    def _from_wire(cls, fields: list) -> "StoreRequest":
        node_id, items = _fields(fields, "StoreRequest", 2)
        items = _list(items, "StoreRequest.items", MAX_KEYS_PER_REQUEST)
        return cls(
            _optional_node_id(node_id, "StoreRequest.node_id"),
            tuple(StoreItem._from_wire(item, f"StoreRequest.items[{i}]") for i, item in enumerate(items)),
        )


@dataclasses.dataclass(frozen=True)
class StoreResponse(Message):
    """One flag per stored item, in request order: True if the callee accepted it."""

    TAG: ClassVar[int] = 4
    node_id: DHTID | None
    results: tuple[bool, ...]

    def _to_wire(self) -> list:
        return [_optional_node_id_bytes(self.node_id), list(self.results)]

    @classmethod
    def _from_wire(cls, fields: list) -> "StoreResponse":
        node_id, results = _fields(fields, "StoreResponse", 2)
        results = _list(results, "StoreResponse.results", MAX_KEYS_PER_REQUEST)
        return cls(
            _optional_node_id(node_id, "StoreResponse.node_id"),
            tuple(_bool(ok, f"StoreResponse.results[{i}]") for i, ok in enumerate(results)),
        )


@dataclasses.dataclass(frozen=True)
class FindRequest(Message):
    """For each key: the value the callee holds (if any) and the callee's nearest known peers."""

    TAG: ClassVar[int] = 5
    node_id: DHTID | None
    keys: tuple[DHTID, ...]

    def __post_init__(self):
        if len(self.keys) > MAX_KEYS_PER_REQUEST:
            raise ValueError(f"at most {MAX_KEYS_PER_REQUEST} keys per FindRequest, got {len(self.keys)}")

    def _to_wire(self) -> list:
        return [_optional_node_id_bytes(self.node_id), [key.to_bytes() for key in self.keys]]

    @classmethod
    def _from_wire(cls, fields: list) -> "FindRequest":
        node_id, keys = _fields(fields, "FindRequest", 2)
        keys = _list(keys, "FindRequest.keys", MAX_KEYS_PER_REQUEST)
        return cls(
            _optional_node_id(node_id, "FindRequest.node_id"),
            tuple(_node_id(key, f"FindRequest.keys[{i}]") for i, key in enumerate(keys)),
        )


DictionaryEntry = tuple[bytes, bytes, float]  # (subkey, value, expiration_time)


@dataclasses.dataclass(frozen=True)
class FindResult:
    """What the callee knows about one key. Exactly one of: nothing (`value` and `entries` None),
    a plain value (`value`), or a dictionary (`entries`); `expiration_time` is the record's, or
    -inf when nothing was found. `nearest` are the callee's nearest peers, the requester excluded."""

    value: bytes | None
    entries: tuple[DictionaryEntry, ...] | None
    expiration_time: float
    nearest: tuple[tuple[DHTID, PeerID], ...]

    def __post_init__(self):
        if self.value is not None and self.entries is not None:
            raise ValueError("a FindResult holds a plain value or a dictionary, not both")

    @property
    def found(self) -> bool:
        return self.value is not None or self.entries is not None

    def _to_wire(self) -> list:
        payload: list | bytes | None
        if self.entries is not None:
            kind, payload = 2, [list(entry) for entry in self.entries]
        else:
            kind, payload = (0, None) if self.value is None else (1, self.value)
        expiration_time = self.expiration_time if self.found else 0.0
        return [
            kind,
            payload,
            expiration_time,
            [[uid.to_bytes(), peer.to_bytes()] for uid, peer in self.nearest],
        ]

    @classmethod
    def _from_wire(cls, fields: Any, where: str) -> "FindResult":
        kind, payload, expiration_time, nearest = _fields(fields, where, 4)
        nearest = _list(nearest, where + ".nearest", MAX_NEAREST_PER_KEY)
        neighbours = []
        cache = _neighbour_cache
        for i, pair in enumerate(nearest):
            # fast path: a well-formed pair seen before; anything else takes the checks that name the field
            neighbour = None
            if type(pair) is list and len(pair) == 2:
                uid, peer = pair
                if type(uid) is bytes and type(peer) is bytes:
                    neighbour = cache.get((uid, peer))
            if neighbour is None:
                uid, peer = _fields(pair, f"{where}.nearest[{i}]", 2)
                neighbour = (_node_id(uid, f"{where}.nearest[{i}]"), _peer_id(peer, f"{where}.nearest[{i}]"))
                if len(cache) >= PEER_ID_CACHE_SIZE:
                    cache.pop(next(iter(cache)))
                cache[(uid, peer)] = neighbour
            neighbours.append(neighbour)
        value: bytes | None = None
        entries: tuple[DictionaryEntry, ...] | None = None
        if kind == 0:
            if payload is not None:
                raise _fail(where, "a not-found result carries no value")
            return cls(None, None, float("-inf"), tuple(neighbours))
        if kind == 1:
            value = _bytes(payload, where + ".value")
        elif kind == 2:
            payload = _list(payload, where + ".entries", MAX_DICTIONARY_ENTRIES)
            parsed = []
            for i, entry in enumerate(payload):
                subkey, item, expiration = _fields(entry, f"{where}.entries[{i}]", 3)
                parsed.append(
                    (
                        _bytes(subkey, f"{where}.entries[{i}].subkey"),
                        _bytes(item, f"{where}.entries[{i}].value"),
                        _time(expiration, f"{where}.entries[{i}].expiration_time"),
                    )
                )
            entries = tuple(parsed)
        else:
            raise _fail(where, f"unknown result kind {kind!r:.20}")
        return cls(value, entries, _time(expiration_time, where + ".expiration_time"), tuple(neighbours))


def _addressed_peer(entry: Any, i: int) -> tuple[PeerID, tuple[bytes, ...]]:
    """One (peer, binary multiaddrs) entry of FindResponse.addresses, validated field by field."""
    where = f"FindResponse.addresses[{i}]"
    peer, addrs = _fields(entry, where, 2)
    addrs = _list(addrs, where + ".addrs", MAX_ADDRESSES_PER_PEER)
    return (
        _peer_id(peer, where + ".peer"),
        tuple(_bytes(addr, f"{where}.addrs[{j}]", MAX_ADDRESS_LENGTH) for j, addr in enumerate(addrs)),
    )


@dataclasses.dataclass(frozen=True)
class FindResponse(Message):
    """One result per requested key, in request order, and how to dial the peers they name.

    `addresses` maps the peers named in `nearest` to their binary multiaddrs, so the requester
    can contact peers it has never met (the DHT ids alone are not dialable)."""

    TAG: ClassVar[int] = 6
    node_id: DHTID | None
    results: tuple[FindResult, ...]
    addresses: tuple[tuple[PeerID, tuple[bytes, ...]], ...] = ()

    def _to_wire(self) -> list:
        return [
            _optional_node_id_bytes(self.node_id),
            [result._to_wire() for result in self.results],
            [[peer.to_bytes(), list(addrs)] for peer, addrs in self.addresses],
        ]

    @classmethod
    def _from_wire(cls, fields: list) -> "FindResponse":
        node_id, results, addresses = _fields(fields, "FindResponse", 3)
        results = _list(results, "FindResponse.results", MAX_KEYS_PER_REQUEST)
        addressed = []
        cache = _peer_id_cache
        for i, entry in enumerate(_list(addresses, "FindResponse.addresses", MAX_ADDRESSED_PEERS)):
            if type(entry) is list and len(entry) == 2:  # fast path for a known peer, else full checks
                peer, addrs = entry
                if type(peer) is bytes and type(addrs) is list and len(addrs) <= MAX_ADDRESSES_PER_PEER:
                    peer_id = cache.get(peer)
                    if peer_id is not None:
                        for addr in addrs:
                            if type(addr) is not bytes or len(addr) > MAX_ADDRESS_LENGTH:
                                break
                        else:
                            addressed.append((peer_id, tuple(addrs)))
                            continue
            addressed.append(_addressed_peer(entry, i))
        return cls(
            _optional_node_id(node_id, "FindResponse.node_id"),
            tuple(
                FindResult._from_wire(result, f"FindResponse.results[{i}]")
                for i, result in enumerate(results)
            ),
            tuple(addressed),
        )


@dataclasses.dataclass(frozen=True)
class ErrorResponse(Message):
    """The callee could not serve the request; `message` says why (for the caller's logs)."""

    TAG: ClassVar[int] = 7
    message: str

    def _to_wire(self) -> list:
        return [self.message[:MAX_ERROR_LENGTH]]

    @classmethod
    def _from_wire(cls, fields: list) -> "ErrorResponse":
        (message,) = _fields(fields, "ErrorResponse", 1)
        if not isinstance(message, str):
            raise _fail("ErrorResponse.message", f"expected a string, got {_type_name(message)}")
        return cls(message[:MAX_ERROR_LENGTH])


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls
    for cls in (
        PingRequest,
        PingResponse,
        StoreRequest,
        StoreResponse,
        FindRequest,
        FindResponse,
        ErrorResponse,
    )
}
Request = PingRequest | StoreRequest | FindRequest
Response = PingResponse | StoreResponse | FindResponse


def decode_request(data: bytes) -> Request:
    message = Message.decode(data)
    if not isinstance(message, (PingRequest, StoreRequest, FindRequest)):
        raise DHTProtocolError(f"expected a DHT request, got {type(message).__name__}")
    return message


ResponseT = TypeVar("ResponseT", PingResponse, StoreResponse, FindResponse)


def decode_response(data: bytes, expected: type[ResponseT]) -> ResponseT:
    """Parse the answer to a request; an `ErrorResponse` becomes `DHTRPCError` with its message."""
    message = Message.decode(data)
    if isinstance(message, ErrorResponse):
        raise DHTRPCError(message.message)
    if not isinstance(message, expected):
        raise DHTProtocolError(f"expected {expected.__name__} in reply, got {type(message).__name__}")
    return message
