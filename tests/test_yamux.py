"""yamux core: exact frame bytes, and a client and a server joined in memory."""

import hashlib

import pytest

from plexus.p2p.protocols.errors import LocalProtocolError, RemoteProtocolError
from plexus.p2p.protocols.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    GO_AWAY_PROTOCOL_ERROR,
    SPEC_WINDOW,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    DataReceived,
    GoAwayReceived,
    PingReceived,
    PongReceived,
    StreamEnded,
    StreamOpened,
    StreamReset,
    WindowUpdated,
    YamuxSession,
    encode_header,
)

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
DELTA = MIB - SPEC_WINDOW  # what our SYN/ACK adds to the spec's 256 KiB


def wire(chunks) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


def feed(session, data: bytes, bytewise: bool = False, now=None) -> list:
    if not bytewise:
        return session.receive_data(data, now=now)
    events = []
    for i in range(len(data)):
        events += session.receive_data(memoryview(data)[i : i + 1], now=now)
    return events


def merge_data(events):
    """Join consecutive DataReceived of one stream (a frame fed in pieces yields one event per piece)."""
    out = []
    for event in events:
        if out and isinstance(event, DataReceived) and isinstance(out[-1], DataReceived):
            if out[-1].stream_id == event.stream_id:
                out[-1] = DataReceived(event.stream_id, bytes(out[-1].data) + bytes(event.data))
                continue
        out.append(event)
    return out


class Pair:
    """A client and a server session; `pump` moves bytes until both are quiet."""

    def __init__(self, **options):
        self.client = YamuxSession(is_client=True, **options)
        self.server = YamuxSession(is_client=False, **options)
        self.events = {self.client: [], self.server: []}
        self.received = {self.client: {}, self.server: {}}

    def pump(self, *, bytewise=False, consume=True, now=None, rounds=1000):
        for _ in range(rounds):
            moved = False
            for src, dst in ((self.client, self.server), (self.server, self.client)):
                data = wire(src.data_to_send())
                if not data:
                    continue
                moved = True
                events = feed(dst, data, bytewise, now)
                self.events[dst] += events
                for event in events:
                    if isinstance(event, DataReceived):
                        self.received[dst].setdefault(event.stream_id, bytearray()).extend(event.data)
                        if consume:
                            dst.consumed(event.stream_id, len(event.data), now=now)
            if not moved:
                return
        raise AssertionError("the sessions kept talking")

    def take(self, session):
        events, self.events[session] = self.events[session], []
        return merge_data(events)


# ------------------------------------------------------------------------------ exact bytes


def test_header_encoding_exact_bytes():
    syn = encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, DELTA)
    assert syn == bytes.fromhex("00 01 0001 00000001 000c0000")
    assert encode_header(TYPE_DATA, FLAG_FIN, 0xDEADBEEF, 5) == bytes.fromhex("00 00 0004 deadbeef 00000005")
    assert encode_header(TYPE_PING, FLAG_ACK, 0, 7) == bytes.fromhex("00 02 0002 00000000 00000007")
    assert encode_header(TYPE_GO_AWAY, 0, 0, 2) == bytes.fromhex("00 03 0000 00000000 00000002")


def test_open_stream_transcript():
    client = YamuxSession(is_client=True)
    server = YamuxSession(is_client=False)
    assert client.open_stream() == 1
    assert client.open_stream() == 3
    syn = wire(client.data_to_send())
    assert syn == encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, DELTA) + encode_header(
        TYPE_WINDOW_UPDATE, FLAG_SYN, 3, DELTA
    )
    events = server.receive_data(syn)
    assert events == [StreamOpened(1), WindowUpdated(1), StreamOpened(3), WindowUpdated(3)]
    assert server.send_window(1) == MIB
    ack = wire(server.data_to_send())
    assert ack == encode_header(TYPE_WINDOW_UPDATE, FLAG_ACK, 1, DELTA) + encode_header(
        TYPE_WINDOW_UPDATE, FLAG_ACK, 3, DELTA
    )
    assert client.send_window(1) == SPEC_WINDOW  # until the ACK arrives
    assert client.receive_data(ack) == [WindowUpdated(1), WindowUpdated(3)]
    assert client.send_window(1) == MIB
    assert YamuxSession(is_client=False).open_stream() == 2


