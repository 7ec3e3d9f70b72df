"""Unsigned LEB128 varints, as used by multiformats, multistream-select and protobuf.

Decoding is bounded: at most 9 bytes (values below 2**63), per the multiformats unsigned-varint
spec, so a peer cannot make us loop over an endless run of continuation bytes.
"""

from ...errors import PeerMisbehaved

MAX_VARINT_BYTES = 9


class VarintError(PeerMisbehaved, ValueError):
    """The bytes do not hold a valid unsigned varint."""


class NeedMoreData(Exception):
    """The buffer ends in the middle of a varint; feed more bytes and try again."""


def encode_uvarint(value: int) -> bytes:
    if value < 0:
        raise VarintError(f"varints are unsigned, got {value}")
    if value >= 1 << (7 * MAX_VARINT_BYTES):
        raise VarintError(f"varint too large: {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_uvarint(data, offset: int = 0) -> tuple[int, int]:
    """Return (value, offset just past the varint). Raises NeedMoreData or VarintError."""
    value = shift = 0
    for index in range(offset, min(len(data), offset + MAX_VARINT_BYTES)):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and index > offset:
                raise VarintError("varint is not minimally encoded")
            return value, index + 1
        shift += 7
    if len(data) - offset >= MAX_VARINT_BYTES:
        raise VarintError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    raise NeedMoreData
