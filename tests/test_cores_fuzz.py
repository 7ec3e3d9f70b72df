"""Fuzzing the multistream-select and yamux cores.

Invariant (after h11's fuzz harness): whatever bytes arrive, cut anywhere, a core either parses them
or raises RemoteProtocolError; nothing else escapes, and its internal buffers stay within their
bounds. Two honest yamux cores driven by random operations never raise at all, and deliver every
byte of every stream that was not reset, in order.
"""

import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from plexus.p2p.protocols.errors import RemoteProtocolError
from plexus.p2p.protocols.multistream import (
    HEADER,
    MAX_MESSAGE,
    MultistreamDialer,
    MultistreamListener,
    encode_message,
)
from plexus.p2p.protocols.yamux import (
    HEADER_SIZE,
    DataReceived,
    StreamEnded,
    StreamOpened,
    StreamReset,
    YamuxSession,
    encode_header,
)

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points + [len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


# -------------------------------------------------------------------------- multistream

ms_messages = st.one_of(
    st.just(encode_message(HEADER)),
    st.just(encode_message("na")),
    st.just(encode_message("ls")),
    st.sampled_from(["/a", "/b/1.0.0", "/noise", "/yamux/1.0.0"]).map(encode_message),
    st.text(max_size=40).map(lambda t: encode_message(t) if len(t.encode()) < MAX_MESSAGE else b""),
    st.binary(max_size=40),
    st.integers(0, 1 << 20).map(lambda n: bytes([0x80 | (n & 0x7F), n >> 7 & 0x7F]) + b"x" * 5),
)


@pytest.mark.timeout(60)
@FUZZ
@given(
    role=st.sampled_from(["dialer", "listener"]),
    messages=st.lists(ms_messages, max_size=12),
    mutate=st.one_of(st.none(), st.tuples(st.integers(0, 10_000), st.integers(0, 255))),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
)
def test_multistream_never_raises_anything_else(role, messages, mutate, cuts):
    data = bytearray(b"".join(messages))
    if mutate and data:
        data[mutate[0] % len(data)] = mutate[1]
    if role == "dialer":
        core = MultistreamDialer(["/a", "/noise"])
    else:
        core = MultistreamListener(["/a", "/yamux/1.0.0"])
    sent = len(core.data_to_send())
    for piece in split(bytes(data), cuts):
        try:
            core.receive_data(piece)
        except RemoteProtocolError:
            return
        if core.selected is not None:
            assert core.selected in ("/a", "/noise", "/yamux/1.0.0")
            return
        assert core.buffered_bytes() <= MAX_MESSAGE + 2
        sent += len(core.data_to_send())
        assert sent <= 64 * (MAX_MESSAGE + 4)  # bounded replies (na per proposal, ls lists)


@pytest.mark.timeout(60)
@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_multistream_random_bytes(data, cuts):
    for core in (MultistreamDialer(["/a"]), MultistreamListener(["/a"])):
        for piece in split(HEADER.encode() + data if data[:1] == b"h" else data, cuts):
            try:
                core.receive_data(piece)
            except RemoteProtocolError:
                break
            if core.selected is not None:
                break


# -------------------------------------------------------------------------------- yamux

lengths = st.one_of(
    st.integers(0, 64),
    st.sampled_from([256 << 10, (1 << 20), (1 << 20) + 1, 16 << 20, (1 << 32) - 1]),
)
frames = st.builds(
    lambda version, type_, flags, sid, length, payload: (
        bytes([version]) + encode_header(type_, flags, sid, length)[1:] + payload
    ),
    version=st.sampled_from([0, 0, 0, 0, 1]),
    type_=st.integers(0, 5),
    flags=st.integers(0, 15),
    sid=st.sampled_from([0, 1, 2, 3, 4, 5, 7, 1 << 31]),
    length=lengths,
    payload=st.one_of(st.just(b""), st.binary(max_size=80)),  # truncated, exact or oversized
)


def check_yamux_bounds(session: YamuxSession, fed: int) -> None:
    assert len(session._hdr) < HEADER_SIZE
    assert len(session.stream_ids) <= session.max_streams
    # every incoming header answers with at most one header, plus our GO_AWAY on error
    assert session.pending_bytes() <= HEADER_SIZE * (fed // HEADER_SIZE + 2)


@pytest.mark.timeout(60)
@FUZZ
@given(
    is_client=st.booleans(),
    items=st.lists(frames, max_size=20),
    repeat=st.lists(st.integers(0, 19), max_size=4),
    cuts=st.lists(st.integers(0, 20_000), max_size=10),
    consume=st.booleans(),
)
def test_yamux_frames_never_raise_anything_else(is_client, items, repeat, cuts, consume):
    items = items + [items[i % len(items)] for i in repeat] if items else items  # duplicates, reordered
    session = YamuxSession(is_client=is_client, max_streams=3)
    fed = 0
    for piece in split(b"".join(items), cuts):
        try:
            events = session.receive_data(memoryview(piece))
        except RemoteProtocolError:
            return
        fed += len(piece)
        for received in events:
            if consume and isinstance(received, DataReceived):
                session.consumed(received.stream_id, len(received.data))
        check_yamux_bounds(session, fed)


@pytest.mark.timeout(60)
@FUZZ
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=6))
def test_yamux_random_bytes(data, cuts):
    session = YamuxSession(is_client=False)
    fed = 0
    for piece in split(data, cuts):
        try:
            session.receive_data(piece)
        except RemoteProtocolError:
            return
        fed += len(piece)
        check_yamux_bounds(session, fed)


