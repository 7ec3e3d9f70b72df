"""Multiaddr text and binary forms: spec vectors, round trips, operations, and malformed input.

The invariant under test (as for every codec that reads peer data): any input either parses, and
then prints and re-encodes to the same bytes, or raises MultiaddrError; nothing else escapes.
"""

import ipaddress
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexus.p2p.identity import PeerID, PrivateKey
from plexus.p2p.multiaddr import (
    MAX_BINARY_LENGTH,
    Multiaddr,
    MultiaddrError,
    from_socket_address,
    parse_host_port,
)

PEER = PrivateKey.from_seed(bytes(range(32))).peer_id
RELAY = PrivateKey.from_seed(bytes(range(1, 33))).peer_id
OTHER = PrivateKey.generate().peer_id
QM_PEER = "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"  # an RSA-era sha2-256 peer id

# Codes and sizes as written in protocols.csv of github.com/multiformats/multiaddr, kept apart from
# the module's own table so that a typo there shows up here.
SPEC_CODES = {
    "ip4": 4, "tcp": 6, "dccp": 33, "ip6": 41, "ip6zone": 42, "dns": 53, "dns4": 54, "dns6": 55,
    "dnsaddr": 56, "sctp": 132, "udp": 273, "p2p-circuit": 290, "unix": 400, "p2p": 421,
    "https": 443, "tls": 448, "sni": 449, "noise": 454, "quic": 460, "quic-v1": 461,
    "webtransport": 465, "ws": 477, "wss": 478, "http": 480,
}  # fmt: skip
PORT_PROTOCOLS = ("tcp", "udp", "dccp", "sctp")
NAME_PROTOCOLS = ("dns", "dns4", "dns6", "dnsaddr", "ip6zone", "sni")
FLAG_PROTOCOLS = (
    "p2p-circuit", "https", "tls", "noise", "quic", "quic-v1", "webtransport", "ws", "wss", "http",
)  # fmt: skip


def uvarint(value: int) -> bytes:
    """A test-side varint encoder, independent of the one under test."""
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def expected_bytes(components: list[tuple[str, str | None]]) -> bytes:
    """Encode components from first principles, to check the module's encoder against."""
    out = b""
    for name, value in components:
        out += uvarint(SPEC_CODES[name])
        if name == "ip4":
            out += ipaddress.IPv4Address(value).packed
        elif name == "ip6":
            out += ipaddress.IPv6Address(value).packed
        elif name in PORT_PROTOCOLS:
            out += int(value).to_bytes(2, "big")
        elif name in NAME_PROTOCOLS or name == "unix":
            raw = value.encode()
            out += uvarint(len(raw)) + raw
        elif name == "p2p":
            raw = PeerID.from_string(value).to_bytes()
            out += uvarint(len(raw)) + raw
    return out


# --- spec vectors -------------------------------------------------------------------------------

VECTORS = [
    # from the multiaddr spec's test/multiaddr.feature and the go/js/C# implementations' test suites
    ("/ip4/192.0.2.42/tcp/443", "04c000022a0601bb"),
    ("/ip4/127.0.0.1/udp/1234", "047f000001910204d2"),
    ("/ip4/127.0.0.1/tcp/4321", "047f0000010610e1"),
    ("/ip4/127.0.0.1/udp/1234/ip4/127.0.0.1/tcp/4321", "047f000001910204d2047f0000010610e1"),
    ("/ip6/2001:8a0:7ac5:4201:3ac9:86ff:fe31:7095", "29200108a07ac542013ac986fffe317095"),
    ("/p2p/" + QM_PEER, "a503221220d52ebb89d85b02a284948203a62ff28389c57c9f42beec4ec20db76a68911c0b"),
    ("/ip6zone/eth0/ip6/::1", "2a04657468302900000000000000000000000000000001"),
    ("/ip4/127.0.0.1/udp/1234/quic-v1", "047f000001910204d2cd03"),
    ("/ip4/127.0.0.1/udp/1234/quic-v1/webtransport", "047f000001910204d2cd03d103"),
]


