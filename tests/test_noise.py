"""The Noise core, bytes in and bytes out: two cores joined in memory, then malformed and forged input."""

import ast
import hashlib
import inspect

import pytest

from plexus.p2p.identity import PrivateKey
from plexus.p2p.protocols import noise, pb
from plexus.p2p.protocols.errors import LocalProtocolError, RemoteProtocolError
from plexus.p2p.protocols.noise import NoiseError, NoiseHandshake, NoiseTransport, State

pytestmark = pytest.mark.timeout(30)

SUITES = pytest.mark.parametrize(
    "suite", [noise.CHACHAPOLY_SUITE, noise.AESGCM_SUITE], ids=lambda s: s.protocol_id
)

ALICE = PrivateKey.from_seed(bytes([1]) * 32)
BOB = PrivateKey.from_seed(bytes([2]) * 32)
MALLORY = PrivateKey.from_seed(bytes([3]) * 32)


def make_pair(
    initiator_key=ALICE, responder_key=BOB, *, fixed=False, suite=noise.CHACHAPOLY_SUITE, **initiator_kwargs
):
    seeds = {}
    if fixed:
        seeds = dict(
            initiator=dict(static_key=bytes([11]) * 32, ephemeral_key=bytes([12]) * 32),
            responder=dict(static_key=bytes([21]) * 32, ephemeral_key=bytes([22]) * 32),
        )
    initiator_kwargs.update(seeds.get("initiator", {}))
    initiator = NoiseHandshake(initiator_key, initiator=True, suite=suite, **initiator_kwargs)
    responder = NoiseHandshake(responder_key, initiator=False, suite=suite, **seeds.get("responder", {}))
    return initiator, responder


def feed(core, data: bytes, one_byte_at_a_time: bool) -> None:
    if one_byte_at_a_time:
        for index in range(len(data)):
            core.receive_data(data[index : index + 1])
    else:
        core.receive_data(data)


def run_handshake(initiator, responder, one_byte_at_a_time=False) -> list[bytes]:
    """Shuttle bytes until both sides are complete; return the transcript, one entry per flight."""
    transcript = []
    sender, receiver = initiator, responder
    for _ in range(3):
        flight = sender.data_to_send()
        assert flight, f"{sender!r} had nothing to send"
        transcript.append(flight)
        feed(receiver, flight, one_byte_at_a_time)
        sender, receiver = receiver, sender
    assert initiator.complete and responder.complete
    assert initiator.data_to_send() == responder.data_to_send() == b""
    return transcript


def transports(**kwargs) -> tuple[NoiseTransport, NoiseTransport]:
    initiator, responder = make_pair(**kwargs)
    run_handshake(initiator, responder)
    return initiator.to_transport(), responder.to_transport()


def seal(transport: NoiseTransport, *messages) -> bytes:
    out = bytearray(sum(len(message) + 18 for message in messages))
    offset = 0
    for message in messages:
        offset = transport.seal_into(message, out, offset)
    assert offset == len(out)
    return bytes(out)


def open_all(transport: NoiseTransport, data: bytes) -> bytes:
    out = bytearray(len(data))
    consumed, written = transport.open_into(memoryview(data), memoryview(out))
    assert consumed == len(data)
    return bytes(out[:written])


# --- the handshake


@SUITES
@pytest.mark.parametrize("one_byte_at_a_time", [False, True])
def test_handshake_authenticates_both_sides(one_byte_at_a_time, suite):
    initiator, responder = make_pair(expected_peer=BOB.peer_id, suite=suite)
    assert initiator.state is State.INITIATOR_EXPECT_MSG2 and responder.state is State.RESPONDER_EXPECT_MSG1
    transcript = run_handshake(initiator, responder, one_byte_at_a_time)
    assert [len(flight) for flight in transcript][0] == 2 + 32  # msg1: e and an empty payload
    assert initiator.remote_peer_id == BOB.peer_id and initiator.remote_public_key == BOB.public_key
    assert responder.remote_peer_id == ALICE.peer_id and responder.remote_public_key == ALICE.public_key
    a, b = initiator.to_transport(), responder.to_transport()
    assert a.handshake_hash == b.handshake_hash and len(a.handshake_hash) == 32
    assert a.pending == b.pending == b""
    assert a.suite is b.suite is suite
    assert open_all(b, seal(a, b"ping")) == b"ping" and open_all(a, seal(b, b"pong")) == b"pong"


