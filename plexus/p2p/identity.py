"""Peer identity: Ed25519 keys in libp2p's protobuf key encoding, and libp2p peer ids.

Our own keys are always Ed25519. Other peers may use any key type libp2p defines, so public keys
of RSA, Secp256k1 and ECDSA are accepted for signature checks (go-libp2p nodes with old identities
still use RSA). A peer id is the multihash of the protobuf-encoded public key: the identity
multihash when that encoding is at most 42 bytes (every Ed25519 key: ids start with `12D3KooW`),
else sha2-256 (`Qm...`). Text forms: base58btc, or a CIDv1 with the libp2p-key codec in base32.
"""

import base64
import hashlib
import os
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from ..errors import PlexusError, UsageError
from .protocols import pb
from .protocols.varint import encode_uvarint

KEY_TYPES = {"RSA": 0, "Ed25519": 1, "Secp256k1": 2, "ECDSA": 3}
KEY_SCHEMA = {"type": (1, "uint"), "data": (2, "bytes")}
IDENTITY_MULTIHASH, SHA256_MULTIHASH = 0x00, 0x12
MAX_INLINE_KEY_LENGTH = 42
LIBP2P_KEY_CODEC = 0x72


class IdentityError(PlexusError, ValueError):
    """A key or peer id is malformed or of an unsupported kind."""


class PublicKey:
    """A peer's public key, of any libp2p key type, able to verify that peer's signatures."""

    def __init__(self, key_type: int, data: bytes):
        self.key_type, self.data = key_type, bytes(data)
        try:
            self._key = _load_public_key(key_type, self.data)
        except (ValueError, TypeError) as error:
            raise IdentityError(f"malformed public key of type {key_type}: {error}") from None

    @classmethod
    def from_protobuf(cls, data: bytes) -> "PublicKey":
        try:
            fields = pb.decode(KEY_SCHEMA, data)
        except pb.ProtobufError as error:
            raise IdentityError(f"malformed public key encoding: {error}") from None
        if "type" not in fields or "data" not in fields:
            raise IdentityError("public key encoding lacks its type or data field")
        return cls(fields["type"], fields["data"])

    def to_protobuf(self) -> bytes:
        # type and data are required proto2 fields, so type 0 (RSA) is still written out
        return _tagged_type(self.key_type) + _tagged_data(self.data)

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            if self.key_type == KEY_TYPES["Ed25519"]:
                self._key.verify(signature, message)
            elif self.key_type == KEY_TYPES["RSA"]:
                self._key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
            else:
                self._key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, PublicKey) and (self.key_type, self.data) == (other.key_type, other.data)

    def __hash__(self) -> int:
        return hash((self.key_type, self.data))

    def __repr__(self) -> str:
        return f"PublicKey(type={self.key_type}, data={self.data.hex()[:16]}…)"


def _tagged_type(key_type: int) -> bytes:
    return bytes([0x08]) + encode_uvarint(key_type)


def _tagged_data(data: bytes) -> bytes:
    return bytes([0x12]) + encode_uvarint(len(data)) + data


def _load_public_key(key_type: int, data: bytes):
    if key_type == KEY_TYPES["Ed25519"]:
        return ed25519.Ed25519PublicKey.from_public_bytes(data)
    if key_type == KEY_TYPES["RSA"]:
        key = serialization.load_der_public_key(data)
        if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 1024:
            raise ValueError("not an RSA key of at least 1024 bits")
        return key
    if key_type == KEY_TYPES["Secp256k1"]:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256K1(), data)
    if key_type == KEY_TYPES["ECDSA"]:
        key = serialization.load_der_public_key(data)
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError("not an ECDSA key")
        return key
    raise ValueError(f"unknown key type {key_type}")