@pytest.mark.parametrize("text, hex_bytes", VECTORS)
def test_spec_vectors_both_ways(text, hex_bytes):
    assert Multiaddr(text).to_bytes().hex() == hex_bytes
    assert str(Multiaddr.from_bytes(bytes.fromhex(hex_bytes))) == text
    assert Multiaddr(bytes.fromhex(hex_bytes)) == Multiaddr(text)


def test_module_table_matches_the_spec_codes():
    samples = {"ip4": "1.2.3.4", "ip6": "::1", "unix": "x", "p2p": str(PEER)}
    samples.update({name: "1" for name in PORT_PROTOCOLS})
    samples.update({name: "example.com" for name in NAME_PROTOCOLS})
    for name, code in SPEC_CODES.items():
        text = f"/{name}" if name in FLAG_PROTOCOLS else f"/{name}/{samples[name]}"
        assert Multiaddr(text).to_bytes().startswith(uvarint(code)), name


# --- text round trips ---------------------------------------------------------------------------

ROUND_TRIPS = [
    "/",
    "/ip4/0.0.0.0/tcp/0",
    "/ip4/255.255.255.255/tcp/65535",
    "/ip6/::/tcp/4001",
    "/ip6/::1/udp/4001/quic-v1",
    "/ip6/2001:db8::1/tcp/443/tls/ws",
    "/ip6zone/eth0/ip6/fe80::1/tcp/1",
    f"/dns4/example.com/tcp/443/p2p/{PEER}",
    "/dns6/ipfs.io/tcp/443/wss",
    "/dns/bootstrap.example/udp/4001/quic-v1/webtransport",
    "/dnsaddr/bootstrap.libp2p.io",
    f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
    f"/ip4/1.2.3.4/udp/4001/quic-v1/p2p/{RELAY}/p2p-circuit",
    "/ip4/127.0.0.1/tcp/8080/http",
    "/ip4/127.0.0.1/tcp/8443/tls/sni/example.com/http",
    "/ip4/1.2.3.4/tcp/1/noise",
    "/ip4/1.2.3.4/udp/1/quic",
    "/ip4/1.2.3.4/sctp/9/dccp/10/https",
    "/unix/tmp/p2pd.sock",
    f"/unix/%2Ftmp%2Fp2pd.sock/p2p/{PEER}",
    f"/p2p/{QM_PEER}",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_canonical_text_round_trips(text):
    addr = Multiaddr(text)
    assert str(addr) == text
    assert Multiaddr.from_bytes(addr.to_bytes()) == addr
    assert str(Multiaddr.from_bytes(addr.to_bytes())) == text
    assert Multiaddr(addr) == addr and hash(Multiaddr(text)) == hash(addr)
    assert repr(addr) == f"Multiaddr({text!r})"


@pytest.mark.parametrize(
    "given_text, canonical",
    [
        ("/ip6/0:0:0:0:0:0:0:1/tcp/1", "/ip6/::1/tcp/1"),
        ("/ip6/2001:DB8:0:0::1/tcp/1", "/ip6/2001:db8::1/tcp/1"),
        ("/tcp/0080", "/tcp/80"),
        (f"/ipfs/{PEER}", f"/p2p/{PEER}"),
        (f"/p2p/{PEER.to_cid()}", f"/p2p/{PEER}"),
        (f"/ip4/1.2.3.4/tcp/1/p2p/{PEER.to_cid()}/p2p-circuit", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/p2p-circuit"),
        ("/unix/%2Ftmp%2Fx.sock", "/unix/tmp/x.sock"),
        ("/unix/%2fa", "/unix/a"),
        ("/unix/a/b/c/d", "/unix/a/b/c/d"),
    ],
)
def test_equivalent_text_forms_normalise(given_text, canonical):
    assert str(Multiaddr(given_text)) == canonical
    assert Multiaddr(given_text) == Multiaddr(canonical)


def test_unix_paths_that_need_percent_encoding_still_round_trip():
    for path in ["/", "//x", "/%2Fodd", "/a%20space", "/dir/sock"]:
        raw = bytes([0x90, 0x03, len(path)]) + path.encode()
        for data in (raw, raw + bytes.fromhex("0601bb")):  # last component, and followed by /tcp
            addr = Multiaddr.from_bytes(data)
            assert addr.components()[0] == ("unix", path)
            assert Multiaddr(str(addr)).to_bytes() == data, str(addr)


# --- hypothesis round trips ---------------------------------------------------------------------

PEER_IDS = [PEER, RELAY, OTHER, PeerID.from_string(QM_PEER)]
NAME_CHARACTERS = st.characters(blacklist_characters="/", blacklist_categories=("Cs",))
NAMES = st.text(NAME_CHARACTERS, min_size=1, max_size=40)


@st.composite
def components(draw):
    """(name, canonical value or None, text value) for one component of any supported protocol."""
    name = draw(st.sampled_from(sorted(SPEC_CODES)))
    if name in FLAG_PROTOCOLS:
        return name, None, None
    if name == "ip4":
        value = str(draw(st.ip_addresses(v=4)))
        return name, value, value
    if name == "ip6":
        ip = draw(st.ip_addresses(v=6))
        return name, ip.compressed, draw(st.sampled_from([ip.compressed, ip.exploded]))
    if name in PORT_PROTOCOLS:
        port = draw(st.integers(0, 65535))
        return name, str(port), str(port)
    if name in NAME_PROTOCOLS:
        value = draw(NAMES)
        return name, value, value
    if name == "unix":
        path = "/" + draw(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30))
        return name, path, quote(path, safe="")
    peer = draw(st.sampled_from(PEER_IDS))
    return name, str(peer), draw(st.sampled_from([str(peer), peer.to_cid()]))


@settings(max_examples=300, deadline=None)
@given(st.lists(components(), max_size=8))
def test_any_address_round_trips_text_and_binary(parts):
    text = "".join(f"/{name}" + ("" if shown is None else f"/{shown}") for name, _, shown in parts) or "/"
    addr = Multiaddr(text)
    assert addr.components() == [(name, value) for name, value, _ in parts]
    assert addr.to_bytes() == expected_bytes([(name, value) for name, value, _ in parts])
    again = Multiaddr.from_bytes(addr.to_bytes())
    assert again == addr and str(again) == str(addr)
    assert Multiaddr(str(addr)).to_bytes() == addr.to_bytes()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=96))
