"""The circuit relay v2 core without I/O: codecs, vouchers, and the relay's bookkeeping on virtual time."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.p2p.identity import PrivateKey
from plexus.p2p.protocols import relay as core
from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.protocols.relay import (
    HopMessage,
    HopType,
    Limit,
    RelayLimits,
    RelayResources,
    Reservation,
    Status,
    StopMessage,
    StopType,
)

A, B, C = (PrivateKey.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3))


def test_hop_and_stop_messages_roundtrip():
    messages = [
        HopMessage(HopType.RESERVE),
        HopMessage(HopType.CONNECT, peer=A, peer_addrs=(b"\x04\x7f\x00\x00\x01",)),
        HopMessage(
            HopType.STATUS,
            status=Status.OK,
            reservation=Reservation(1234, (b"addr",), b"v"),
            limit=Limit(120, 1 << 20),
        ),
        HopMessage(HopType.STATUS, status=Status.NO_RESERVATION),
    ]
    for message in messages:
        assert core.decode_hop(core.encode_hop(message)) == message
    for message in [
        StopMessage(StopType.CONNECT, peer=B, limit=Limit(0, 5)),
        StopMessage(StopType.STATUS, status=Status.CONNECTION_FAILED),
    ]:
        assert core.decode_stop(core.encode_stop(message)) == message


def test_wire_bytes_match_the_spec_field_numbers():
    # HopMessage{type=RESERVE}: field 1 varint 0.
    assert core.encode_hop(HopMessage(HopType.RESERVE)) == b"\x08\x00"
    # StopMessage{type=STATUS, status=OK}: field 1 = 1, field 4 = 100.
    assert core.encode_stop(StopMessage(StopType.STATUS, status=Status.OK)) == b"\x08\x01\x20\x64"
    # An unlimited Limit is encoded empty (0 means "no limit" in the spec).
    assert core.decode_hop(b"\x08\x02\x22\x00\x28\x64").limit == Limit(0, 0)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "type"),
        (b"\x08\x09", "type"),
        (b"\x08\x01", "no target"),
        (b"\x08\x02", "no status"),
        (b"\x08\x02\x28\x07", "unknown status"),
        (b"\x08\x02\x28\x64\x1a\x00", "expiration"),
        (b"\x08\x00\x12\x02\x0a\x00", "peer id"),
        (b"\x0a", "malformed"),
        (b"\x08" + b"\x80" * 12, "malformed"),
        (b"\x00" * 5000, "exceeds"),
    ],
)
def test_malformed_hop_messages_raise_remote_errors(data, reason):
    with pytest.raises(RemoteProtocolError, match=reason):
        core.decode_hop(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_remote_protocol_error(data):
    for decode in (core.decode_hop, core.decode_stop, core.open_voucher):
        try:
            decode(data)
        except RemoteProtocolError:
            pass


def test_voucher_checks_signer_and_type():
    relay_key = PrivateKey.from_seed(b"\x09" * 32)
    voucher = core.open_voucher(core.make_voucher(relay_key, A, 777))
    assert (voucher.relay, voucher.peer, voucher.expiration) == (relay_key.peer_id, A, 777)
    # An envelope signed by someone who is not the relay it names.
    forged = core.make_voucher(PrivateKey.from_seed(b"\x0a" * 32), A, 777)
    assert core.open_voucher(forged).relay != relay_key.peer_id


def test_reservations_expire_renew_and_are_bounded():
    resources = RelayResources(RelayLimits(reservation_ttl=10, max_reservations=2, max_reservations_per_ip=1))
    assert resources.reserve(A, "1.1.1.1", now=0) == (Status.OK, 10)
    assert resources.reserve(B, "1.1.1.1", now=0)[0] is Status.RESERVATION_REFUSED  # same IP
    assert resources.reserve(B, "2.2.2.2", now=0)[0] is Status.OK
    assert resources.reserve(C, "3.3.3.3", now=0)[0] is Status.RESERVATION_REFUSED  # full
    assert resources.reserve(A, "1.1.1.1", now=5) == (Status.OK, 15)  # renewal
    assert resources.reserve(C, "3.3.3.3", now=12)[0] is Status.OK  # B expired at 10
    assert not resources.has_reservation(B, now=12)


def test_circuits_are_bounded_per_peer_and_in_total():
    resources = RelayResources(RelayLimits(max_circuits=2, max_circuits_per_peer=1))
    assert resources.open_circuit(B, A, now=0) is Status.NO_RESERVATION
    resources.reserve(A, None, now=0)
    resources.reserve(C, None, now=0)
    assert resources.open_circuit(A, A, now=0) is Status.PERMISSION_DENIED
    assert resources.open_circuit(B, A, now=0) is Status.OK
    assert resources.open_circuit(C, A, now=0) is Status.RESOURCE_LIMIT_EXCEEDED  # A has its one
    assert resources.open_circuit(B, C, now=0) is Status.RESOURCE_LIMIT_EXCEEDED  # B has its one
    resources.close_circuit(B, A)
    assert resources.open_circuit(B, C, now=0) is Status.OK
    assert resources.open_circuits == 1 and resources.circuits == {B: 1, C: 1}