def test_send_data_does_not_copy_and_splits_frames():
    client = YamuxSession(is_client=True)
    sid = client.open_stream()
    client.data_to_send()
    payload = bytearray(b"x" * 200_000)
    assert client.send_data(sid, memoryview(payload), max_frame=64 << 10) == 200_000
    chunks = client.data_to_send()
    assert [len(c) for c in chunks] == [12, 65536, 12, 65536, 12, 65536, 12, 3392]
    assert all(c.obj is payload for c in chunks[1::2])  # slices of the caller's buffer
    assert chunks[0] == encode_header(TYPE_DATA, 0, sid, 65536)
    assert client.pending_bytes() == 0
    assert client.send_data(sid, b"abc") == 3
    assert client.pending_bytes() == 15
    assert client.send_window(sid) == SPEC_WINDOW - 200_003  # no ACK yet: spec window


# ------------------------------------------------------------------------- in-memory pairs


@pytest.mark.parametrize("bytewise", [False, True])
def test_data_both_directions(bytewise):
    pair = Pair()
    c, s = pair.client, pair.server
    sid = c.open_stream()
    c.send_data(sid, memoryview(b"hello server"))
    pair.pump(bytewise=bytewise)
    assert pair.take(s) == [StreamOpened(sid), WindowUpdated(sid), DataReceived(sid, b"hello server")]
    s.send_data(sid, b"hello client")
    c.end_stream(sid)
    pair.pump(bytewise=bytewise)
    assert pair.take(c) == [WindowUpdated(sid), DataReceived(sid, b"hello client")]
    assert pair.take(s) == [StreamEnded(sid)]
    s.end_stream(sid)
    pair.pump(bytewise=bytewise)
    assert pair.take(c) == [StreamEnded(sid)]
    assert c.stream_ids == [] and s.stream_ids == []  # closed both ways: forgotten


def test_payload_is_a_view_of_the_input_not_a_copy():
    s = YamuxSession(is_client=False)
    batch = bytearray(encode_header(TYPE_DATA, FLAG_SYN, 1, 3) + b"abc")
    _, data = s.receive_data(memoryview(batch))
    assert isinstance(data, DataReceived) and data.data == b"abc"
    batch[-3:] = b"xyz"  # the driver must copy (or keep the batch) before it reuses the buffer
    assert data.data == b"xyz"


def test_data_frame_with_fin_gives_data_then_end():
    s = YamuxSession(is_client=False)
    frame = encode_header(TYPE_DATA, FLAG_SYN | FLAG_FIN, 1, 3) + b"abc"
    assert s.receive_data(frame[:14]) == [StreamOpened(1), DataReceived(1, b"ab")]
    assert s.receive_data(frame[14:]) == [DataReceived(1, b"c"), StreamEnded(1)]
    with pytest.raises(RemoteProtocolError, match="after the peer's FIN"):
        s.receive_data(encode_header(TYPE_DATA, 0, 1, 1) + b"z")