def test_random_bytes_parse_or_raise_multiaddr_error(data):
    try:
        addr = Multiaddr.from_bytes(data)
    except MultiaddrError:
        return
    assert Multiaddr(str(addr)).to_bytes() == data
    addr.components(), addr.peer_id, addr.is_circuit, repr(addr)


@settings(max_examples=300, deadline=None)
@given(st.lists(components(), min_size=1, max_size=5), st.data())
def test_damaged_valid_addresses_parse_or_raise_multiaddr_error(parts, data):
    text = "".join(f"/{name}" + ("" if shown is None else f"/{shown}") for name, _, shown in parts)
    raw = bytearray(Multiaddr(text).to_bytes())
    cut = data.draw(st.integers(0, len(raw)))
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] = data.draw(st.integers(0, 255))
    for damaged in (bytes(raw), bytes(raw[:cut])):
        try:
            addr = Multiaddr.from_bytes(damaged)
        except MultiaddrError:
            continue
        assert Multiaddr(str(addr)).to_bytes() == damaged


TEXT_CORPUS = [
    "ip4", "ip6", "tcp", "udp", "p2p", "unix", "dns4", "quic-v1", "1.2.3.4", "::1", "443", str(PEER), "",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(TEXT_CORPUS), st.text(max_size=12)), max_size=10))
def test_random_text_parses_or_raises_multiaddr_error(pieces):
    text = "/" + "/".join(pieces)
    try:
        addr = Multiaddr(text)
    except MultiaddrError:
        return
    assert Multiaddr(str(addr)) == addr


