"""multistream-select 1.0 core: exact byte transcripts, both sides joined in memory, malformed input."""

import pytest

from plexus.p2p.protocols.errors import LocalProtocolError, RemoteProtocolError
from plexus.p2p.protocols.multistream import (
    MAX_MESSAGE,
    MAX_PROPOSALS,
    MultistreamDialer,
    MultistreamListener,
    NegotiationError,
    encode_message,
)

pytestmark = pytest.mark.timeout(30)

HEADER_BYTES = b"\x13/multistream/1.0.0\n"
NA_BYTES = b"\x03na\n"
NOISE = b"\x07/noise\n"
YAMUX = b"\x0d/yamux/1.0.0\n"


def feed(core, data: bytes, bytewise: bool) -> None:
    if not bytewise:
        core.receive_data(data)
        return
    for i in range(len(data)):
        core.receive_data(data[i : i + 1])
        if core.selected is not None:
            # the rest belongs to the next protocol; the core says so through unused_data
            core.unused_data += data[i + 1 :]
            return


def test_encode_message_exact_bytes():
    assert encode_message("/multistream/1.0.0") == HEADER_BYTES
    assert encode_message("na") == bytes.fromhex("036e610a")  # spec example
    assert encode_message("ls") == bytes.fromhex("036c730a")  # spec example
    long = "/" + "x" * 200
    assert encode_message(long)[:2] == bytes([0xCA, 0x01])  # 202 as a two-byte varint


@pytest.mark.parametrize("bytewise", [False, True])
def test_dialer_transcript_accept_first(bytewise):
    dialer = MultistreamDialer(["/noise"])
    assert dialer.data_to_send() == HEADER_BYTES + NOISE  # lazy: header and proposal in one write
    assert dialer.data_to_send() == b""
    feed(dialer, HEADER_BYTES + NOISE + b"handshake", bytewise)
    assert dialer.selected == "/noise"
    assert dialer.unused_data == b"handshake"
    assert dialer.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        dialer.receive_data(b"more")


@pytest.mark.parametrize("bytewise", [False, True])
def test_dialer_transcript_na_then_accept(bytewise):
    dialer = MultistreamDialer(["/tls/1.0.0", "/noise"])
    assert dialer.data_to_send() == HEADER_BYTES + b"\x0b/tls/1.0.0\n"
    feed(dialer, HEADER_BYTES + NA_BYTES, bytewise)
    assert dialer.selected is None
    assert dialer.data_to_send() == NOISE
    feed(dialer, NOISE, bytewise)
    assert dialer.selected == "/noise" and dialer.unused_data == b""


def test_dialer_all_refused_names_protocols():
    dialer = MultistreamDialer(["/a", "/b"])
    dialer.receive_data(HEADER_BYTES + NA_BYTES)
    with pytest.raises(NegotiationError) as info:
        dialer.receive_data(NA_BYTES)
    assert "/a" in str(info.value) and "/b" in str(info.value)
    assert info.value.tried == ("/a", "/b")
    with pytest.raises(NegotiationError):  # terminal
        dialer.receive_data(b"")


@pytest.mark.parametrize(
    "reply",
    [
        b"\x13/multistream/2.0.0\n",  # wrong header
        HEADER_BYTES + b"\x05/yyy\n",  # answered another protocol
        HEADER_BYTES + b"\x03na",  # incomplete, then garbage below
    ],
)
def test_dialer_rejects_bad_replies(reply):
    dialer = MultistreamDialer(["/xxx"])
    if reply.endswith(b"na"):
        dialer.receive_data(reply)
        with pytest.raises(NegotiationError):
            dialer.receive_data(b"X")  # not a newline
    else:
        with pytest.raises(NegotiationError):
            dialer.receive_data(reply)


@pytest.mark.parametrize("bytewise", [False, True])
def test_listener_transcript(bytewise):
    listener = MultistreamListener(["/noise", "/yamux/1.0.0"])
    assert listener.data_to_send() == HEADER_BYTES  # speaks first, like go-multistream
    feed(listener, HEADER_BYTES + b"\x06/tls1\n" + YAMUX + b"\x00\x00", bytewise)
    assert listener.selected == "/yamux/1.0.0"
    assert listener.unused_data == b"\x00\x00"
    assert listener.data_to_send() == NA_BYTES + YAMUX


