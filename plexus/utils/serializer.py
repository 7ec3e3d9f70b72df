"""MessagePack with tuples kept as tuples: the one encoding for DHT keys, subkeys and values.

Plain msgpack turns tuples into lists, so a value stored as `(host, port)` would come back as
`[host, port]` and compare unequal. We pack with `strict_types=True`, which sends tuples (and any
subclass of a built-in type) to `default`; there a tuple becomes extension type 0x40 holding the
packed list of its items. Anything else that msgpack cannot pack natively is refused with a
TypeError that names the type, rather than guessed at.

Decoding data from peers is bounded: a size cap, msgpack's own nesting limit inside one buffer,
and a cap on how deeply tuple extensions may nest (each nests a fresh `unpackb` call). Every failure
is a `SerializationError`, never a stray msgpack/TypeError/RecursionError.
"""

from typing import Any

import msgpack

from ..errors import PeerMisbehaved

TUPLE_EXT_CODE = 0x40
MAX_SERIALIZED_SIZE = 16 * 1024 * 1024
MAX_TUPLE_DEPTH = 32


class SerializationError(PeerMisbehaved, ValueError):
    """Bytes that are not valid msgpack for us, or a value we cannot encode."""


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE_EXT_CODE, _packb(list(obj)))
    raise TypeError(f"cannot serialize {type(obj).__name__} with MSGPackSerializer (use built-in types)")


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)


class MSGPackSerializer:
    """`dumps` any msgpack-native data plus tuples; `loads` it back, refusing oversized or odd input."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        try:
            return _packb(obj)
        except (TypeError, ValueError, OverflowError) as error:
            raise SerializationError(f"cannot serialize {type(obj).__name__}: {error}") from None

    @staticmethod
    def loads(data: bytes, max_size: int = MAX_SERIALIZED_SIZE) -> Any:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SerializationError(f"expected bytes to deserialize, got {type(data).__name__}")
        if len(data) > max_size:
            raise SerializationError(
                f"serialized value of {len(data)} bytes exceeds the {max_size}-byte limit"
            )
        depth = 0

        def ext_hook(code: int, payload: bytes) -> Any:
            nonlocal depth
            if code != TUPLE_EXT_CODE:
                raise SerializationError(f"unknown msgpack extension type {code:#x}")
            depth += 1
            if depth > MAX_TUPLE_DEPTH:
                raise SerializationError(f"tuples nested deeper than {MAX_TUPLE_DEPTH} levels")
            try:
                items = _unpackb(payload, ext_hook)
            finally:
                depth -= 1
            if not isinstance(items, list):
                raise SerializationError("a tuple extension must hold a msgpack array")
            return tuple(items)

        try:
            return _unpackb(data, ext_hook)
        except SerializationError:
            raise
        except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as error:
            raise SerializationError(f"malformed msgpack data: {type(error).__name__}: {error}") from None


def _unpackb(data: bytes, ext_hook) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook)