def test_sides_with_different_cipher_suites_fail_cleanly():
    initiator, _ = make_pair(suite=noise.AESGCM_SUITE)
    responder = NoiseHandshake(BOB, initiator=False, suite=noise.CHACHAPOLY_SUITE)
    responder.receive_data(initiator.data_to_send())  # msg1 is in clear: only its hash differs
    with pytest.raises(NoiseError, match="could not decrypt the peer's static key"):
        initiator.receive_data(responder.data_to_send())


def test_initiator_completes_when_msg3_is_queued():
    initiator, responder = make_pair()
    responder.receive_data(initiator.data_to_send())
    assert not responder.complete
    initiator.receive_data(responder.data_to_send())
    assert initiator.complete and not responder.complete
    transport = initiator.to_transport()  # allowed before msg3 is drained; msg3 must still be sent first
    responder.receive_data(initiator.data_to_send())
    assert responder.complete
    assert open_all(responder.to_transport(), seal(transport, b"early")) == b"early"


def test_bytes_after_the_last_handshake_frame_become_pending():
    initiator, responder = make_pair()
    responder.receive_data(initiator.data_to_send())
    initiator.receive_data(responder.data_to_send())
    sender = initiator.to_transport()
    early = seal(sender, b"first", b"second")
    msg3 = initiator.data_to_send()
    responder.receive_data(msg3 + early[:10])
    responder.receive_data(early[10:])
    receiver = responder.to_transport()
    assert receiver.pending == early
    assert open_all(receiver, receiver.pending) == b"firstsecond"


@SUITES
def test_deterministic_transcript_with_fixed_keys(suite):
    runs = []
    for _ in range(2):
        initiator, responder = make_pair(fixed=True, suite=suite)
        transcript = run_handshake(initiator, responder)
        a = initiator.to_transport()
        runs.append((transcript, seal(a, b"hello" * 100), a.handshake_hash))
    assert runs[0] == runs[1]
    # A change to the key schedule changes these bytes: pin the digest of the whole transcript.
    digest = hashlib.sha256(b"".join(runs[0][0]) + runs[0][1]).hexdigest()
    assert digest == PINNED_TRANSCRIPT_SHA256[suite.protocol_id]


# Recorded with the fixed keys above. For each suite the same three messages, the first transport frame
# and the handshake hash came out byte-identical from an independent implementation (PyPI
# `noiseprotocol` 0.3.1, driven by hand with the same X25519 keys and these libp2p payloads), and it
# decrypted our frames.
PINNED_TRANSCRIPT_SHA256 = {
    "/noise": "98a177f3afdac85023b0e703df7c91124565da0162e8cfaeefe899f49324bead",
    "/plexus/noise-aesgcm/1.0.0": "bfd5779ea54e5d38c8d3daeeff75c34ed8aeb008b17913fffca648e8efb0daf1",
}


def test_bad_key_seeds_are_refused():
    with pytest.raises(ValueError, match="32-byte"):
        NoiseHandshake(ALICE, initiator=True, ephemeral_key=b"short")


def test_core_imports_no_io_clock_or_randomness():
    source = inspect.getsource(noise)
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert "hashlib" in imported  # the walk sees the imports at all
    assert not imported & {"asyncio", "socket", "time", "random", "os", "secrets", "threading"}
    assert "asyncio" not in source


# --- who the peer is


