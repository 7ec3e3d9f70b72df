"""Noise: libp2p's secure channel, as a sans-I/O core (bytes in, bytes out).

Theory of operation
-------------------
Spec: libp2p noise-libp2p (github.com/libp2p/specs, noise/README.md, r4) on top of the Noise Protocol
Framework rev. 34 (noiseprotocol.org/noise.html, sections 5 "Processing rules" and 7.5 "XX"), with
the cipher suite libp2p uses, Noise_XX_25519_ChaChaPoly_SHA256, and an empty prologue.

Cipher functions. libp2p's "/noise" is ChaChaPoly, and every libp2p peer speaks it. Plexus peers
also speak Noise_XX_25519_AESGCM_SHA256 under their own protocol id (`AESGCM_SUITE`): the same
handshake and libp2p payloads with the Noise spec's AESGCM cipher function (AES-256-GCM, nonce = 4
zero bytes then the counter big-endian). With AES instructions it runs at 8-9 GB/s here against
ChaCha20-Poly1305's 3 GB/s, and encryption is a third of an all-reduce's CPU time. The connection
offers both, preferred first (multistream-select), so a peer that knows only "/noise" gets "/noise".

Wire: every handshake and transport message is a 2-byte big-endian length, then that many bytes
(at most 65535, the 16-byte authentication tag included). The XX pattern, three messages:

    initiator -> responder   msg1: e
    responder -> initiator   msg2: e, ee, s, es, payload
    initiator -> responder   msg3: s, se, payload

The payloads of msg2 and msg3 are protobuf NoiseHandshakePayload {identity_key = 1, identity_sig = 2,
extensions = 4}: the sender's libp2p public key and its signature over
b"noise-libp2p-static-key:" + its X25519 static public key. That binds the Noise static key to the
libp2p identity; the remote peer id is derived from identity_key. The initiator checks the responder
(and `expected_peer`) before it sends msg3, so it never reveals its own identity to an impostor.

States are named for what comes next:

    RESPONDER_EXPECT_MSG1 --msg1--> RESPONDER_EXPECT_MSG3 --msg3--> TRANSPORT
    INITIATOR_EXPECT_MSG2 --msg2 (msg3 queued)--------------------> TRANSPORT
    any state --bad input--> ERROR (terminal: every later receive_data/to_transport fails fast)

The initiator queues msg1 on construction. `_READERS` is the transition table: a state missing
from it cannot accept handshake frames. In TRANSPORT, bytes that arrive after the last handshake
frame are kept, uninterpreted, and handed to the NoiseTransport as `pending`.

Bounds: a frame is processed as soon as it is complete, so during the handshake we hold at most one
maximum frame plus its 2-byte length. Nonces are 64-bit counters; 2**64 - 1 is reserved by the spec
and using it is an error (after 2**64 - 1 messages, which no real connection reaches).

Left out: the optional extensions (WebTransport certhashes, early stream-muxer negotiation) are
neither sent nor read; their field is skipped on receipt. Other Noise patterns, DH and hash
functions are not supported. The core does no I/O and draws no randomness of
its own beyond X25519PrivateKey.generate() when no key is injected.
"""

import dataclasses
import enum
import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from ..identity import IdentityError, PeerID, PrivateKey, PublicKey
from . import pb
from .errors import LocalProtocolError, RemoteProtocolError

STATIC_KEY_PREFIX = b"noise-libp2p-static-key:"
MAX_MESSAGE = 65535  # ciphertext incl. tag, as the 2-byte length allows
TAG = 16
DH_LEN = 32
MAX_NONCE = 2**64 - 1  # reserved by the Noise spec: never used
PAYLOAD_SCHEMA = {"identity_key": (1, "bytes"), "identity_sig": (2, "bytes")}  # extensions (4): skipped

_LENGTH = struct.Struct(">H")
HASH_LEN = 32


@dataclasses.dataclass(frozen=True)
class CipherSuite:
    """A Noise cipher function, and the multistream protocol id under which peers agree on it."""

    protocol_id: str
    protocol_name: bytes  # Noise's name for the whole suite: hashed into the handshake
    aead: type  # a `cryptography` AEAD class taking a 32-byte key
    nonce: struct.Struct  # packs the 64-bit counter into the 12-byte nonce