def test_listener_with_callable_and_ls():
    listener = MultistreamListener(lambda p: p.startswith("/plexus/"))
    listener.receive_data(HEADER_BYTES + encode_message("ls"))
    # a callable cannot be listed: the reply is an empty list (just the closing newline)
    assert listener.data_to_send() == HEADER_BYTES + b"\x01\n"
    listener.receive_data(encode_message("/plexus/dht/1.0.0"))
    assert listener.selected == "/plexus/dht/1.0.0"


def test_listener_ls_exact_bytes():
    listener = MultistreamListener(["/noise", "/yamux/1.0.0"])
    listener.data_to_send()
    listener.receive_data(HEADER_BYTES + encode_message("ls"))
    body = NOISE + YAMUX + b"\n"
    assert listener.data_to_send() == bytes([len(body)]) + body
    assert listener.selected is None


def test_listener_never_accepts_control_words():
    listener = MultistreamListener(lambda p: True)
    listener.receive_data(HEADER_BYTES + NA_BYTES + HEADER_BYTES)
    assert listener.data_to_send() == HEADER_BYTES + NA_BYTES + NA_BYTES
    assert listener.selected is None


def test_dialer_and_listener_in_memory():
    dialer = MultistreamDialer(["/a/1", "/b/1", "/c/1"])
    listener = MultistreamListener({"/c/1", "/z"})
    for _ in range(10):
        listener.receive_data(dialer.data_to_send())
        if listener.selected is None:
            dialer.receive_data(listener.data_to_send())
        else:
            dialer.receive_data(listener.data_to_send() + b"app")
            break
    assert dialer.selected == listener.selected == "/c/1"
    assert dialer.unused_data == b"app"


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x08/plexus\n", "header"),  # not the multistream header
        (b"\x13/multistream/1.0.0X", "newline"),
        (bytes([0x80 | 0x01, 0x10]) + b"x" * 10, "limit"),  # 2049 bytes announced
        (b"\xff" * 10, "length prefix"),  # endless varint
        (b"\x80\x00", "length prefix"),  # non-minimal varint
        (b"\x03\xff\xfe\n", "UTF-8"),
        (b"\x00", "newline"),  # empty message
        (b"\x04a\nb\n", "newline inside"),
    ],
)
def test_listener_rejects_malformed(data, match):
    listener = MultistreamListener(["/a"])
    with pytest.raises(NegotiationError, match=match):
        listener.receive_data(data)
    assert isinstance(NegotiationError("x"), RemoteProtocolError)
    with pytest.raises(NegotiationError):  # fails fast afterwards
        listener.receive_data(HEADER_BYTES)


def test_message_size_bound_is_inclusive():
    ok = "/" + "p" * (MAX_MESSAGE - 2)  # with the newline: exactly MAX_MESSAGE bytes
    listener = MultistreamListener([ok])
    listener.receive_data(HEADER_BYTES + encode_message(ok))
    assert listener.selected == ok
    listener = MultistreamListener([ok])
    with pytest.raises(NegotiationError):
        listener.receive_data(HEADER_BYTES + encode_message(ok + "p"))


def test_listener_bounds_number_of_proposals():
    listener = MultistreamListener(["/wanted"])
    listener.receive_data(HEADER_BYTES)
    for i in range(MAX_PROPOSALS):
        listener.receive_data(encode_message(f"/nope/{i}"))
    with pytest.raises(NegotiationError, match="proposals"):
        listener.receive_data(encode_message("/nope/last"))


def test_partial_message_buffer_is_bounded():
    listener = MultistreamListener(["/a"])
    listener.receive_data(HEADER_BYTES)
    partial = encode_message("/" + "q" * 1000)[:-1]
    listener.receive_data(partial)
    assert listener.buffered_bytes() == len(partial) <= MAX_MESSAGE + 2


def test_dialer_argument_checks():
    with pytest.raises(LocalProtocolError):
        MultistreamDialer([])
    with pytest.raises(LocalProtocolError):
        MultistreamDialer(["/a\nb"])
    with pytest.raises(LocalProtocolError):
        MultistreamDialer([f"/p{i}" for i in range(MAX_PROPOSALS + 1)])
    with pytest.raises(LocalProtocolError):
        MultistreamDialer(["/" + "x" * MAX_MESSAGE])
