"""Multiaddrs: self-describing network addresses, in their text and binary forms.

Theory of operation (multiformats multiaddr spec, protocols.csv of github.com/multiformats/multiaddr):

- A multiaddr is a sequence of components. Each is a protocol, maybe followed by a value:
  `/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW…`. In binary, a component is the protocol's multicodec
  code as an unsigned varint, then its value: fixed-size protocols (ip4: 4 bytes, tcp: 2 bytes
  big-endian, ...) write the raw bytes; variable-size ones (dns, p2p, unix, ...) write a varint
  length and then the bytes; value-less ones (p2p-circuit, quic-v1, ws, ...) write nothing.
- The binary form is the identity: two multiaddrs are equal when their bytes are. The text form is
  canonicalised on output (compressed IPv6, decimal ports, base58btc peer ids), so
  `/ipfs/bafz…` and `/p2p/12D3KooW…` of the same peer are equal and print the same way.
- Everything is bounded: at most MAX_BINARY_LENGTH bytes in binary and MAX_TEXT_LENGTH characters
  of text are read. Any malformed input raises MultiaddrError, never another exception type, so
  addresses that peers send us (identify, DHT records) can be parsed without a catch-all.

Left out, deliberately: protocols whose codes we did not need (onion, garlic, webrtc, memory, ...);
certhash, whose text form is a multibase string; DNS resolution and dnsaddr lookups, which belong
to the transport layer, not this codec.

`/unix` path values: the text form follows go-multiaddr and takes the rest of the string
(`/unix/tmp/p2pd.sock` is the path `/tmp/p2pd.sock`). The newer spec's percent-encoded single
segment (`/unix/%2Ftmp%2Fp2pd.sock`) is also accepted, and it is what we print when a unix
component is not the last one, so that every address still reads back to the same bytes. Only
absolute paths are supported: a relative path has no unambiguous text form in go's scheme.
"""

import ipaddress
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

from ..errors import PlexusError
from .identity import IdentityError, PeerID
from .protocols.varint import NeedMoreData, VarintError, decode_uvarint, encode_uvarint

MAX_BINARY_LENGTH = 1024  # a whole multiaddr in binary; real ones are under 100 bytes
MAX_TEXT_LENGTH = 4096  # checked before splitting, so a huge string costs nothing
MAX_NAME_LENGTH = 255  # dns names, zones, SNI: a DNS name has at most 253 characters
VARIABLE = -1  # size marker: the value is length-prefixed

_PORT_TEXT = re.compile(r"[0-9]{1,10}")


class MultiaddrError(PlexusError, ValueError):
    """A multiaddr (text or binary) is malformed, or an operation on one makes no sense."""


class _BadValue(Exception):
    """Internal: a value codec rejects its input; the caller adds where it happened."""


# --- value codecs: text <-> bytes for one component value ---------------------------------------


def _ip4_to_bytes(text: str) -> bytes:
    try:
        return ipaddress.IPv4Address(text).packed
    except ValueError:
        raise _BadValue(f"invalid IPv4 address {text!r}") from None


def _ip4_to_text(raw: bytes) -> str:
    return str(ipaddress.IPv4Address(raw))


def _ip6_to_bytes(text: str) -> bytes:
    if "%" in text:  # ipaddress accepts "fe80::1%eth0"; the zone has its own /ip6zone component
        raise _BadValue(f"invalid IPv6 address {text!r}: put a zone in /ip6zone/<zone> before /ip6")
    try:
        return ipaddress.IPv6Address(text).packed
    except ValueError:
        raise _BadValue(f"invalid IPv6 address {text!r}") from None


def _ip6_to_text(raw: bytes) -> str:
    return ipaddress.IPv6Address(raw).compressed


def _port_to_bytes(text: str) -> bytes:
    if not _PORT_TEXT.fullmatch(text):
        raise _BadValue(f"invalid port {text!r}: expected a decimal number from 0 to 65535")
    port = int(text)
    if port > 0xFFFF:
        raise _BadValue(f"port {port} out of range (0 to 65535)")
    return struct.pack(">H", port)