CHACHAPOLY_SUITE = CipherSuite(
    "/noise", b"Noise_XX_25519_ChaChaPoly_SHA256", ChaCha20Poly1305, struct.Struct("<4xQ")
)
AESGCM_SUITE = CipherSuite(
    "/plexus/noise-aesgcm/1.0.0", b"Noise_XX_25519_AESGCM_SHA256", AESGCM, struct.Struct(">4xQ")
)
SUITES = {"AESGCM": AESGCM_SUITE, "ChaChaPoly": CHACHAPOLY_SUITE}  # by Noise's cipher name, preferred first


class NoiseError(RemoteProtocolError):
    """The peer's Noise messages are malformed, forged or out of order; drop the connection."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class State(enum.Enum):
    RESPONDER_EXPECT_MSG1 = "responder expecting msg1 (e)"
    RESPONDER_EXPECT_MSG3 = "responder expecting msg3 (s, se, payload)"
    INITIATOR_EXPECT_MSG2 = "initiator expecting msg2 (e, ee, s, es, payload)"
    TRANSPORT = "handshake complete"
    ERROR = "failed"


def _hkdf(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """Noise's HKDF with two outputs (HMAC-SHA256), as MixKey and Split use it."""
    temp = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    return out1, hmac.digest(temp, out1 + b"\x02", "sha256")


class _SymmetricState:
    """Noise's SymmetricState: chaining key, handshake hash and the current handshake cipher."""

    def __init__(self, suite: CipherSuite):
        self.suite = suite
        self.h = suite.protocol_name.ljust(HASH_LEN, b"\0")  # a name of at most HASH_LEN bytes, padded
        self.ck = self.h
        self.cipher = None
        self.n = 0
        self.mix_hash(b"")  # the empty prologue

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, key = _hkdf(self.ck, ikm)
        self.cipher, self.n = self.suite.aead(key), 0

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        if self.cipher is None:
            ciphertext = plaintext
        else:
            ciphertext = self.cipher.encrypt(self.suite.nonce.pack(self.n), plaintext, self.h)
            self.n += 1
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes, what: str) -> bytes:
        if self.cipher is None:
            plaintext = ciphertext
        else:
            try:
                plaintext = self.cipher.decrypt(self.suite.nonce.pack(self.n), ciphertext, self.h)
            except InvalidTag:
                raise NoiseError(
                    f"could not decrypt the peer's {what}: wrong key or tampered message"
                ) from None
            self.n += 1
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[bytes, bytes]:
        """The two transport keys: initiator-to-responder first."""
        return _hkdf(self.ck, b"")


def _x25519(seed: bytes | None, what: str) -> X25519PrivateKey:
    if seed is None:
        return X25519PrivateKey.generate()
    if len(seed) != DH_LEN:
        raise ValueError(f"{what} must be a {DH_LEN}-byte X25519 private key, got {len(seed)} bytes")
    return X25519PrivateKey.from_private_bytes(bytes(seed))


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _dh(local: X25519PrivateKey, remote: bytes) -> bytes:
    try:
        return local.exchange(X25519PublicKey.from_public_bytes(remote))
    except ValueError:  # a low-order point gives the all-zero secret, which cryptography refuses
        raise NoiseError("the peer sent an invalid X25519 public key (low-order point)") from None