def test_expected_peer_mismatch_names_both_ids():
    initiator, responder = make_pair(expected_peer=MALLORY.peer_id)
    responder.receive_data(initiator.data_to_send())
    with pytest.raises(NoiseError, match="peer id mismatch") as caught:
        initiator.receive_data(responder.data_to_send())
    assert str(MALLORY.peer_id) in str(caught.value) and str(BOB.peer_id) in str(caught.value)
    assert initiator.state is State.ERROR and initiator.data_to_send() == b""  # msg3 never leaves
    assert initiator.remote_peer_id is None


def test_responder_checks_expected_peer_too():
    initiator = NoiseHandshake(ALICE, initiator=True)
    responder = NoiseHandshake(BOB, initiator=False, expected_peer=MALLORY.peer_id)
    responder.receive_data(initiator.data_to_send())
    initiator.receive_data(responder.data_to_send())
    with pytest.raises(NoiseError, match="peer id mismatch"):
        responder.receive_data(initiator.data_to_send())


class Forger(NoiseHandshake):
    """A responder whose handshake payload is built by `forge(static_public) -> bytes`."""

    def __init__(self, forge, **kwargs):
        self.forge = forge
        super().__init__(BOB, initiator=False, **kwargs)

    def _payload(self) -> bytes:
        return self.forge(self._static_public)


def payload(identity: PrivateKey, signer: PrivateKey, static_public: bytes, flip=False) -> bytes:
    signature = bytearray(signer.sign(noise.STATIC_KEY_PREFIX + static_public))
    if flip:
        signature[5] ^= 1
    fields = {"identity_key": identity.public_key.to_protobuf(), "identity_sig": bytes(signature)}
    return pb.encode(noise.PAYLOAD_SCHEMA, fields)


BAD_KEY = {"identity_key": b"\x08\x01\x12\x03abc", "identity_sig": b"?"}  # an Ed25519 "key" of 3 bytes


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda s: payload(BOB, BOB, s, flip=True), "signature .* is invalid"),
        (lambda s: payload(BOB, MALLORY, s), "signature .* is invalid"),  # claims Bob, signed by Mallory
        (lambda s: payload(MALLORY, BOB, s), "signature .* is invalid"),  # identity_key does not match signer
        (lambda s: payload(BOB, BOB, bytes(32)), "signature .* is invalid"),  # signed some other static key
        (lambda s: pb.encode(noise.PAYLOAD_SCHEMA, {"identity_key": BOB.public_key.to_protobuf()}), "lacks"),
        (lambda s: b"\xff\xff\xff", "malformed handshake payload"),
        (lambda s: pb.encode(noise.PAYLOAD_SCHEMA, BAD_KEY), "unusable identity key"),
    ],
)
def test_forged_or_malformed_payload_is_refused(forge, reason):
    initiator = NoiseHandshake(ALICE, initiator=True)
    responder = Forger(forge)
    responder.receive_data(initiator.data_to_send())
    with pytest.raises(NoiseError, match=reason):
        initiator.receive_data(responder.data_to_send())
    assert initiator.state is State.ERROR and initiator.remote_peer_id is None


def test_payload_extensions_are_ignored():
    def with_extensions(static_public):
        # field 4 (extensions), length-delimited, holding a webtransport_certhashes entry
        return payload(BOB, BOB, static_public) + b"\x22\x04\x0a\x02\x12\x00"

    initiator = NoiseHandshake(ALICE, initiator=True)
    run_handshake(initiator, Forger(with_extensions))
    assert initiator.remote_peer_id == BOB.peer_id


# --- malformed handshake frames


@pytest.mark.parametrize("index", [0, 40, 100, -1])
def test_tampered_msg2_is_refused(index):
    initiator, responder = make_pair()
    responder.receive_data(initiator.data_to_send())
    msg2 = bytearray(responder.data_to_send())
    msg2[2 + index if index >= 0 else index] ^= 0x80
    with pytest.raises(NoiseError):
        initiator.receive_data(bytes(msg2))


