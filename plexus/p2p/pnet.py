"""Private networks (libp2p PSK v1): a pre-shared swarm key encrypts every byte of every connection.

Spec: libp2p specs pnet/Private-Networks-PSK-V1.md, as go-libp2p's pnet implements it. The key is
32 random bytes, kept in a file (`swarm.key`) of three lines:

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

(`/base64/` and `/bin/` encodings are read too). On every connection, before anything else, each
side sends a random 24-byte nonce, then XORs everything it sends with the XSalsa20 keystream of
(key, its own nonce); it reads the other side's nonce first and decrypts the rest with (key, that
nonce). Multistream, Noise and yamux all run inside. A stranger without the key sends bytes that
decrypt to noise (so its multistream header is garbage and the connection fails before Noise
starts) and reads noise from us. The key only decides who may talk at all; authentication stays
Noise's job. Relayed connections are protected the same way inside their circuit, as go-libp2p
does.

`PrivateNetworkLayer` sits between a transport (a socket, or a relay circuit's StreamTransport)
and a `Connection`: the transport's protocol on one side, the connection's transport on the other.
Received bytes land in the connection's own buffer and are decrypted there in place; sent bytes are
encrypted in place when they are in a buffer of ours, else copied once. XSalsa20 is libsodium's
(bundled with PyNaCl), called once per chunk, never per byte.
"""

import asyncio
import base64
import binascii
import ctypes
import hashlib
import os
from pathlib import Path
from typing import cast

from ..errors import UsageError

KEY_SIZE = 32
NONCE_SIZE = 24
BLOCK = 64  # XSalsa20 produces its keystream 64 bytes at a time
HEADER = "/key/swarm/psk/1.0.0/"
_NO_TARGET = memoryview(b"")  # between reads: holds no reference to the connection's buffer


class SwarmKeyError(UsageError):
    """A swarm key (file) that cannot be used; the message says what is wrong with it."""


# --- the key file ------------------------------------------------------------------------------------