class NoiseHandshake:
    """One side of a libp2p Noise XX handshake. Feed it the peer's bytes; send what it queues.

    Args:
        local_key: our libp2p identity, which signs our Noise static key.
        initiator: True on the dialing side; its msg1 is queued at once.
        expected_peer: the peer id we dialled, if known; any other identity is refused.
        suite: the cipher suite both sides agreed on (by its protocol id) before the handshake.
        static_key, ephemeral_key: 32-byte X25519 private keys to use instead of fresh random ones
            (for reproducible transcripts in tests; never reuse an ephemeral key in production).
    """

    def __init__(
        self,
        local_key: PrivateKey,
        *,
        initiator: bool,
        expected_peer: PeerID | None = None,
        suite: CipherSuite = CHACHAPOLY_SUITE,
        static_key: bytes | None = None,
        ephemeral_key: bytes | None = None,
    ):
        self.initiator = initiator
        self.expected_peer = expected_peer
        self.remote_peer_id: PeerID | None = None
        self.remote_public_key: PublicKey | None = None
        self._local_key = local_key
        self._static = _x25519(static_key, "static_key")
        self._static_public = _public_bytes(self._static)
        self._ephemeral = _x25519(ephemeral_key, "ephemeral_key")
        self._ephemeral_public = _public_bytes(self._ephemeral)
        self._remote_ephemeral = b""
        self._symmetric = _SymmetricState(suite)
        self._buffer = bytearray()
        self._outbox = bytearray()
        self._error: NoiseError | None = None
        self._handed_over = False
        if initiator:
            self.state = State.INITIATOR_EXPECT_MSG2
            self._write_msg1()
        else:
            self.state = State.RESPONDER_EXPECT_MSG1

    @property
    def complete(self) -> bool:
        """True once the handshake is done (for the initiator: once msg3 is queued)."""
        return self.state is State.TRANSPORT

    def __repr__(self) -> str:
        role = "initiator" if self.initiator else "responder"
        peer = f", peer={self.remote_peer_id.short()}" if self.remote_peer_id else ""
        return f"<NoiseHandshake {role} {self.state.name}{peer}>"

    # --- the driver's interface

    def receive_data(self, data) -> None:
        """Buffer the peer's bytes and process every complete handshake frame.

        Bytes past the last handshake frame are kept for the transport (`to_transport().pending`).
        Raises NoiseError if the peer's input is invalid; the handshake is then dead.
        """
        if self._error is not None:
            raise NoiseError(f"Noise handshake already failed ({self._error.reason}); close the connection")
        if self._handed_over:
            raise LocalProtocolError("receive_data after to_transport(): feed the NoiseTransport instead")
        self._buffer += data
        while self.state in _READERS and len(self._buffer) >= 2:
            (length,) = _LENGTH.unpack_from(self._buffer, 0)
            if len(self._buffer) < 2 + length:
                break
            frame = bytes(self._buffer[2 : 2 + length])
            del self._buffer[: 2 + length]
            reader, next_state = _READERS[self.state]
            try:
                reader(self, frame)
            except NoiseError as error:
                self._fail(error)
                raise
            self.state = next_state

    def data_to_send(self) -> bytes:
        """Drain the bytes queued for the peer (b"" if none; nothing is ever sent after an error)."""
        out = bytes(self._outbox)
        self._outbox.clear()
        return out

    def to_transport(self) -> "NoiseTransport":
        """The transport ciphers, once `complete`. Drain data_to_send() first: msg3 may be queued."""
        if self.state is not State.TRANSPORT or self._handed_over:
            raise LocalProtocolError(f"to_transport() needs a complete handshake once; {self!r}")
        self._handed_over = True
        initiator_key, responder_key = self._symmetric.split()
        if self.initiator:
            send_key, receive_key = initiator_key, responder_key
        else:
            send_key, receive_key = responder_key, initiator_key
        transport = NoiseTransport(
            send_key, receive_key, suite=self._symmetric.suite, pending=bytes(self._buffer)
        )
        transport.remote_peer_id, transport.remote_public_key = self.remote_peer_id, self.remote_public_key
        transport.handshake_hash = self._symmetric.h
        self._buffer = bytearray()
        return transport

    # --- messages, in the order they travel

    def _write_msg1(self) -> None:
        sym = self._symmetric
        sym.mix_hash(self._ephemeral_public)  # e
        self._queue(self._ephemeral_public + sym.encrypt_and_hash(b""))  # empty payload, in clear

    def _read_msg1(self, frame: bytes) -> None:
        if len(frame) < DH_LEN:
            raise NoiseError(f"msg1 must hold a {DH_LEN}-byte ephemeral key, got {len(frame)} bytes")
        sym = self._symmetric
        self._remote_ephemeral = frame[:DH_LEN]
        sym.mix_hash(self._remote_ephemeral)  # e
        sym.decrypt_and_hash(frame[DH_LEN:], "msg1 payload")  # no key yet: hashed in clear, ignored
        self._write_msg2()

    def _write_msg2(self) -> None:
        sym = self._symmetric
        sym.mix_hash(self._ephemeral_public)  # e
        sym.mix_key(_dh(self._ephemeral, self._remote_ephemeral))  # ee
        encrypted_static = sym.encrypt_and_hash(self._static_public)  # s
        sym.mix_key(_dh(self._static, self._remote_ephemeral))  # es
        payload = sym.encrypt_and_hash(self._payload())
        self._queue(self._ephemeral_public + encrypted_static + payload)

    def _read_msg2(self, frame: bytes) -> None:
        minimum = DH_LEN + (DH_LEN + TAG) + TAG
        if len(frame) < minimum:
            raise NoiseError(f"msg2 must be at least {minimum} bytes (e, s, payload), got {len(frame)}")
        sym = self._symmetric
        self._remote_ephemeral = frame[:DH_LEN]
        sym.mix_hash(self._remote_ephemeral)  # e
        sym.mix_key(_dh(self._ephemeral, self._remote_ephemeral))  # ee
        remote_static = sym.decrypt_and_hash(frame[DH_LEN : 2 * DH_LEN + TAG], "static key (msg2)")  # s
        sym.mix_key(_dh(self._ephemeral, remote_static))  # es
        payload = sym.decrypt_and_hash(frame[2 * DH_LEN + TAG :], "handshake payload (msg2)")
        self._verify_payload(payload, remote_static)
        self._write_msg3()

    def _write_msg3(self) -> None:
        sym = self._symmetric
        encrypted_static = sym.encrypt_and_hash(self._static_public)  # s
        sym.mix_key(_dh(self._static, self._remote_ephemeral))  # se
        self._queue(encrypted_static + sym.encrypt_and_hash(self._payload()))

    def _read_msg3(self, frame: bytes) -> None:
        minimum = (DH_LEN + TAG) + TAG
        if len(frame) < minimum:
            raise NoiseError(f"msg3 must be at least {minimum} bytes (s, payload), got {len(frame)}")
        sym = self._symmetric
        remote_static = sym.decrypt_and_hash(frame[: DH_LEN + TAG], "static key (msg3)")  # s
        sym.mix_key(_dh(self._ephemeral, remote_static))  # se
        payload = sym.decrypt_and_hash(frame[DH_LEN + TAG :], "handshake payload (msg3)")
        self._verify_payload(payload, remote_static)

    # --- the libp2p payload

    def _payload(self) -> bytes:
        signature = self._local_key.sign(STATIC_KEY_PREFIX + self._static_public)
        return pb.encode(
            PAYLOAD_SCHEMA,
            {"identity_key": self._local_key.public_key.to_protobuf(), "identity_sig": signature},
        )

    def _verify_payload(self, payload: bytes, remote_static: bytes) -> None:
        """Check that the peer's libp2p key signed its Noise static key, and that it is who we want."""
        try:
            fields = pb.decode(PAYLOAD_SCHEMA, payload)
        except pb.ProtobufError as error:
            raise NoiseError(f"malformed handshake payload: {error}") from None
        if "identity_key" not in fields or "identity_sig" not in fields:
            raise NoiseError("the handshake payload lacks the peer's identity key or signature")
        try:
            public_key = PublicKey.from_protobuf(fields["identity_key"])
            valid = public_key.verify(fields["identity_sig"], STATIC_KEY_PREFIX + remote_static)
        except (IdentityError, ValueError, TypeError) as error:
            raise NoiseError(f"unusable identity key in the handshake payload: {error}") from None
        if not valid:
            raise NoiseError("the peer's identity signature over its Noise static key is invalid")
        peer_id = PeerID.from_public_key(public_key)
        if self.expected_peer is not None and peer_id != self.expected_peer:
            raise NoiseError(
                f"peer id mismatch: expected {self.expected_peer}, but the remote is {peer_id}; "
                "the address may be stale or point to another node"
            )
        self.remote_public_key, self.remote_peer_id = public_key, peer_id

    # --- helpers

    def _queue(self, message: bytes) -> None:
        if len(message) > MAX_MESSAGE:  # only a huge local identity key could cause this
            raise LocalProtocolError(f"handshake message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        self._outbox += _LENGTH.pack(len(message))
        self._outbox += message

    def _fail(self, error: NoiseError) -> None:
        role = "initiator" if self.initiator else "responder"
        error.args = (f"Noise handshake ({role}, {self.state.value}) failed: {error.reason}",)
        self._error = error
        self.state = State.ERROR
        self._buffer.clear()
        self._outbox.clear()


# The transition table: which reader handles a frame in each state, and the state after it.
_READERS = {
    State.RESPONDER_EXPECT_MSG1: (NoiseHandshake._read_msg1, State.RESPONDER_EXPECT_MSG3),
    State.RESPONDER_EXPECT_MSG3: (NoiseHandshake._read_msg3, State.TRANSPORT),
    State.INITIATOR_EXPECT_MSG2: (NoiseHandshake._read_msg2, State.TRANSPORT),
}


class NoiseTransport:
    """The two transport ciphers after a handshake: seal frames to send, open frames received.

    Made by NoiseHandshake.to_transport(). Per-byte work happens in `cryptography`
    (encrypt_into/decrypt_into straight into the caller's buffers); per frame, Python builds one
    12-byte nonce. After a failed open_into every later call raises (the stream is unrecoverable).
    """

    MAX_PLAINTEXT = MAX_MESSAGE - TAG

    def __init__(
        self,
        send_key: bytes,
        receive_key: bytes,
        *,
        suite: CipherSuite = CHACHAPOLY_SUITE,
        pending: bytes = b"",
    ):
        self.suite = suite
        self._send = suite.aead(send_key)
        self._receive = suite.aead(receive_key)
        self._pack_nonce = suite.nonce.pack
        self._send_nonce = 0
        self._receive_nonce = 0
        self._error: NoiseError | None = None
        self.pending = pending  # ciphertext that arrived with the last handshake frame: open it first
        self.remote_peer_id: PeerID | None = None
        self.remote_public_key: PublicKey | None = None
        self.handshake_hash = b""  # for channel binding, if a protocol above ever needs it

    def __repr__(self) -> str:
        peer = self.remote_peer_id.short() if self.remote_peer_id else "?"
        return f"<NoiseTransport peer={peer} sent={self._send_nonce} received={self._receive_nonce}>"

    def seal_into(self, plaintext, out, offset: int) -> int:
        """Encrypt one message into out[offset:] as length + ciphertext + tag; return the new offset.

        `plaintext` is at most MAX_PLAINTEXT bytes; `out` must have room for len(plaintext) + 18.
        """
        size = len(plaintext)
        if size > self.MAX_PLAINTEXT:
            raise LocalProtocolError(f"Noise message of {size} bytes exceeds {self.MAX_PLAINTEXT}; split it")
        if self._send_nonce >= MAX_NONCE:
            raise LocalProtocolError("Noise send nonce exhausted; open a new connection")
        end = offset + 2 + size + TAG
        _LENGTH.pack_into(out, offset, size + TAG)
        destination = memoryview(out)[offset + 2 : end]
        self._send.encrypt_into(self._pack_nonce(self._send_nonce), plaintext, None, destination)
        self._send_nonce += 1
        return end

    def open_into(self, data, out) -> tuple[int, int]:
        """Decrypt every complete frame at the start of `data` into `out`, back to back.

        Returns (bytes consumed from data, plaintext bytes written to out). A trailing partial frame
        is left unconsumed: call again with it and more bytes. If `out` (normally at least len(data))
        fills up, stops early. Raises NoiseError on a bad tag, a frame shorter than the tag, or
        nonce exhaustion.
        """
        if self._error is not None:
            raise NoiseError(f"Noise transport already failed ({self._error.reason}); close the connection")
        data, out = memoryview(data), memoryview(out)
        consumed = written = 0
        available, room = len(data), len(out)
        decrypt_into, pack_nonce, nonce = self._receive.decrypt_into, self._pack_nonce, self._receive_nonce
        try:
            while available - consumed >= 2:
                (length,) = _LENGTH.unpack_from(data, consumed)
                if length < TAG:
                    raise NoiseError(f"Noise frame of {length} bytes is shorter than its {TAG}-byte tag")
                end = consumed + 2 + length
                if end > available:
                    break
                size = length - TAG
                if written + size > room:
                    if written == 0 and consumed == 0:
                        raise LocalProtocolError(f"open_into needs {size} bytes of room in out, has {room}")
                    break
                if nonce >= MAX_NONCE:
                    raise NoiseError("Noise receive nonce exhausted; the peer must open a new connection")
                try:
                    ciphertext, destination = data[consumed + 2 : end], out[written : written + size]
                    decrypt_into(pack_nonce(nonce), ciphertext, None, destination)
                except InvalidTag:
                    raise NoiseError(
                        f"Noise frame {nonce} failed authentication: tampered, reordered or not encrypted"
                    ) from None
                nonce += 1
                consumed, written = end, written + size
        except NoiseError as error:
            self._error = error
            raise
        finally:
            self._receive_nonce = nonce
        return consumed, written