class PrivateKey:
    """Our own Ed25519 key pair."""

    def __init__(self, key: ed25519.Ed25519PrivateKey):
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = PublicKey(KEY_TYPES["Ed25519"], raw)

    @classmethod
    def generate(cls) -> "PrivateKey":
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "PrivateKey":
        """The key whose 32-byte Ed25519 seed is `seed` (deterministic test identities)."""
        return cls(ed25519.Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_protobuf(cls, data: bytes) -> "PrivateKey":
        """Parse libp2p's private key encoding (the format of p2pd's `-id` files)."""
        try:
            fields = pb.decode(KEY_SCHEMA, data)
        except pb.ProtobufError as error:
            raise IdentityError(f"malformed private key encoding: {error}") from None
        if fields.get("type") != KEY_TYPES["Ed25519"]:
            raise IdentityError(f"only Ed25519 private keys are supported, got key type {fields.get('type')}")
        raw = fields.get("data", b"")
        if len(raw) not in (32, 64):  # go-libp2p stores seed || public key, 64 bytes
            raise IdentityError(f"an Ed25519 private key has 32 or 64 bytes, got {len(raw)}")
        key = cls.from_seed(raw[:32])
        if len(raw) == 64 and raw[32:] != key.public_key.data:
            raise IdentityError("the Ed25519 private key does not match the public key stored with it")
        return key

    def to_protobuf(self) -> bytes:
        seed = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return _tagged_type(KEY_TYPES["Ed25519"]) + _tagged_data(seed + self.public_key.data)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    @property
    def peer_id(self) -> "PeerID":
        return PeerID.from_public_key(self.public_key)


class PeerID:
    """A libp2p peer id: the multihash of a peer's public key. Compared and hashed by its bytes."""

    __slots__ = ("_b58", "_bytes")

    def __init__(self, multihash: bytes):
        multihash = bytes(multihash)
        _check_multihash(multihash)
        self._bytes = multihash
        self._b58: str | None = (
            None  # encoded on first use: peer ids are compared far more often than printed
        )

    @classmethod
    def from_public_key(cls, public_key: PublicKey) -> "PeerID":
        encoded = public_key.to_protobuf()
        if len(encoded) <= MAX_INLINE_KEY_LENGTH:
            return cls(bytes([IDENTITY_MULTIHASH, len(encoded)]) + encoded)
        return cls(bytes([SHA256_MULTIHASH, 32]) + hashlib.sha256(encoded).digest())

    @classmethod
    def from_base58(cls, text: str) -> "PeerID":
        try:
            return cls(base58.b58decode(text))
        except ValueError as error:
            raise IdentityError(f"{text!r} is not a base58 peer id: {error}") from None

    @classmethod
    def from_string(cls, text: str) -> "PeerID":
        """Parse a base58btc peer id (`12D3KooW…`, `Qm…`) or a CIDv1 in base32 (`bafz…`)."""
        if text.startswith(("1", "Qm")):
            return cls.from_base58(text)
        if text.startswith("b"):
            try:
                raw = base64.b32decode(text[1:].upper() + "=" * (-len(text[1:]) % 8))
            except ValueError:
                raise IdentityError(f"{text!r} is not a base32 CID") from None
            if len(raw) < 2 or raw[0] != 0x01 or raw[1] != LIBP2P_KEY_CODEC:
                raise IdentityError(f"{text!r} is not a CIDv1 with the libp2p-key codec")
            return cls(raw[2:])
        raise IdentityError(f"{text!r} is neither a base58btc peer id nor a base32 CID")

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._b58 is None:
            self._b58 = base58.b58encode(self._bytes).decode()
        return self._b58

    def to_cid(self) -> str:
        raw = bytes([0x01, LIBP2P_KEY_CODEC]) + self._bytes
        return "b" + base64.b32encode(raw).decode().lower().rstrip("=")

    def extract_public_key(self) -> PublicKey | None:
        """The public key inlined in an identity multihash, or None for hashed (large) keys."""
        if self._bytes[0] != IDENTITY_MULTIHASH:
            return None
        return PublicKey.from_protobuf(self._bytes[2:])

    def matches(self, public_key: PublicKey) -> bool:
        return PeerID.from_public_key(public_key) == self

    def short(self) -> str:
        return "…" + self.to_base58()[-6:]

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    def __eq__(self, other) -> bool:
        return isinstance(other, PeerID) and self._bytes == other._bytes

    def __lt__(self, other: "PeerID") -> bool:
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)


def _check_multihash(multihash: bytes) -> None:
    if len(multihash) < 2:
        raise IdentityError("a peer id multihash needs at least 2 bytes")
    code, length = multihash[0], multihash[1]
    if code not in (IDENTITY_MULTIHASH, SHA256_MULTIHASH):
        raise IdentityError(f"unsupported multihash code {code:#x} in peer id")
    if length != len(multihash) - 2 or (code == SHA256_MULTIHASH and length != 32):
        raise IdentityError(
            f"peer id multihash length {length} does not match its {len(multihash) - 2} bytes"
        )
    if code == IDENTITY_MULTIHASH and length > MAX_INLINE_KEY_LENGTH:
        raise IdentityError(
            f"identity multihash of {length} bytes exceeds the {MAX_INLINE_KEY_LENGTH}-byte limit"
        )


def load_or_create_identity(path: str | os.PathLike) -> PrivateKey:
    """Load our key from `path`, or create it there (mode 0600) so the peer keeps its id."""
    path = Path(path)
    if path.exists():
        try:
            return PrivateKey.from_protobuf(path.read_bytes())
        except IdentityError as error:
            raise UsageError(
                f"identity file {path} does not hold a libp2p private key ({error}); give another "
                f"identity_path, or move this file away to create a new identity there"
            ) from error
    path.parent.mkdir(parents=True, exist_ok=True)
    key = PrivateKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(key.to_protobuf())
    return key