# --- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("/ip4/1.2.3/tcp/1", "invalid IPv4 address '1.2.3' in '/ip4/1.2.3/tcp/1'"),
        ("/ip4/01.2.3.4", "invalid IPv4 address '01.2.3.4'"),
        ("/ip4/256.0.0.1", "invalid IPv4 address"),
        ("/ip6/1::2::3", "invalid IPv6 address '1::2::3'"),
        ("/ip6/fe80::1%eth0", "/ip6zone"),
        ("/ip6/1.2.3.4", "invalid IPv6 address"),
        ("/tpc/1", "unknown protocol 'tpc'"),
        ("/ip4/1.2.3.4/tcp", "missing value for /tcp"),
        ("/ip4", "missing value for /ip4"),
        ("/unix", "missing value for /unix"),
        ("/unix/", "missing value for /unix"),
        ("/p2p", "missing value for /p2p"),
        ("/tcp/70000", "port 70000 out of range"),
        ("/tcp/99999999999", "invalid port"),
        ("/tcp/-1", "invalid port '-1'"),
        ("/tcp/1e3", "invalid port"),
        ("/tcp/٣", "invalid port"),  # a non-ASCII digit
        ("/tcp/ 1", "invalid port"),
        ("//ip4/1.2.3.4", "empty component"),
        ("/ip4/1.2.3.4//tcp/1", "empty component"),
        ("/ip4/1.2.3.4/tcp/1/", "empty component"),
        ("/ip4/1.2.3.4/tcp/1/garbage", "unknown protocol 'garbage'"),
        ("/ip4/1.2.3.4/tcp/1/ws/ws/80", "unknown protocol '80'"),
        ("ip4/1.2.3.4", "must start with '/'"),
        ("", "must start with '/'"),
        ("/p2p/12D3KooWnotapeerid", "invalid peer id"),
        ("/p2p/QmNotBase58!!", "invalid peer id"),
        ("/p2p/bafzbeinotacid", "invalid peer id"),
        ("/dns4/" + "a" * 256, "longer than 255"),
        ("/dns4/\udcff", "not valid text"),
        ("/unix/%2F%ff", "not valid UTF-8"),
        ("/ip4/1.2.3.4" * 400, "exceeds 4096"),
        ("/ws" * 600, "exceeds 1024 bytes"),
    ],
)
def test_malformed_text_raises_a_clear_error(text, message):
    with pytest.raises(MultiaddrError) as error:
        Multiaddr(text)
    assert message in str(error.value)


GOOD = Multiaddr(f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER}").to_bytes()


@pytest.mark.parametrize(
    "data, message",
    [
        (bytes.fromhex("047f0000"), "truncated"),  # ip4 needs 4 bytes
        (bytes.fromhex("047f000001910204"), "truncated"),  # udp needs 2 bytes
        (bytes.fromhex("0491"), "truncated"),  # varint cut off after its continuation bit
        (bytes.fromhex("3605616263"), "truncated"),  # dns4 length 5, 3 bytes left
        (bytes.fromhex("7f"), "unknown protocol code 127 at byte 0"),
        (bytes.fromhex("047f000001ff7f"), "unknown protocol code 16383 at byte 5"),
        (bytes.fromhex("8400"), "not minimally encoded"),
        (bytes.fromhex("ffffffffffffffffff01"), "varint longer than"),
        (bytes.fromhex("3600"), "empty value for /dns4"),
        (bytes.fromhex("3603612f62"), "contains '/'"),  # dns4 "a/b"
        (bytes.fromhex("3602c328"), "not valid UTF-8"),
        (bytes.fromhex("900306736f636b6574"), "not absolute"),  # unix "socket"
        (
            bytes.fromhex("a503221221c05877cbae039d70a5e600ea02c6f9f2942439285c9e344e26f8d280c850fad6"),
            "invalid peer id",
        ),  # from go-multiaddr's TestInvalidP2PAddr: multihash length says 33, has 32
        (bytes.fromhex("a50302ff00"), "invalid peer id"),  # unknown multihash code
        (bytes.fromhex("a202") * 600, "exceeds 1024"),
        (GOOD[:-1], "truncated"),
    ],
)
def test_malformed_bytes_raise_a_clear_error(data, message):
    with pytest.raises(MultiaddrError) as error:
        Multiaddr.from_bytes(data)
    assert message in str(error.value)


def test_every_strict_prefix_inside_a_component_is_truncated():
    boundaries = {0, 5, 8, len(GOOD)}  # /ip4/…, /tcp/…, /p2p/…
    for cut in range(len(GOOD)):
        if cut in boundaries:
            assert Multiaddr.from_bytes(GOOD[:cut]).to_bytes() == GOOD[:cut]
        else:
            with pytest.raises(MultiaddrError, match="truncated"):
                Multiaddr.from_bytes(GOOD[:cut])


