"""multistream-select 1.0: agree on the protocol spoken next on a connection or stream.

Theory of operation
-------------------
Spec: github.com/multiformats/multistream-select (README, "Protocol" and "Listing") and the
libp2p connection-establishment doc. Every message is `uvarint(len) + utf-8 text + "\\n"`, where the
length counts the newline. Both sides first say the header "/multistream/1.0.0". The dialer then
proposes protocol ids one at a time; the listener echoes a supported id (accepted) or says "na".

Like go-libp2p, the dialer is "lazy": its header and its first proposal leave in one write,
without waiting for the listener's header. It does not pipeline more than that: the next proposal is
sent only after "na", so an acceptance is never ambiguous.

Dialer states:   EXPECT_HEADER -> EXPECT_REPLY (-> EXPECT_REPLY after "na") -> DONE
Listener states: EXPECT_HEADER -> EXPECT_PROPOSAL (-> again after "na" or "ls") -> DONE
Any state + malformed or unexpected message -> FAILED (NegotiationError; later calls fail fast).

Once DONE, the bytes that arrived after the acceptance are in `unused_data`: they belong to the
selected protocol (for example the first Noise handshake message sent right after the proposal).
Feeding a DONE core more bytes is a driver bug (LocalProtocolError): route them to the next layer.

Bounds: a message is at most MAX_MESSAGE bytes (the core buffers at most one message), and a
listener answers at most MAX_PROPOSALS proposals before giving up on the peer.

Left out: the "multistream/2.0" draft, simultaneous-open ("iamclient"), and "ls" on the dialer
side (the listener answers "ls", go-multistream style: one message holding one length-prefixed
line per protocol, then a final newline).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from enum import Enum

from plexus.p2p.protocols.errors import LocalProtocolError, RemoteProtocolError
from plexus.p2p.protocols.varint import NeedMoreData, VarintError, decode_uvarint, encode_uvarint

__all__ = [
    "HEADER",
    "MAX_MESSAGE",
    "MAX_PROPOSALS",
    "MultistreamDialer",
    "MultistreamListener",
    "NegotiationError",
    "encode_message",
]

HEADER = "/multistream/1.0.0"
NA = "na"
LS = "ls"
MAX_MESSAGE = 1024  # bytes of text + newline in one message; protocol ids are short
MAX_PROPOSALS = 64  # a listener refuses this many proposals, then drops the peer


class NegotiationError(RemoteProtocolError):
    """The peer broke multistream-select, or no protocol could be agreed on."""

    def __init__(self, message: str, tried: tuple[str, ...] = ()):
        super().__init__(message)
        self.tried = tried


class _State(Enum):
    EXPECT_HEADER = "EXPECT_HEADER"
    EXPECT_REPLY = "EXPECT_REPLY"  # dialer: waiting for echo or "na"
    EXPECT_PROPOSAL = "EXPECT_PROPOSAL"  # listener
    DONE = "DONE"
    FAILED = "FAILED"


def _check_protocol_id(protocol: str) -> None:
    if not isinstance(protocol, str) or not protocol:
        raise LocalProtocolError(f"a protocol id must be a non-empty string, got {protocol!r}")
    if "\n" in protocol:
        raise LocalProtocolError(f"a protocol id cannot contain a newline: {protocol!r}")
    if len(protocol.encode()) + 1 > MAX_MESSAGE:
        raise LocalProtocolError(f"protocol id longer than {MAX_MESSAGE - 1} bytes: {protocol[:40]!r}...")


def encode_message(text: str) -> bytes:
    """Frame one message: uvarint length (newline included), the UTF-8 text, a newline."""
    body = text.encode() + b"\n"
    return encode_uvarint(len(body)) + body


class _MessageReader:
    """Splits a byte stream into messages; holds at most one incomplete message."""

    def __init__(self, role: str):
        self._role = role
        self._buffer = bytearray()

    def feed(self, data) -> None:
        self._buffer += data

    def next_message(self) -> str | None:
        """Return the next complete message text (newline stripped), or None if incomplete."""
        buffer = self._buffer
        try:
            length, start = decode_uvarint(buffer)
        except NeedMoreData:
            return None
        except VarintError as exc:
            raise NegotiationError(f"{self._role}: bad message length prefix ({exc})") from None
        if length > MAX_MESSAGE:
            raise NegotiationError(
                f"{self._role}: peer announced a {length}-byte message, more than the {MAX_MESSAGE}-byte "
                "limit; it does not speak multistream-select 1.0 (or sent garbage)"
            )
        if len(buffer) - start < length:
            return None
        body = bytes(buffer[start : start + length])
        del buffer[: start + length]
        if not body.endswith(b"\n"):
            raise NegotiationError(f"{self._role}: message {body[:40]!r} does not end with a newline")
        try:
            text = body[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise NegotiationError(f"{self._role}: message {body[:40]!r} is not valid UTF-8") from None
        if "\n" in text:
            raise NegotiationError(f"{self._role}: message {text[:40]!r} has a newline inside")
        return text

    def take_rest(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest

    def buffered(self) -> int:
        return len(self._buffer)


class _Core:
    """Shared plumbing: output queue, terminal-state handling."""

    _role = "?"

    def __init__(self) -> None:
        self._reader = _MessageReader(self._role)
        self._out = bytearray()
        self._state = _State.EXPECT_HEADER
        self.selected: str | None = None
        self.unused_data: bytes = b""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state.value} selected={self.selected!r}>"

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def data_to_send(self) -> bytes:
        """Drain the bytes queued for the peer."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def buffered_bytes(self) -> int:
        """Bytes held while waiting for the rest of a message (at most one message's worth)."""
        return self._reader.buffered()

    def receive_data(self, data) -> None:
        """Feed bytes from the peer; raises NegotiationError if they break the protocol."""
        if self._state is _State.FAILED:
            raise NegotiationError(f"{self._role}: negotiation already failed")
        if self._state is _State.DONE:
            raise LocalProtocolError(
                f"{self._role}: negotiation is finished ({self.selected!r}); "
                "pass further bytes to that protocol"
            )
        self._reader.feed(data)
        try:
            while self._state is not _State.DONE:
                text = self._reader.next_message()
                if text is None:
                    break
                self._handle(text)
        except RemoteProtocolError:
            self._state = _State.FAILED
            raise
        if self._state is _State.DONE:
            self.unused_data = self._reader.take_rest()

    def _expect_header(self, text: str) -> None:
        if text != HEADER:
            raise NegotiationError(
                f"{self._role}: expected the header {HEADER!r}, got {text[:60]!r}; the peer does not speak "
                "multistream-select 1.0"
            )

    def _handle(self, text: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class MultistreamDialer(_Core):
    """The side that proposes protocols, in order of preference."""

    _role = "dialer"

    def __init__(self, protocols: list[str]):
        super().__init__()
        protocols = list(protocols)
        if not protocols:
            raise LocalProtocolError("the dialer needs at least one protocol to propose")
        if len(protocols) > MAX_PROPOSALS:
            raise LocalProtocolError(
                f"at most {MAX_PROPOSALS} protocols can be proposed, got {len(protocols)}"
            )
        for protocol in protocols:
            _check_protocol_id(protocol)
        self._protocols = protocols
        self._next = 1  # index of the protocol to propose after the next "na"
        self._out += encode_message(HEADER) + encode_message(protocols[0])  # lazy: one write

    @property
    def proposed(self) -> str:
        """The protocol currently waiting for an answer."""
        return self._protocols[self._next - 1]

    def _handle(self, text: str) -> None:
        if self._state is _State.EXPECT_HEADER:
            self._expect_header(text)
            self._state = _State.EXPECT_REPLY
            return
        # EXPECT_REPLY
        if text == self.proposed:
            self.selected = text
            self._state = _State.DONE
        elif text == NA:
            if self._next >= len(self._protocols):
                tried = tuple(self._protocols)
                raise NegotiationError(
                    f"the peer supports none of the protocols we proposed: {', '.join(tried)}; "
                    "is it running the same application (and version)?",
                    tried=tried,
                )
            self._out += encode_message(self._protocols[self._next])
            self._next += 1
        else:
            raise NegotiationError(
                f"dialer: proposed {self.proposed!r} and the peer answered {text[:60]!r} "
                "(expected the same id or 'na')"
            )


class MultistreamListener(_Core):
    """The side that accepts one of the protocols it supports."""

    _role = "listener"

    def __init__(self, supported: Collection[str] | Callable[[str], bool]):
        super().__init__()
        if callable(supported):
            self._supports = supported
            self._listing: list[str] = []
        else:
            listing = list(supported)
            for protocol in listing:
                _check_protocol_id(protocol)
            names = frozenset(listing)
            self._supports = names.__contains__
            self._listing = listing
        self._refused = 0
        self._out += encode_message(HEADER)  # go-multistream also speaks first; saves nothing to wait for

    def _handle(self, text: str) -> None:
        if self._state is _State.EXPECT_HEADER:
            self._expect_header(text)
            self._state = _State.EXPECT_PROPOSAL
            return
        # EXPECT_PROPOSAL
        if text == LS:
            self._out += self._ls_reply()
        elif text and text != NA and text != HEADER and self._supports(text):
            self._out += encode_message(text)
            self.selected = text
            self._state = _State.DONE
            return
        else:
            self._out += encode_message(NA)
        self._refused += 1
        if self._refused > MAX_PROPOSALS:
            raise NegotiationError(
                f"listener: the peer sent more than {MAX_PROPOSALS} proposals without agreeing on one"
            )

    def _ls_reply(self) -> bytes:
        """One message whose text is the length-prefixed lines of our protocols (go-multistream)."""
        body = b""
        for protocol in self._listing:
            line = encode_message(protocol)
            if len(body) + len(line) + 1 > MAX_MESSAGE:
                break  # the peer would reject a longer message; the list is advisory anyway
            body += line
        body += b"\n"
        return encode_uvarint(len(body)) + body