operations = st.lists(
    st.tuples(
        st.sampled_from(
            ["open", "send", "send", "send", "end", "reset", "ping", "go_away", "deliver", "deliver"]
        ),
        st.booleans(),  # which side
        st.integers(0, 1 << 20),  # stream choice / size
    ),
    max_size=40,
)


@pytest.mark.timeout(60)
@FUZZ
@given(operations, st.lists(st.integers(1, 5000), min_size=1, max_size=5))
def test_two_honest_yamux_sessions_agree(ops, chunk_sizes):
    client, server = YamuxSession(is_client=True, max_streams=8), YamuxSession(is_client=False, max_streams=8)
    peer = {client: server, server: client}
    sent = {client: {}, server: {}}  # what each side sent per stream
    got = {client: {}, server: {}}  # what each side received per stream
    reset: set[int] = set()
    open_ids = {client: set(), server: set()}  # streams each side may still write to
    sizes = itertools.cycle(chunk_sizes)

    def deliver(src):
        dst = peer[src]
        data = b"".join(bytes(c) for c in src.data_to_send())
        offset = 0
        while offset < len(data):
            size = next(sizes)
            for received in dst.receive_data(data[offset : offset + size]):
                if isinstance(received, DataReceived):
                    got[dst].setdefault(received.stream_id, bytearray()).extend(received.data)
                    dst.consumed(received.stream_id, len(received.data), now=0.0)
                elif isinstance(received, StreamOpened):
                    open_ids[dst].add(received.stream_id)
                elif isinstance(received, StreamReset):
                    reset.add(received.stream_id)
                    open_ids[dst].discard(received.stream_id)
                elif isinstance(received, StreamEnded):
                    pass
            offset += size

    for side in (client, client, server):
        open_ids[side].add(side.open_stream())
    deliver(client), deliver(server)
    for name, which, arg in ops:
        side = client if which else server
        ids = sorted(i for i in open_ids[side] if i in side.stream_ids)
        if name == "open":
            going_away = side._remote_go_away or side._local_go_away
            if len(side.stream_ids) < side.max_streams and not going_away:
                open_ids[side].add(side.open_stream())
        elif name == "send" and ids:
            sid = ids[arg % len(ids)]
            payload = bytes([arg & 0xFF]) * (arg % 70_000)
            taken = side.send_data(sid, memoryview(payload), max_frame=16 << 10)
            sent[side].setdefault(sid, bytearray()).extend(payload[:taken])
        elif name == "end" and ids:
            sid = ids[arg % len(ids)]
            side.end_stream(sid)
            open_ids[side].discard(sid)
        elif name == "reset" and ids:
            sid = ids[arg % len(ids)]
            side.reset_stream(sid)
            reset.add(sid)
            open_ids[side].discard(sid)
        elif name == "ping":
            side.ping(arg & 0xFFFFFFFF)
        elif name == "go_away" and not side._local_go_away:
            side.go_away()
        elif name == "deliver":
            deliver(side)
    deliver(client), deliver(server), deliver(client)
    moved = sum(len(data) for side in sent for data in sent[side].values())
    event("bytes moved: " + ("none" if not moved else "< 64 KiB" if moved < 65536 else ">= 64 KiB"))
    for side in (client, server):
        for sid, data in sent[side].items():
            if sid not in reset:
                assert bytes(got[peer[side]].get(sid, b"")) == bytes(data)