@pytest.mark.parametrize("value", [None, 42, 1.5, ["/ip4/1.2.3.4"]])
def test_wrong_argument_types_raise_multiaddr_error(value):
    with pytest.raises(MultiaddrError):
        Multiaddr(value)
    with pytest.raises(MultiaddrError):
        Multiaddr.from_bytes(value)


def test_bytes_like_inputs_are_accepted():
    raw = bytes.fromhex("047f000001910204d2")
    assert Multiaddr(bytearray(raw)) == Multiaddr(memoryview(raw)) == Multiaddr(raw)
    assert bytes(Multiaddr(raw)) == raw


def test_maximum_length_is_accepted_and_one_more_is_not():
    flags = bytes.fromhex("a202") * (MAX_BINARY_LENGTH // 2)
    assert len(Multiaddr.from_bytes(flags).protocols()) == MAX_BINARY_LENGTH // 2
    with pytest.raises(MultiaddrError, match="exceeds"):
        Multiaddr.from_bytes(flags + b"\x06")
    with pytest.raises(MultiaddrError, match="exceeds"):
        Multiaddr.from_bytes(flags).encapsulate("/p2p-circuit")


# --- accessors and operations -------------------------------------------------------------------

CIRCUIT = Multiaddr(f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")


def test_components_protocols_and_values():
    assert CIRCUIT.components() == [
        ("ip4", "1.2.3.4"), ("tcp", "4001"), ("p2p", str(RELAY)), ("p2p-circuit", None), ("p2p", str(PEER)),
    ]  # fmt: skip
    assert CIRCUIT.protocols() == ["ip4", "tcp", "p2p", "p2p-circuit", "p2p"]
    assert CIRCUIT.value_for_protocol("p2p") == str(RELAY)  # the first occurrence
    assert CIRCUIT.value_for_protocol("ipfs") == str(RELAY)
    assert CIRCUIT.value_for_protocol("tcp") == "4001"
    assert CIRCUIT.value_for_protocol("udp") is None
    assert CIRCUIT.value_for_protocol("p2p-circuit") is None
    with pytest.raises(MultiaddrError, match="unknown protocol 'tpc'"):
        CIRCUIT.value_for_protocol("tpc")
    assert Multiaddr("/").components() == [] and str(Multiaddr("/")) == "/"


def test_encapsulate_and_decapsulate():
    base = Multiaddr("/ip4/127.0.0.1/udp/1234")
    both = base.encapsulate("/udp/5678")
    assert str(both) == "/ip4/127.0.0.1/udp/1234/udp/5678"
    assert both.encapsulate(Multiaddr("/quic-v1")) == Multiaddr("/ip4/127.0.0.1/udp/1234/udp/5678/quic-v1")
    assert both.encapsulate(bytes.fromhex("cd03")) == both.encapsulate("/quic-v1")
    assert both.decapsulate("/udp/5678") == base
    assert both.decapsulate("udp") == base  # a name drops from its last occurrence
    assert both.decapsulate("/udp/1234") == Multiaddr("/ip4/127.0.0.1")
    assert both.decapsulate("ip4") == Multiaddr("/")
    assert both.decapsulate("tcp") is both  # absent: unchanged
    assert both.decapsulate("/udp/9") is both
    assert both.decapsulate("/") is both
    assert CIRCUIT.decapsulate("p2p-circuit") == Multiaddr(f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}")
    assert CIRCUIT.decapsulate("p2p") == CIRCUIT.decapsulate(f"/p2p/{PEER}")
    with pytest.raises(MultiaddrError, match="unknown protocol"):
        both.decapsulate("tpc")
    with pytest.raises(MultiaddrError):
        base.encapsulate("udp/1")


def test_peer_id_is_the_final_p2p_component():
    assert CIRCUIT.peer_id == PEER
    assert Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER.to_cid()}").peer_id == PEER
    # a circuit address without a destination: the relay's id is not the peer behind it
    assert Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit").peer_id is None
    assert Multiaddr("/ip4/1.2.3.4/tcp/1").peer_id is None
    assert Multiaddr(f"/p2p/{QM_PEER}").peer_id == PeerID.from_base58(QM_PEER)


def test_with_and_without_peer_id():
    plain = Multiaddr("/ip4/1.2.3.4/tcp/1")
    with_id = plain.with_peer_id(PEER)
    assert str(with_id) == f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}"
    assert with_id.with_peer_id(PEER) is with_id
    assert plain.with_peer_id(str(PEER)) == with_id == plain.with_peer_id(PEER.to_cid())
    with pytest.raises(MultiaddrError, match="already ends with peer id"):
        with_id.with_peer_id(OTHER)
    with pytest.raises(MultiaddrError, match="invalid peer id"):
        plain.with_peer_id("not-a-peer-id")
    assert with_id.without_peer_id() == plain
    assert plain.without_peer_id() is plain
    relay_only = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit")
    assert relay_only.without_peer_id() is relay_only
    destination = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
    assert relay_only.with_peer_id(PEER) == destination
    assert CIRCUIT.without_peer_id() == Multiaddr(f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}/p2p-circuit")


