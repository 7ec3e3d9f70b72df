"""DHT wire messages: exact round trips, and every malformed input is a DHTProtocolError."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.dht.messages import (
    MAX_KEYS_PER_REQUEST,
    DHTProtocolError,
    DHTRPCError,
    ErrorResponse,
    FindRequest,
    FindResponse,
    FindResult,
    Message,
    PingRequest,
    PingResponse,
    StoreItem,
    StoreRequest,
    StoreResponse,
    decode_request,
    decode_response,
)
from plexus.dht.routing import DHTID
from plexus.p2p.identity import PrivateKey

pytestmark = pytest.mark.timeout(60)

PEER = PrivateKey.from_seed(b"\x01" * 32).peer_id
A, B = DHTID.generate("a"), DHTID.generate("b")

MESSAGES = [
    PingRequest(A, validate=True),
    PingRequest(None),
    PingResponse(A, 1234.5, available=True),
    StoreRequest(A, (StoreItem(B, None, b"v", 10.0), StoreItem(B, b"\xa1s", b"w", 11.0, in_cache=True))),
    StoreResponse(None, (True, False)),
    FindRequest(None, (A, B)),
    FindResponse(
        B,
        (
            FindResult(None, None, float("-inf"), ((A, PEER),)),
            FindResult(b"value", None, 12.0, ()),
            FindResult(None, ((b"\xa1s", b"x", 3.0), (b"\xa1t", b"y", 4.0)), 4.0, ((B, PEER),)),
        ),
    ),
    ErrorResponse("nope"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = message.encode()
    assert Message.decode(data) == message
    assert type(message).decode(data) == message


def test_decode_as_the_wrong_kind():
    with pytest.raises(DHTProtocolError, match="expected PingRequest"):
        PingRequest.decode(FindRequest(None, ()).encode())
    with pytest.raises(DHTProtocolError, match="expected a DHT request"):
        decode_request(PingResponse(None, 1.0).encode())
    with pytest.raises(DHTRPCError, match="nope"):
        decode_response(ErrorResponse("nope").encode(), PingResponse)
    with pytest.raises(DHTProtocolError):
        decode_response(StoreResponse(None, ()).encode(), FindResponse)


def wire(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


ID = A.to_bytes()
BAD = {
    "not msgpack": b"\xc1",
    "not an array": msgpack.packb({"a": 1}),
    "empty": wire(),
    "unknown tag": wire(99),
    "bool tag": wire(True, None, False),
    "missing field": wire(1, None),
    "extra field": wire(1, None, False, 3),
    "short id": wire(1, b"\x01" * 19, False),
    "id as str": wire(1, "x" * 20, False),
    "validate as int": wire(1, None, 1),
    "nan time": wire(2, None, float("nan"), False),
    "inf expiration": wire(3, None, [[ID, None, b"v", float("inf"), False]]),
    "str value": wire(3, None, [[ID, None, "v", 1.0, False]]),
    "item not array": wire(3, None, [ID]),
    "too many keys": wire(5, None, [ID] * (MAX_KEYS_PER_REQUEST + 1)),
    "bad peer id": wire(6, None, [[0, None, 0.0, [[ID, b"\x00\x99garbage"]]]]),
    "unknown result kind": wire(6, None, [[7, None, 0.0, []]]),
    "not found with value": wire(6, None, [[0, b"x", 0.0, []]]),
    "entry too short": wire(6, None, [[2, [[b"s", b"v"]], 1.0, []]]),
    "error not str": wire(7, 5),
    "trailing bytes": PingRequest(None).encode() + b"\x00",
}


@pytest.mark.parametrize("data", BAD.values(), ids=BAD.keys())
def test_malformed_messages_raise_protocol_error(data):
    with pytest.raises(DHTProtocolError):
        Message.decode(data)


def test_oversize_is_refused_before_parsing():
    with pytest.raises(DHTProtocolError, match="exceeds"):
        Message.decode(b"\x00" * (16 * 1024 * 1024 + 1))
    with pytest.raises(ValueError):
        FindRequest(None, (A,) * (MAX_KEYS_PER_REQUEST + 1))


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_any_bytes_parse_or_raise_protocol_error(data):
    try:
        Message.decode(data)
    except DHTProtocolError:
        pass


@given(st.sampled_from(MESSAGES), st.integers(0, 10**6), st.integers(0, 255))
@settings(max_examples=300, deadline=None)
def test_mutated_messages_parse_or_raise_protocol_error(message, position, byte):
    data = bytearray(message.encode())
    data[position % len(data)] = byte
    try:
        Message.decode(bytes(data))
    except DHTProtocolError:
        pass
    try:
        Message.decode(bytes(data[: position % len(data)]))
    except DHTProtocolError:
        pass


def test_known_peers_take_a_fast_path_that_still_checks_every_field():
    """Find responses name the same peers again and again, so decoding skips re-parsing a peer seen
    before; malformed entries about such a peer must still be refused."""
    known = FindResponse(
        B, (FindResult(None, None, float("-inf"), ((A, PEER),)),), ((PEER, (b"\x04\x7f\x00\x00\x01",)),)
    )
    assert Message.decode(known.encode()) == known  # now A and PEER are cached
    peer, addr = PEER.to_bytes(), b"\x04\x7f\x00\x00\x01"
    bad = {
        "nearest pair with a list": [[0, None, 0.0, [[ID, [peer]]]]],
        "nearest pair too long": [[0, None, 0.0, [[ID, peer, peer]]]],
        "nearest pair not an array": [[0, None, 0.0, [ID + peer]]],
    }
    for _name, results in bad.items():
        with pytest.raises(DHTProtocolError):
            Message.decode(wire(6, None, results, []))
    bad_addresses = {
        "address not bytes": [[peer, ["/ip4/127.0.0.1"]]],
        "address too long": [[peer, [b"\x04" * 2000]]],
        "too many addresses": [[peer, [addr] * 9]],
        "addresses not an array": [[peer, addr]],
        "entry too long": [[peer, [addr], 1]],
        "peer not bytes": [[[peer], [addr]]],
    }
    for _name, addresses in bad_addresses.items():
        with pytest.raises(DHTProtocolError):
            Message.decode(wire(6, None, [], addresses))
    assert Message.decode(wire(6, None, [], [[peer, [addr, addr]]])).addresses == ((PEER, (addr, addr)),)
