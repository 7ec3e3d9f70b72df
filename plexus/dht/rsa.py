"""RSA-signed records, for peers that keep hivemind's RSA keys: `RSASignatureValidator`, `RSAPrivateKey`.

Ed25519 (`crypto.py`) is Plexus's default signature; this validator is the same idea with RSA keys,
in hivemind's format, for swarms whose records and tooling already expect it. A record is owned
when its key or subkey contains `[owner:ssh-rsa <base64>]` (the owner's public key in OpenSSH
form); the owner appends `[signature:<base64 RSA-PSS/SHA-256>]` over msgpack((key, subkey, value,
expiration_time)). The two validators cannot be confused: an Ed25519 marker never contains a space,
an RSA one always does. Records that name no RSA owner pass; one that names two different owners
never does.

`RSASignatureValidator()` without a key signs with `RSAPrivateKey.process_wide()`, one key per
process as in hivemind (pass a key to keep identities apart). Validators and keys pickle with the
private key, so a validator can be handed to another process.
"""

from __future__ import annotations

import re
import threading

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from .crypto import SignatureValidator

RSA_KEY_SIZE = 2048
OWNER_PATTERN = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/=]{1,2048})\]")
SIGNATURE_PATTERN = re.compile(rb"\[signature:([A-Za-z0-9+/=]{1,2048})\]$")
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class RSAPublicKey:
    def __init__(self, key: rsa.RSAPublicKey):
        self._key = key

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            self._key.verify(signature, data, _PADDING, hashes.SHA256())
            return True
        except InvalidSignature:
            return False

    def to_bytes(self) -> bytes:
        """OpenSSH form, `ssh-rsa AAAA...`: what an owner marker holds."""
        return self._key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    @classmethod
    def from_bytes(cls, data: bytes) -> RSAPublicKey:
        key = serialization.load_ssh_public_key(data)
        if not isinstance(key, rsa.RSAPublicKey):
            raise TypeError("not an RSA public key")
        return cls(key)

    def __eq__(self, other) -> bool:
        return isinstance(other, RSAPublicKey) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())


class RSAPrivateKey:
    """A 2048-bit RSA key (a new one unless loaded); `process_wide()` is the process's shared key."""

    _process_wide: RSAPrivateKey | None = None
    _process_wide_lock = threading.Lock()

    def __init__(self, key: rsa.RSAPrivateKey | None = None):
        self._key = key if key is not None else rsa.generate_private_key(65537, RSA_KEY_SIZE)

    @classmethod
    def process_wide(cls) -> RSAPrivateKey:
        with cls._process_wide_lock:
            if cls._process_wide is None:
                cls._process_wide = cls()
            return cls._process_wide

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data, _PADDING, hashes.SHA256())

    def get_public_key(self) -> RSAPublicKey:
        return RSAPublicKey(self._key.public_key())

    def to_bytes(self) -> bytes:
        """PKCS#8 DER, unencrypted: keep it private."""
        return self._key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RSAPrivateKey:
        key = serialization.load_der_private_key(data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise TypeError("not an RSA private key")
        return cls(key)

    def __getstate__(self):
        return {"key": self.to_bytes()}

    def __setstate__(self, state):
        self._key = self.from_bytes(state["key"])._key


class RSASignatureValidator(SignatureValidator):
    """Signs records owned by our RSA key; refuses RSA-owned records without their owner's signature."""

    owner_pattern = OWNER_PATTERN
    signature_pattern = SIGNATURE_PATTERN

    def __init__(self, private_key: RSAPrivateKey | None = None):
        self._private_key = private_key if private_key is not None else RSAPrivateKey.process_wide()
        super().__init__(b"[owner:" + self._private_key.get_public_key().to_bytes() + b"]")

    def _sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)

    def _verify(self, owner: bytes, message: bytes, signature: bytes) -> bool:
        try:
            public_key = RSAPublicKey.from_bytes(owner)
        except (ValueError, TypeError):  # cryptography's parse errors for a malformed key
            return False
        return public_key.verify(message, signature)
