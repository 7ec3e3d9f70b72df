"""Signature-owned records: only the holder of an Ed25519 key may write records that name it.

A record is *owned* when its key or subkey bytes contain `[owner:<base64 of the libp2p protobuf
encoding of an Ed25519 public key>]` (in practice the subkey, since the key travels hashed). The
owner appends `[signature:<base64>]` to the value; the signature covers
msgpack((key, subkey, value without the signature, expiration_time)), so a signed value cannot be
replayed under another key, subkey or expiration. Records that name no owner always pass; a record
that names two different owners never does. This is how a peer's progress and metrics stay its own.
"""

import base64
import re

from ..p2p.identity import KEY_TYPES, IdentityError, PrivateKey, PublicKey
from ..utils.serializer import MSGPackSerializer
from .validation import DHTRecord, RecordValidatorBase

OWNER_PATTERN = re.compile(rb"\[owner:([A-Za-z0-9+/=]{1,256})\]")
SIGNATURE_PATTERN = re.compile(rb"\[signature:([A-Za-z0-9+/=]{1,256})\]$")


def owner_marker(public_key: PublicKey) -> bytes:
    return b"[owner:" + base64.b64encode(public_key.to_protobuf()) + b"]"


class SignatureValidator(RecordValidatorBase):
    """Signs records owned by our key; refuses owned records without their owner's valid signature.

    A subclass says how its owners are written (`owner_pattern`, the marker it passes in) and how a
    signature is made and checked (`_sign`, `_verify`); the rules above are the same for every key type.
    """

    owner_pattern: re.Pattern = OWNER_PATTERN
    signature_pattern: re.Pattern = SIGNATURE_PATTERN

    def __init__(self, marker: bytes):
        self._marker = marker

    @property
    def local_public_key(self) -> bytes:
        """The marker to put in a subkey (or key) to make a record ours: `[owner:...]`."""
        return self._marker

    def _sign(self, message: bytes) -> bytes:
        raise NotImplementedError

    def _verify(self, owner: bytes, message: bytes, signature: bytes) -> bool:
        """Whether `signature` of `message` is valid for the key written as `owner`; False if unreadable."""
        raise NotImplementedError

    def _owners(self, record: DHTRecord) -> set[bytes]:
        return set(self.owner_pattern.findall(record.key)) | set(self.owner_pattern.findall(record.subkey))

    @staticmethod
    def _signed_message(record: DHTRecord, stripped_value: bytes) -> bytes:
        return MSGPackSerializer.dumps((record.key, record.subkey, stripped_value, record.expiration_time))

    def validate(self, record: DHTRecord) -> bool:
        owners = self._owners(record)
        if not owners:
            return True
        if len(owners) > 1:
            return False
        match = self.signature_pattern.search(record.value)
        if match is None:
            return False
        try:
            signature = base64.b64decode(match.group(1), validate=True)
        except ValueError:
            return False
        message = self._signed_message(record, record.value[: match.start()])
        return self._verify(owners.pop(), message, signature)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._marker not in record.key and self._marker not in record.subkey:
            return record.value
        signature = self._sign(self._signed_message(record, record.value))
        return record.value + b"[signature:" + base64.b64encode(signature) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        # only owned records carry a signature; a plain value that happens to end alike is left alone
        match = self.signature_pattern.search(record.value) if self._owners(record) else None
        return record.value if match is None else record.value[: match.start()]

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # one signer per node and key type: a second validator for the same key adds nothing
        return type(other) is type(self) and other._marker == self._marker


class Ed25519SignatureValidator(SignatureValidator):
    """Signs with an Ed25519 key (the peer's identity, or a new one); Plexus's default signature."""

    def __init__(self, private_key: PrivateKey | None = None):
        self._private_key = private_key or PrivateKey.generate()
        super().__init__(owner_marker(self._private_key.public_key))

    def _sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)

    def _verify(self, owner: bytes, message: bytes, signature: bytes) -> bool:
        try:
            public_key = PublicKey.from_protobuf(base64.b64decode(owner, validate=True))
        except (IdentityError, ValueError):
            return False
        return public_key.key_type == KEY_TYPES["Ed25519"] and public_key.verify(signature, message)