def _port_to_text(raw: bytes) -> str:
    return str(struct.unpack(">H", raw)[0])


def _name_to_bytes(text: str) -> bytes:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadValue(f"name {text!r} is not valid text") from None
    if len(raw) > MAX_NAME_LENGTH:
        raise _BadValue(f"name of {len(raw)} bytes is longer than {MAX_NAME_LENGTH}")
    return raw


def _name_to_text(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadValue("name is not valid UTF-8") from None
    if not text or "/" in text:
        raise _BadValue(f"name {text!r} is empty or contains '/'")
    if len(raw) > MAX_NAME_LENGTH:
        raise _BadValue(f"name of {len(raw)} bytes is longer than {MAX_NAME_LENGTH}")
    return text


def _peer_id_to_bytes(text: str) -> bytes:
    try:
        return PeerID.from_string(text).to_bytes()
    except (IdentityError, ValueError) as error:
        raise _BadValue(f"invalid peer id {text!r}: {error}") from None


def _peer_id_to_text(raw: bytes) -> str:
    try:
        return str(PeerID(raw))
    except (IdentityError, ValueError) as error:
        raise _BadValue(f"invalid peer id multihash: {error}") from None


def _unix_to_bytes(path: str) -> bytes:
    if not path.startswith("/"):
        raise _BadValue(f"unix socket path {path!r} is not absolute")
    try:
        return path.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadValue(f"unix socket path {path!r} is not valid text") from None


def _unix_to_text(raw: bytes) -> str:
    try:
        path = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadValue("unix socket path is not valid UTF-8") from None
    if not path.startswith("/"):
        raise _BadValue(f"unix socket path {path!r} is not absolute")
    return path


def _no_value_to_bytes(text: str) -> bytes:
    raise _BadValue("this protocol takes no value")


def _no_value_to_text(value: bytes) -> str:
    raise _BadValue("this protocol takes no value")


@dataclass(frozen=True)
class Protocol:
    """One row of the multiaddr protocol table: its name, multicodec code and value codec."""

    name: str
    code: int
    size: int  # value size in bits; 0 for none, VARIABLE for length-prefixed
    to_bytes: Callable[[str], bytes] = _no_value_to_bytes
    to_text: Callable[[bytes], str] = _no_value_to_text


# Codes and sizes checked against protocols.csv in github.com/multiformats/multiaddr.
PROTOCOLS = [
    Protocol("ip4", 4, 32, _ip4_to_bytes, _ip4_to_text),
    Protocol("tcp", 6, 16, _port_to_bytes, _port_to_text),
    Protocol("dccp", 33, 16, _port_to_bytes, _port_to_text),
    Protocol("ip6", 41, 128, _ip6_to_bytes, _ip6_to_text),
    Protocol("ip6zone", 42, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("dns", 53, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("dns4", 54, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("dns6", 55, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("dnsaddr", 56, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("sctp", 132, 16, _port_to_bytes, _port_to_text),
    Protocol("udp", 273, 16, _port_to_bytes, _port_to_text),
    Protocol("p2p-circuit", 290, 0),
    Protocol("unix", 400, VARIABLE, _unix_to_bytes, _unix_to_text),
    Protocol("p2p", 421, VARIABLE, _peer_id_to_bytes, _peer_id_to_text),
    Protocol("https", 443, 0),
    Protocol("tls", 448, 0),
    Protocol("sni", 449, VARIABLE, _name_to_bytes, _name_to_text),
    Protocol("noise", 454, 0),
    Protocol("quic", 460, 0),
    Protocol("quic-v1", 461, 0),
    Protocol("webtransport", 465, 0),
    Protocol("ws", 477, 0),
    Protocol("wss", 478, 0),
    Protocol("http", 480, 0),
]
_BY_NAME = {protocol.name: protocol for protocol in PROTOCOLS}
_BY_NAME["ipfs"] = _BY_NAME["p2p"]  # old name of /p2p, same code; we always print /p2p
_BY_CODE = {protocol.code: protocol for protocol in PROTOCOLS}

HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def _protocol_named(name: str) -> Protocol:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise MultiaddrError(f"unknown protocol {_short(name)!r}") from None


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


# --- parsing ------------------------------------------------------------------------------------


def _parse_text(text: str) -> list[tuple[Protocol, bytes]]:
    if len(text) > MAX_TEXT_LENGTH:
        raise MultiaddrError(f"multiaddr text of {len(text)} characters exceeds {MAX_TEXT_LENGTH}")
    if not text.startswith("/"):
        raise MultiaddrError(f"multiaddr {_short(text)!r} must start with '/'")
    if text == "/":
        return []
    where = f" in {_short(text)!r}"
    parts = text[1:].split("/")
    parsed, index = [], 0
    while index < len(parts):
        name = parts[index]
        index += 1
        if not name:
            raise MultiaddrError(f"empty component (a '//' or a trailing '/'){where}")
        if name not in _BY_NAME:
            raise MultiaddrError(f"unknown protocol {_short(name)!r}{where}")
        protocol = _BY_NAME[name]
        if protocol.size == 0:
            parsed.append((protocol, b""))
            continue
        if index >= len(parts) or not parts[index]:
            raise MultiaddrError(f"missing value for /{protocol.name}{where}")
        if protocol.name == "unix":
            value, index = _take_unix_path(parts, index, where)
        else:
            value, index = parts[index], index + 1
        try:
            parsed.append((protocol, protocol.to_bytes(value)))
        except _BadValue as error:
            raise MultiaddrError(f"{error}{where}") from None
    return parsed


def _take_unix_path(parts: list[str], index: int, where: str) -> tuple[str, int]:
    """A unix path is either one percent-encoded segment starting with %2F, or the rest of the text."""
    if parts[index][:3].lower() == "%2f":
        try:
            return unquote_to_bytes(parts[index]).decode("utf-8"), index + 1
        except UnicodeDecodeError:
            raise MultiaddrError(f"percent-encoded unix path is not valid UTF-8{where}") from None
    return "/" + "/".join(parts[index:]), len(parts)


def _parse_bytes(data: bytes) -> list[tuple[Protocol, bytes]]:
    if len(data) > MAX_BINARY_LENGTH:
        raise MultiaddrError(f"binary multiaddr of {len(data)} bytes exceeds {MAX_BINARY_LENGTH}")
    parsed, offset = [], 0
    while offset < len(data):
        start = offset
        code, offset = _read_varint(data, offset, "protocol code")
        if code not in _BY_CODE:
            raise MultiaddrError(f"unknown protocol code {code} at byte {start} of binary multiaddr")
        protocol = _BY_CODE[code]
        if protocol.size == VARIABLE:
            length, offset = _read_varint(data, offset, f"value length of /{protocol.name}")
        else:
            length = protocol.size // 8
        if offset + length > len(data):
            raise MultiaddrError(
                f"binary multiaddr is truncated: /{protocol.name} at byte {start} needs {length} value "
                f"bytes, only {len(data) - offset} left"
            )
        value = data[offset : offset + length]
        offset += length
        if protocol.size == VARIABLE and not value:
            raise MultiaddrError(f"empty value for /{protocol.name} at byte {start} of binary multiaddr")
        if protocol.size != 0:
            try:
                protocol.to_text(value)  # validate now, so every Multiaddr can be printed
            except _BadValue as error:
                raise MultiaddrError(f"{error} at byte {start} of binary multiaddr") from None
        parsed.append((protocol, value))
    return parsed


def _read_varint(data: bytes, offset: int, what: str) -> tuple[int, int]:
    try:
        return decode_uvarint(data, offset)
    except NeedMoreData:
        raise MultiaddrError(f"binary multiaddr is truncated in the {what} at byte {offset}") from None
    except VarintError as error:
        message = f"bad varint for the {what} at byte {offset} of binary multiaddr: {error}"
        raise MultiaddrError(message) from None


def _encode(parts: list[tuple[Protocol, bytes]]) -> bytes:
    out = bytearray()
    for protocol, value in parts:
        out += encode_uvarint(protocol.code)
        if protocol.size == VARIABLE:
            out += encode_uvarint(len(value))
        out += value
    if len(out) > MAX_BINARY_LENGTH:
        raise MultiaddrError(f"multiaddr of {len(out)} bytes exceeds {MAX_BINARY_LENGTH} bytes in binary")
    return bytes(out)


def _component_text(protocol: Protocol, value: bytes, is_last: bool) -> str:
    if protocol.size == 0:
        return "/" + protocol.name
    text = protocol.to_text(value)
    if protocol.name == "unix":
        # go-style path form where it reads back unambiguously, else one percent-encoded segment
        if is_last and len(text) > 1 and text[1] != "/" and text[1:4].lower() != "%2f":
            return "/unix" + text
        return "/unix/" + quote(text, safe="")
    return f"/{protocol.name}/{text}"


# --- the public type ----------------------------------------------------------------------------


class Multiaddr:
    """An immutable multiaddr, built from text (`/ip4/…`), binary, or another Multiaddr.

    Equality and hashing use the binary form; str() gives the canonical text form.
    """

    __slots__ = ("_bytes", "_parts")
    _bytes: bytes
    _parts: tuple[tuple[Protocol, bytes], ...]

    def __init__(self, addr: "str | bytes | bytearray | memoryview | Multiaddr"):
        if isinstance(addr, Multiaddr):
            self._parts, self._bytes = addr._parts, addr._bytes
        elif isinstance(addr, str):
            self._parts = tuple(_parse_text(addr))
            self._bytes = _encode(list(self._parts))
        elif isinstance(addr, (bytes, bytearray, memoryview)):
            self._bytes = bytes(addr)
            self._parts = tuple(_parse_bytes(self._bytes))
        else:
            raise MultiaddrError(f"a multiaddr is built from str or bytes, not {type(addr).__name__}")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Multiaddr":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MultiaddrError(f"from_bytes needs bytes, not {type(data).__name__}")
        return cls(data)

    @classmethod
    def _from_parts(cls, parts) -> "Multiaddr":
        self = cls.__new__(cls)
        self._parts = tuple(parts)
        self._bytes = _encode(list(self._parts))
        return self

    def to_bytes(self) -> bytes:
        return self._bytes

    def __bytes__(self) -> bytes:
        return self._bytes

    def components(self) -> list[tuple[str, str | None]]:
        """[(protocol name, canonical value text or None)] in order, e.g. [("ip4", "1.2.3.4"), ...]."""
        return [
            (protocol.name, None if protocol.size == 0 else protocol.to_text(value))
            for protocol, value in self._parts
        ]

    def protocols(self) -> list[str]:
        return [protocol.name for protocol, _ in self._parts]

    def value_for_protocol(self, name: str) -> str | None:
        """The value of the first component of protocol `name`; None if absent or value-less."""
        wanted = _protocol_named(name)
        for protocol, value in self._parts:
            if protocol is wanted:
                return None if protocol.size == 0 else protocol.to_text(value)
        return None

    def encapsulate(self, other: "str | bytes | Multiaddr") -> "Multiaddr":
        """This address with `other` appended: `/ip4/…/tcp/1`.encapsulate(`/p2p/…`)."""
        return Multiaddr._from_parts(self._parts + Multiaddr(other)._parts)

    def decapsulate(self, what: "str | bytes | Multiaddr") -> "Multiaddr":
        """Drop everything from the last occurrence of `what` on; unchanged if it does not occur.

        `what` is a protocol name (`"p2p-circuit"`) or a multiaddr (`"/tcp/1"`, matched component
        by component, values included).
        """
        if isinstance(what, str) and not what.startswith("/"):
            wanted = _protocol_named(what)
            for index in range(len(self._parts) - 1, -1, -1):
                if self._parts[index][0] is wanted:
                    return Multiaddr._from_parts(self._parts[:index])
            return self
        tail = Multiaddr(what)._parts
        if not tail:
            return self
        for index in range(len(self._parts) - len(tail), -1, -1):
            if self._parts[index : index + len(tail)] == tail:
                return Multiaddr._from_parts(self._parts[:index])
        return self

    @property
    def peer_id(self) -> PeerID | None:
        """The peer this address leads to: the id in a final /p2p component, else None.

        Like go-libp2p, only the last component counts: in `/…/p2p/<relay>/p2p-circuit` the relay's
        id is not the id of the peer behind the circuit.
        """
        if self._parts and self._parts[-1][0].name == "p2p":
            return PeerID(self._parts[-1][1])
        return None

    def with_peer_id(self, peer_id: "PeerID | str") -> "Multiaddr":
        """This address ending in /p2p/<peer_id>. Raises if it already ends in a different peer id."""
        if isinstance(peer_id, str):
            text = peer_id
            try:
                peer_id = PeerID.from_string(text)
            except (IdentityError, ValueError) as error:
                raise MultiaddrError(f"invalid peer id {_short(text)!r}: {error}") from None
        current = self.peer_id
        if current == peer_id:
            return self
        if current is not None:
            raise MultiaddrError(f"{self} already ends with peer id {current}, not {peer_id}")
        return Multiaddr._from_parts(self._parts + ((_BY_NAME["p2p"], peer_id.to_bytes()),))

    def without_peer_id(self) -> "Multiaddr":
        """This address without its final /p2p component (unchanged if it has none)."""
        if self.peer_id is None:
            return self
        return Multiaddr._from_parts(self._parts[:-1])

    @property
    def is_circuit(self) -> bool:
        """True for relayed addresses (they contain /p2p-circuit)."""
        return any(protocol.name == "p2p-circuit" for protocol, _ in self._parts)

    def __str__(self) -> str:
        if not self._parts:
            return "/"
        last = len(self._parts) - 1
        return "".join(
            _component_text(protocol, value, index == last)
            for index, (protocol, value) in enumerate(self._parts)
        )

    def __repr__(self) -> str:
        return f"Multiaddr({str(self)!r})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, Multiaddr):
            return NotImplemented
        return self._bytes == other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)


# --- helpers for transports ---------------------------------------------------------------------


def parse_host_port(maddr: "str | bytes | Multiaddr") -> tuple[str, int, str]:
    """(host, port, family) of a TCP address `/<ip4|ip6|dns|dns4|dns6>/<host>/tcp/<port>[/p2p/<id>]`.

    family is the host protocol's name ("ip4", "ip6", "dns", ...). Anything else (udp, websockets,
    circuits) is not dialable as plain TCP and raises MultiaddrError saying so.
    """
    addr = Multiaddr(maddr)
    parts = addr.components()
    rest = parts[2:]
    if rest and [name for name, _ in rest] == ["p2p"]:
        rest = []
    if len(parts) < 2 or parts[0][0] not in HOST_PROTOCOLS or parts[1][0] != "tcp" or rest:
        raise MultiaddrError(
            f"{addr} is not a TCP address: expected /ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>, "
            "optionally followed by /p2p/<peer id>"
        )
    (family, host), (_, port) = parts[0], parts[1]
    assert host is not None and port is not None  # host protocols and /tcp always carry a value
    return host, int(port), family


def from_socket_address(host: str, port: int) -> Multiaddr:
    """The /ip4 or /ip6 TCP multiaddr of a socket address, as getpeername() returns it.

    IPv4-mapped IPv6 addresses (from dual-stack sockets) become /ip4; an IPv6 scope (`fe80::1%eth0`)
    becomes an /ip6zone component, as the spec places it.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 0xFFFF:
        raise MultiaddrError(f"port {port!r} out of range (0 to 65535)")
    if not isinstance(host, str):
        raise MultiaddrError(f"host must be an IP address string, not {type(host).__name__}")
    zone = None
    if "%" in host:
        host, zone = host.split("%", 1)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise MultiaddrError(f"{_short(host)!r} is not an IP address") from None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip, zone = ip.ipv4_mapped, None
    if ip.version == 4:
        return Multiaddr(f"/ip4/{ip}/tcp/{port}")
    prefix = f"/ip6zone/{zone}" if zone else ""
    return Multiaddr(f"{prefix}/ip6/{ip.compressed}/tcp/{port}")
