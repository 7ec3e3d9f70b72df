"""Fuzzing the Noise core. Invariant (after h11's fuzz harness): whatever bytes arrive, in whatever
chunks, the core either proceeds or raises NoiseError (a RemoteProtocolError), never anything else;
after an error it stays failed; and during the handshake it never holds more than one maximum frame
plus its 2-byte length."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from plexus.p2p.identity import PrivateKey
from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.protocols.noise import (
    AESGCM_SUITE,
    CHACHAPOLY_SUITE,
    MAX_MESSAGE,
    CipherSuite,
    NoiseError,
    NoiseHandshake,
    NoiseTransport,
    State,
)

pytestmark = pytest.mark.timeout(60)
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALICE, BOB = PrivateKey.from_seed(bytes([1]) * 32), PrivateKey.from_seed(bytes([2]) * 32)
KEYS = {
    True: (ALICE, dict(static_key=bytes([11]) * 32, ephemeral_key=bytes([12]) * 32)),
    False: (BOB, dict(static_key=bytes([21]) * 32, ephemeral_key=bytes([22]) * 32)),
}


def fixed_core(initiator: bool, suite: CipherSuite = CHACHAPOLY_SUITE) -> NoiseHandshake:
    key, seeds = KEYS[initiator]
    return NoiseHandshake(key, initiator=initiator, suite=suite, **seeds)


def real_frames() -> list[bytes]:
    """msg1, msg2, msg3 of a real handshake with the fixed keys: a fresh fixed core accepts them."""
    initiator, responder = fixed_core(True), fixed_core(False)
    msg1 = initiator.data_to_send()
    responder.receive_data(msg1)
    msg2 = responder.data_to_send()
    initiator.receive_data(msg2)
    return [msg1, msg2, initiator.data_to_send()]


FRAMES = real_frames()


def feed_checked(core: NoiseHandshake, chunks) -> None:
    """Feed chunks, checking the invariant after each one."""
    for chunk in chunks:
        try:
            core.receive_data(chunk)
        except NoiseError as error:
            event(f"refused: {error.reason.split(':')[0][:40]}")
            assert isinstance(error, RemoteProtocolError) and str(error)
            assert core.state is State.ERROR and core.data_to_send() == b""
            with pytest.raises(NoiseError, match="already failed"):
                core.receive_data(b"\x00")
            return
        if core.state is not State.TRANSPORT:
            assert len(core._buffer) <= 2 + MAX_MESSAGE
    event(f"ended in {core.state.name}")
    if core.complete:
        transport = core.to_transport()
        assert transport.remote_peer_id is not None


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def flip(frame: bytes, index: int, mask: int) -> bytes:
    index %= len(frame)
    return frame[:index] + bytes([frame[index] ^ mask]) + frame[index + 1 :]


# A piece of input: a real frame as is, truncated, mutated, or a header announcing a frame we
# cut short or fill with garbage, or plain random bytes.
real_frame = st.sampled_from(FRAMES)
piece = st.one_of(
    real_frame,
    st.tuples(real_frame, st.integers(0, 400)).map(lambda t: t[0][: t[1]]),
    st.tuples(real_frame, st.integers(0, 400), st.integers(1, 255)).map(lambda t: flip(*t)),
    st.integers(0, MAX_MESSAGE).map(lambda n: n.to_bytes(2, "big") + bytes([7]) * min(n, 70000)),
    st.integers(0, 2 * MAX_MESSAGE).map(lambda n: b"\xff\xff" + bytes([9]) * n),
    st.binary(max_size=300),
)


@FUZZ
@given(
    initiator=st.booleans(),
    length=st.none() | st.just("exact") | st.integers(0, 400),
    data=st.binary(max_size=2000),
    cuts=st.lists(st.integers(0, 2000), max_size=8),
)
def test_random_bytes(initiator, length, data, cuts):
    """Random bytes; often after a plausible length header, so whole garbage frames get parsed."""
    if length == "exact":
        length = len(data)
    header = b"" if length is None else length.to_bytes(2, "big")
    feed_checked(fixed_core(initiator), chunked(header + data, cuts))


@FUZZ
@given(
    initiator=st.booleans(),
    pieces=st.lists(piece, min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 200_000), max_size=6),
)
def test_truncated_reordered_duplicated_oversized_frames(initiator, pieces, cuts):
    feed_checked(fixed_core(initiator), chunked(b"".join(pieces), cuts))


@FUZZ
@given(
    order=st.permutations(range(3)),
    repeat=st.sampled_from([0, 1, 2]),
    cuts=st.lists(st.integers(0, 500), max_size=4),
)
def test_real_frames_in_any_order_with_a_duplicate(order, repeat, cuts):
    frames = [FRAMES[index] for index in order]
    frames.insert(repeat, frames[repeat])
    for initiator in (True, False):
        feed_checked(fixed_core(initiator), chunked(b"".join(frames), cuts))


@FUZZ
@given(extra=st.binary(max_size=500), cuts=st.lists(st.integers(0, 1000), max_size=5))
def test_the_proper_sequence_always_completes_and_keeps_the_rest(extra, cuts):
    """The right frames, cut anywhere, complete the handshake; trailing bytes are kept verbatim."""
    responder = fixed_core(False)
    for chunk in chunked(FRAMES[0] + FRAMES[2] + extra, cuts):
        responder.receive_data(chunk)
    assert responder.complete and responder.data_to_send() == FRAMES[1]
    assert responder.to_transport().pending == extra


def transport_pair(suite: CipherSuite) -> tuple[NoiseTransport, NoiseTransport]:
    initiator, responder = fixed_core(True, suite), fixed_core(False, suite)
    responder.receive_data(initiator.data_to_send())
    initiator.receive_data(responder.data_to_send())
    responder.receive_data(initiator.data_to_send())
    return initiator.to_transport(), responder.to_transport()


suites = st.sampled_from([CHACHAPOLY_SUITE, AESGCM_SUITE])


@FUZZ
@given(
    data=st.binary(max_size=3000), valid_prefix=st.lists(st.binary(max_size=200), max_size=3), suite=suites
)
def test_transport_open_into_random_bytes(data, valid_prefix, suite):
    sender, receiver = transport_pair(suite)
    stream = bytearray(sum(len(m) + 18 for m in valid_prefix))
    offset = 0
    for message in valid_prefix:
        offset = sender.seal_into(message, stream, offset)
    stream += data
    out = bytearray(len(stream))
    try:
        consumed, written = receiver.open_into(memoryview(stream), memoryview(out))
    except NoiseError:
        with pytest.raises(NoiseError):
            receiver.open_into(memoryview(stream), memoryview(out))
        return
    assert 0 <= written <= consumed <= len(stream) and len(stream) - consumed < 2 + MAX_MESSAGE
    assert out[: sum(map(len, valid_prefix))] == b"".join(valid_prefix)


@FUZZ
@given(
    messages=st.lists(st.binary(max_size=3000), max_size=6),
    cuts=st.lists(st.integers(0, 20000), max_size=8),
    suite=suites,
)
def test_transport_reassembles_any_split(messages, cuts, suite):
    sender, receiver = transport_pair(suite)
    stream = bytearray(sum(len(m) + 18 for m in messages))
    offset = 0
    for message in messages:
        offset = sender.seal_into(message, stream, offset)
    received, buffered = bytearray(), b""
    for chunk in chunked(bytes(stream), cuts):
        buffered += chunk
        out = bytearray(len(buffered))
        consumed, written = receiver.open_into(memoryview(buffered), memoryview(out))
        received += out[:written]
        buffered = buffered[consumed:]
    assert buffered == b"" and bytes(received) == b"".join(messages)