def test_is_circuit():
    assert CIRCUIT.is_circuit
    assert not Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}").is_circuit


def test_equality_is_by_bytes_and_only_with_multiaddrs():
    assert Multiaddr(f"/ipfs/{PEER.to_cid()}") == Multiaddr(f"/p2p/{PEER}")
    assert len({Multiaddr("/ip6/::1/tcp/1"), Multiaddr("/ip6/0::0:1/tcp/1")}) == 1
    assert Multiaddr("/ip4/1.2.3.4/tcp/1") != "/ip4/1.2.3.4/tcp/1"
    assert Multiaddr("/ip4/1.2.3.4/tcp/1") != Multiaddr("/ip4/1.2.3.4/udp/1")


# --- transport helpers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("/ip4/127.0.0.1/tcp/4001", ("127.0.0.1", 4001, "ip4")),
        ("/ip6/::1/tcp/0", ("::1", 0, "ip6")),
        (f"/dns4/example.com/tcp/443/p2p/{PEER}", ("example.com", 443, "dns4")),
        ("/dns6/example.com/tcp/1", ("example.com", 1, "dns6")),
        ("/dns/example.com/tcp/1", ("example.com", 1, "dns")),
    ],
)
def test_parse_host_port(text, expected):
    assert parse_host_port(text) == expected
    assert parse_host_port(Multiaddr(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        "/ip4/1.2.3.4/udp/1",
        "/ip4/1.2.3.4",
        "/tcp/1",
        "/ip4/1.2.3.4/tcp/1/ws",
        f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
        "/unix/tmp/sock",
        "/dnsaddr/example.com/tcp/1",
        "/",
    ],
)
def test_parse_host_port_rejects_what_is_not_plain_tcp(text):
    with pytest.raises(MultiaddrError, match="is not a TCP address"):
        parse_host_port(text)


def test_parse_host_port_reports_malformed_text_as_such():
    with pytest.raises(MultiaddrError, match="invalid IPv4 address"):
        parse_host_port("/ip4/1.2.3/tcp/1")


def test_from_socket_address():
    assert from_socket_address("127.0.0.1", 4001) == Multiaddr("/ip4/127.0.0.1/tcp/4001")
    assert str(from_socket_address("0:0::1", 5)) == "/ip6/::1/tcp/5"
    assert str(from_socket_address("::ffff:10.0.0.1", 5)) == "/ip4/10.0.0.1/tcp/5"  # dual-stack socket
    assert str(from_socket_address("fe80::1%eth0", 5)) == "/ip6zone/eth0/ip6/fe80::1/tcp/5"
    host, port, family = parse_host_port(from_socket_address("::1", 65535))
    assert (host, port, family) == ("::1", 65535, "ip6")
    for host, port in [("example.com", 1), ("1.2.3.4", 70000), ("1.2.3.4", -1), ("1.2.3.4", True), (None, 1)]:
        with pytest.raises(MultiaddrError):
            from_socket_address(host, port)