def test_window_exhaustion_and_resumption():
    pair = Pair()
    c, s = pair.client, pair.server
    sid = c.open_stream()
    pair.pump()
    pair.take(c)
    payload = memoryview(bytes(range(256)) * (3 * MIB // 256))
    sent = c.send_data(sid, payload)
    assert sent == MIB and c.send_window(sid) == 0
    assert c.send_data(sid, payload[sent:]) == 0
    pair.pump(consume=False)  # the application reads nothing: no window comes back
    assert c.send_window(sid) == 0
    assert not [e for e in pair.take(c) if isinstance(e, WindowUpdated)]
    s.consumed(sid, MIB // 2 - 1)
    assert s.data_to_send() == []  # under half the window: no update yet
    s.consumed(sid, 1)
    assert wire(s.data_to_send()) == encode_header(TYPE_WINDOW_UPDATE, 0, sid, MIB // 2)
    c.receive_data(encode_header(TYPE_WINDOW_UPDATE, 0, sid, MIB // 2))
    assert c.send_window(sid) == MIB // 2
    sent += c.send_data(sid, payload[sent:])
    s.consumed(sid, MIB // 2)
    pair.pump()
    while sent < len(payload):
        sent += c.send_data(sid, payload[sent:])
        pair.pump()
    assert bytes(pair.received[s][sid]) == bytes(payload)


def test_window_overrun_is_remote_error():
    s = YamuxSession(is_client=False)
    s.receive_data(encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0))
    s.data_to_send()
    s.receive_data(encode_header(TYPE_DATA, 0, 1, MIB) + b"\0" * 10)  # exactly the window: fine
    with pytest.raises(RemoteProtocolError, match="window"):
        s.receive_data(b"\0" * (MIB - 10) + encode_header(TYPE_DATA, 0, 1, 1))
    assert wire(s.data_to_send()) == encode_header(TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR)
    with pytest.raises(RemoteProtocolError):
        s.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        s.open_stream()


def test_eight_mib_through_one_stream_auto_tunes():
    pair = Pair()
    c, s = pair.client, pair.server
    sid = c.open_stream()
    pair.pump()
    payload = memoryview(hashlib.sha256(b"seed").digest() * (8 * MIB // 32))
    sent = 0
    updates = 0
    while sent < len(payload):
        n = c.send_data(sid, payload[sent:])
        assert n > 0
        sent += n
        pair.pump(now=0.0)  # the application reads everything at once: the window is the bottleneck
        updates += 1
    c.end_stream(sid)
    pair.pump(now=0.0)
    assert hashlib.sha256(pair.received[s][sid]).digest() == hashlib.sha256(payload).digest()
    assert s.receive_window(sid) == 16 * MIB
    assert updates < 12


def test_no_auto_tuning_without_time():
    pair = Pair()
    c, s = pair.client, pair.server
    sid = c.open_stream()
    pair.pump()
    payload = memoryview(bytes(4 * MIB))
    sent = 0
    while sent < len(payload):
        sent += c.send_data(sid, payload[sent:])
        pair.pump(now=None)
    assert len(pair.received[s][sid]) == 4 * MIB
    assert s.receive_window(sid) == MIB


@pytest.mark.parametrize("rtt, grows", [(None, False), (0.01, False), (10.0, True)])
def test_auto_tuning_follows_read_speed_against_rtt(rtt, grows):
    """The reader takes 1 s per 64 KiB: slow for a short round trip, fast for a 10 s one."""
    pair = Pair()
    c, s = pair.client, pair.server
    s.rtt = rtt
    sid = c.open_stream()
    pair.pump()
    now = 0.0
    for _ in range(4):
        c.send_data(sid, bytes(c.send_window(sid)))
        pair.pump(consume=False)
        unread = len(pair.received[s].pop(sid))
        while unread:
            now += 1.0
            step = min(unread, 64 << 10)
            s.consumed(sid, step, now=now)
            unread -= step
        pair.pump()
    assert (s.receive_window(sid) > MIB) == grows


def test_rtt_from_ping_drives_auto_tuning():
    pair = Pair()
    c, s = pair.client, pair.server
    s.ping(7, now=100.0)
    pair.pump(now=100.5)
    assert s.rtt == pytest.approx(0.5)
    assert pair.take(s) == [PongReceived(7)]
    assert pair.take(c) == [PingReceived(7)]


def test_ping_pong_transcript():
    c = YamuxSession(is_client=True)
    s = YamuxSession(is_client=False)
    c.ping(0x01020304)
    ping = wire(c.data_to_send())
    assert ping == bytes.fromhex("00 02 0001 00000000 01020304")
    assert s.receive_data(ping) == [PingReceived(0x01020304)]
    pong = wire(s.data_to_send())
    assert pong == bytes.fromhex("00 02 0002 00000000 01020304")
    assert c.receive_data(pong) == [PongReceived(0x01020304)]
    with pytest.raises(LocalProtocolError):
        c.ping(1 << 32)


def test_rst_forgets_stream_and_drops_late_data():
    pair = Pair()
    c, s = pair.client, pair.server
    sid = c.open_stream()
    pair.pump()
    pair.take(s), pair.take(c)
    c.send_data(sid, b"in flight")  # crosses the server's reset
    s.reset_stream(sid)
    assert s.stream_ids == []
    pair.pump()
    assert pair.take(c) == [StreamReset(sid)]
    assert pair.take(s) == []  # the late data was dropped silently
    assert c.stream_ids == [] and s.stream_ids == []
    s.reset_stream(sid)  # idempotent
    with pytest.raises(LocalProtocolError):
        c.send_data(sid, b"x")


def test_reset_in_the_middle_of_a_frame():
    s = YamuxSession(is_client=False)
    frame = encode_header(TYPE_DATA, FLAG_SYN, 1, 10) + b"0123456789"
    assert s.receive_data(frame[:15]) == [StreamOpened(1), DataReceived(1, b"012")]
    s.reset_stream(1)
    assert wire(s.data_to_send()) == encode_header(TYPE_WINDOW_UPDATE, FLAG_ACK, 1, DELTA) + encode_header(
        TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0
    )
    assert s.receive_data(frame[15:]) == []  # the rest of the frame is skipped


def test_go_away():
    pair = Pair()
    c, s = pair.client, pair.server
    old = c.open_stream()
    pair.pump()
    s.go_away()
    c.open_stream()  # crosses the GO_AWAY: the server refuses it with RST
    pair.pump()
    events = pair.take(c)
    assert GoAwayReceived(0) in events and StreamReset(3) in events
    with pytest.raises(LocalProtocolError, match="going away"):
        c.open_stream()
    with pytest.raises(LocalProtocolError):
        s.open_stream()
    c.send_data(old, b"still works")  # existing streams continue
    pair.pump()
    assert bytes(pair.received[s][old]) == b"still works"


def test_too_many_streams():
    pair = Pair()
    pair.server.max_streams = 2
    c, s = pair.client, pair.server
    ids = [c.open_stream() for _ in range(3)]
    pair.pump()
    assert [e for e in pair.take(s) if isinstance(e, StreamOpened)] == [StreamOpened(1), StreamOpened(3)]
    assert StreamReset(ids[2]) in pair.take(c)
    assert sorted(s.stream_ids) == [1, 3]
    small = YamuxSession(is_client=True, max_streams=1)
    small.open_stream()
    with pytest.raises(LocalProtocolError, match="already open"):
        small.open_stream()


@pytest.mark.parametrize(
    "frame, match",
    [
        (encode_header(TYPE_DATA, 0, 0, 0)[:0] + bytes([1]) + encode_header(0, 0, 1, 0)[1:], "version"),
        (encode_header(4, 0, 0, 0), "unknown"),
        (encode_header(TYPE_DATA, 0, 0, 0), "stream 0"),
        (encode_header(TYPE_PING, FLAG_SYN, 3, 0), "PING"),
        (encode_header(TYPE_GO_AWAY, 0, 5, 0), "GO_AWAY"),
        (encode_header(TYPE_PING, 0, 0, 0), "neither"),
        (encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 2, 0), "belongs to us"),
        (encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, 0) * 2, "twice"),
        (encode_header(TYPE_DATA, FLAG_SYN, 1, MIB + 1), "window"),
        (encode_header(TYPE_DATA, 0, 99, 65 * MIB), "exceeds"),  # past the 64 MiB largest window
        (encode_header(TYPE_WINDOW_UPDATE, FLAG_SYN, 1, (1 << 32) - 1), "send window"),
    ],
)
def test_malformed_frames(frame, match):
    s = YamuxSession(is_client=False)
    with pytest.raises(RemoteProtocolError, match=match):
        s.receive_data(frame)


def test_frames_for_unknown_streams_are_skipped():
    s = YamuxSession(is_client=False)
    data = encode_header(TYPE_DATA, 0, 41, 5) + b"hello" + encode_header(TYPE_WINDOW_UPDATE, FLAG_FIN, 41, 9)
    assert s.receive_data(data) == []
    assert s.receive_data(encode_header(TYPE_DATA, FLAG_SYN, 1, 2) + b"ok") == [
        StreamOpened(1),
        DataReceived(1, b"ok"),
    ]


def test_local_misuse():
    pair = Pair()
    c = pair.client
    sid = c.open_stream()
    with pytest.raises(LocalProtocolError):
        c.consumed(sid, 1)  # nothing received yet
    c.end_stream(sid)
    with pytest.raises(LocalProtocolError):
        c.end_stream(sid)
    with pytest.raises(LocalProtocolError):
        c.send_data(sid, b"x")
    with pytest.raises(LocalProtocolError):
        c.send_window(12345)
    c.consumed(12345, 1)  # unknown stream: ignored (reads can race with resets)
    c.go_away()
    with pytest.raises(LocalProtocolError):
        c.go_away()
    with pytest.raises(ValueError):
        YamuxSession(is_client=True, initial_receive_window=1024)


@pytest.mark.parametrize("module", ["multistream", "yamux"])
def test_core_imports_no_io_clock_or_randomness(module):
    import ast
    import importlib

    source = open(importlib.import_module(f"plexus.p2p.protocols.{module}").__file__).read()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "socket", "time", "random", "os", "selectors", "threading"}