def decode_swarm_key(data: bytes | str) -> bytes:
    """The 32-byte key of a swarm key file's contents."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    lines = raw.split(b"\n", 2)
    if len(lines) < 3 or lines[0].strip() != HEADER.encode():
        raise SwarmKeyError(f"not a swarm key: the first line must be {HEADER}")
    encoding, body = lines[1].strip(), lines[2]
    try:
        if encoding == b"/base16/":
            key = binascii.unhexlify(body.strip())
        elif encoding == b"/base64/":
            key = base64.b64decode(body.strip(), validate=True)
        elif encoding == b"/bin/":
            key = body
        else:
            raise SwarmKeyError(
                f"unknown swarm key encoding {encoding.decode(errors='replace')!r}: "
                f"use /base16/, /base64/ or /bin/"
            )
    except (binascii.Error, ValueError) as error:
        raise SwarmKeyError(f"the swarm key does not decode as {encoding.decode()}: {error}") from None
    if len(key) != KEY_SIZE:
        raise SwarmKeyError(f"a swarm key is {KEY_SIZE} bytes, this one is {len(key)}")
    return key


def encode_swarm_key(key: bytes) -> str:
    """The contents of a swarm key file (base16) for `key`."""
    if len(key) != KEY_SIZE:
        raise SwarmKeyError(f"a swarm key is {KEY_SIZE} bytes, not {len(key)}")
    return f"{HEADER}\n/base16/\n{key.hex()}\n"


def generate_swarm_key() -> bytes:
    return os.urandom(KEY_SIZE)


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """Read a swarm key file (e.g. the `swarm.key` that go-libp2p and IPFS use)."""
    try:
        return decode_swarm_key(Path(path).read_bytes())
    except OSError as error:
        raise SwarmKeyError(f"cannot read the swarm key file {path}: {error.strerror}") from None


def fingerprint(key: bytes) -> str:
    """A short, safe-to-log name of a key, to check that two peers hold the same one."""
    return hashlib.sha256(key).hexdigest()[:16]


# --- XSalsa20 ----------------------------------------------------------------------------------------


def _libsodium() -> ctypes.CDLL:
    try:
        import nacl._sodium
    except ImportError:
        raise SwarmKeyError("private networks need libsodium's XSalsa20: pip install pynacl") from None
    library = ctypes.CDLL(nacl._sodium.__file__)
    if library.sodium_init() < 0:
        raise SwarmKeyError("libsodium failed to initialise")
    function = library.crypto_stream_xsalsa20_xor_ic
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_ulonglong,
        ctypes.c_char_p,
        ctypes.c_uint64,
        ctypes.c_char_p,
    ]
    function.restype = ctypes.c_int
    return library


_sodium: ctypes.CDLL | None = None


class XSalsa20:
    """The XSalsa20 keystream of (key, nonce), applied in place to consecutive chunks of a stream."""

    def __init__(self, key: bytes, nonce: bytes):
        global _sodium
        if _sodium is None:
            _sodium = _libsodium()
        self._xor = _sodium.crypto_stream_xsalsa20_xor_ic
        self.key, self.nonce, self.position = bytes(key), bytes(nonce), 0
        self._scratch = bytearray(BLOCK)

    def apply(self, buffer) -> None:
        """XOR the next len(buffer) keystream bytes into `buffer` (writable), in place."""
        view = memoryview(buffer).cast("B")
        n = len(view)
        if not n:
            return
        offset, block = self.position % BLOCK, self.position // BLOCK
        done = 0
        if offset:  # finish the keystream block a previous chunk began
            done = min(BLOCK - offset, n)
            scratch = self._scratch
            scratch[offset : offset + done] = view[:done]
            address = ctypes.addressof((ctypes.c_char * BLOCK).from_buffer(scratch))
            self._xor(address, address, BLOCK, self.nonce, block, self.key)
            view[:done] = scratch[offset : offset + done]
            block += 1
        if done < n:
            address = ctypes.addressof((ctypes.c_char * (n - done)).from_buffer(view, done))
            self._xor(address, address, n - done, self.nonce, block, self.key)
        self.position += n


# --- the layer between a transport and a Connection -------------------------------------------------


class PrivateNetworkLayer(asyncio.BufferedProtocol, asyncio.Transport):
    """Protects one connection with a swarm key: the transport's protocol, and the connection's transport."""

    def __init__(self, key: bytes, connection: asyncio.BufferedProtocol):
        asyncio.Transport.__init__(self)
        self._key, self._connection = key, connection
        self._transport: asyncio.Transport  # the socket's, from connection_made
        self._nonce = bytearray(NONCE_SIZE)  # the other side's, read first
        self._nonce_read = 0
        self._send = XSalsa20(key, os.urandom(NONCE_SIZE))
        self._receive: XSalsa20 | None = None
        self._target = _NO_TARGET  # where the connection wants the bytes being read

    # --- as the transport's protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # a socket's
        self._transport = transport
        transport.write(self._send.nonce)
        self._connection.connection_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._receive is None:
            return memoryview(self._nonce)[self._nonce_read :]
        self._target = cast(memoryview, self._connection.get_buffer(sizehint))  # a Connection's is one
        return self._target

    def buffer_updated(self, nbytes: int) -> None:
        if self._receive is None:
            self._nonce_read += nbytes
            if self._nonce_read == NONCE_SIZE:
                self._receive = XSalsa20(self._key, bytes(self._nonce))
            return
        target, self._target = self._target, _NO_TARGET
        self._receive.apply(target[:nbytes])
        self._connection.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self._connection.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection.connection_lost(exc)

    def pause_writing(self) -> None:
        self._connection.pause_writing()

    def resume_writing(self) -> None:
        self._connection.resume_writing()

    # --- as the connection's transport ---------------------------------------------------------------

    def write(self, data) -> None:
        view = memoryview(data)
        if view.readonly:
            view = memoryview(bytearray(view))  # one copy, in C; ours to encrypt in place
        self._send.apply(view)
        self._transport.write(view)

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name, default=None):
        return self._transport.get_extra_info(name, default)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def get_protocol(self):
        return self._connection