def test_tampered_msg3_is_refused():
    initiator, responder = make_pair()
    responder.receive_data(initiator.data_to_send())
    initiator.receive_data(responder.data_to_send())
    msg3 = bytearray(initiator.data_to_send())
    msg3[-3] ^= 1
    with pytest.raises(NoiseError, match="could not decrypt"):
        responder.receive_data(bytes(msg3))
    assert not responder.complete


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"\x00\x05hello", "msg1 must hold"),
        (b"\x00\x20" + bytes(32), "low-order"),  # the all-zero X25519 point
    ],
)
def test_bad_msg1_is_refused(frame, reason):
    responder = NoiseHandshake(BOB, initiator=False)
    with pytest.raises(NoiseError, match=reason):
        responder.receive_data(frame)
    assert responder.data_to_send() == b""


def test_short_msg2_is_refused():
    initiator = NoiseHandshake(ALICE, initiator=True)
    with pytest.raises(NoiseError, match="msg2 must be at least 96"):
        initiator.receive_data(b"\x00\x40" + bytes(64))


def test_errors_are_terminal_and_fail_fast():
    responder = NoiseHandshake(BOB, initiator=False)
    with pytest.raises(NoiseError):
        responder.receive_data(b"\x00\x01x")
    with pytest.raises(NoiseError, match="already failed"):
        responder.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        responder.to_transport()
    assert isinstance(NoiseError("x"), RemoteProtocolError)


def test_to_transport_needs_a_complete_handshake_once():
    initiator, responder = make_pair()
    with pytest.raises(LocalProtocolError):
        initiator.to_transport()
    run_handshake(initiator, responder)
    initiator.to_transport()
    with pytest.raises(LocalProtocolError):
        initiator.to_transport()
    with pytest.raises(LocalProtocolError):
        initiator.receive_data(b"x")


def test_handshake_buffer_is_bounded_while_waiting_for_a_max_frame():
    responder = NoiseHandshake(BOB, initiator=False)
    ephemeral = NoiseHandshake(ALICE, initiator=True).data_to_send()[2:]
    responder.receive_data(b"\xff\xff" + ephemeral + bytes(65502))  # one byte short of a 65535-byte frame
    assert len(responder._buffer) == 65536 and not responder.complete
    responder.receive_data(bytes(1))  # now complete: a valid (oversized-payload) msg1 with an ignored payload
    assert len(responder._buffer) == 0 and responder.state is State.RESPONDER_EXPECT_MSG3


# --- transport


@SUITES
@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 1000, 65536 - 18, NoiseTransport.MAX_PLAINTEXT])
def test_transport_round_trip(size, suite):
    a, b = transports(suite=suite)
    message = bytes(range(256)) * (size // 256) + bytes(size % 256)
    frame = seal(a, message)
    assert len(frame) == size + 18 and frame[:2] == (size + 16).to_bytes(2, "big")
    assert open_all(b, frame) == message
    assert open_all(a, seal(b, message[::-1])) == message[::-1]


def test_transport_refuses_oversized_plaintext():
    a, _ = transports()
    with pytest.raises(LocalProtocolError, match="split it"):
        a.seal_into(bytes(NoiseTransport.MAX_PLAINTEXT + 1), bytearray(70000), 0)


def test_several_frames_per_open_into_call_and_split_frames():
    a, b = transports()
    messages = [bytes([i]) * size for i, size in enumerate([0, 5, 65519, 300, 17, 40000])]
    stream = seal(a, *messages)
    assert open_all(b, stream[: len(stream)]) == b"".join(messages)

    # The same traffic again, cut at arbitrary places: consumed bytes never include a partial frame.
    stream = seal(a, *messages)
    received, buffered = bytearray(), b""
    for cut in range(0, len(stream), 7919):
        buffered += stream[cut : cut + 7919]
        out = bytearray(len(buffered))
        consumed, written = b.open_into(memoryview(buffered), memoryview(out))
        received += out[:written]
        buffered = buffered[consumed:]
    assert buffered == b"" and bytes(received) == b"".join(messages)


def test_open_into_leaves_a_partial_header_and_frame_unconsumed():
    a, b = transports()
    frame = seal(a, b"abc")
    out = bytearray(64)
    assert b.open_into(memoryview(frame[:1]), memoryview(out)) == (0, 0)
    assert b.open_into(memoryview(frame[:-1]), memoryview(out)) == (0, 0)
    assert b.open_into(memoryview(frame), memoryview(out)) == (len(frame), 3) and out[:3] == b"abc"


def test_open_into_stops_when_out_is_full():
    a, b = transports()
    stream = seal(a, b"x" * 100, b"y" * 100)
    out = bytearray(150)
    consumed, written = b.open_into(memoryview(stream), memoryview(out))
    assert (consumed, written) == (118, 100)
    assert open_all(b, stream[consumed:]) == b"y" * 100
    with pytest.raises(LocalProtocolError, match="bytes of room in out"):
        b.open_into(memoryview(seal(a, b"z" * 100)), memoryview(bytearray(10)))


@SUITES
@pytest.mark.parametrize("position", [0, 2, 10, -1])
def test_tampered_ciphertext_is_refused(position, suite):
    a, b = transports(suite=suite)
    frame = bytearray(seal(a, b"attack at dawn"))
    if position == 0:
        frame[1] ^= 1  # the length: the frame now ends one byte early or late
        frame += b"\x00"
    else:
        frame[position] ^= 1
    with pytest.raises(NoiseError):
        open_all(b, bytes(frame))
    with pytest.raises(NoiseError, match="already failed"):
        open_all(b, seal(a, b"anything"))


def test_replayed_or_reordered_frames_are_refused():
    a, b = transports()
    first, second = seal(a, b"one"), seal(a, b"two")
    with pytest.raises(NoiseError, match="frame 0 failed authentication"):
        open_all(b, second + first)
    a, b = transports()
    frame = seal(a, b"one")
    open_all(b, frame)
    with pytest.raises(NoiseError):
        open_all(b, frame)


def test_frame_shorter_than_a_tag_is_refused():
    _, b = transports()
    with pytest.raises(NoiseError, match="shorter than its 16-byte tag"):
        b.open_into(memoryview(b"\x00\x0f" + bytes(15)), memoryview(bytearray(17)))


def test_nonce_exhaustion():
    a, b = transports()
    a._send_nonce = noise.MAX_NONCE
    with pytest.raises(LocalProtocolError, match="nonce exhausted"):
        a.seal_into(b"x", bytearray(19), 0)
    b._receive_nonce = noise.MAX_NONCE
    with pytest.raises(NoiseError, match="nonce exhausted"):
        b.open_into(memoryview(b"\x00\x10" + bytes(16)), memoryview(bytearray(18)))


def test_nonce_is_four_zero_bytes_then_the_counter_little_endian_for_chachapoly_big_endian_for_aesgcm():
    assert noise.CHACHAPOLY_SUITE.nonce.pack(0x0102030405060708) == bytes(4) + bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert noise.AESGCM_SUITE.nonce.pack(0x0102030405060708) == bytes(4) + bytes([1, 2, 3, 4, 5, 6, 7, 8])


def test_seal_into_writes_at_an_offset_of_a_shared_buffer():
    a, b = transports()
    out = bytearray(b"\xaa" * 100)
    end = a.seal_into(memoryview(b"hello"), memoryview(out), 10)
    assert end == 10 + 2 + 5 + 16 and out[:10] == b"\xaa" * 10 and out[end:] == b"\xaa" * (100 - end)
    assert open_all(b, bytes(out[10:end])) == b"hello"
