"""A minimal protobuf (proto2/proto3 wire format) codec for the few small messages libp2p needs.

libp2p's key encoding, the Noise handshake payload, identify and the relay/DCUtR/AutoNAT messages are
all tiny protobufs. Rather than depend on generated code, each message is described by a schema:
a dict from field name to (field number, kind), with kind one of "uint" (varint), "bool",
"bytes", "string", "message:<schema name>" handled by the caller, and a trailing "*" for repeated.
Unknown fields are skipped, as protobuf requires; malformed input raises ProtobufError.
"""

from ...errors import PeerMisbehaved
from .varint import NeedMoreData, VarintError, decode_uvarint, encode_uvarint

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


class ProtobufError(PeerMisbehaved, ValueError):
    """The bytes are not a well-formed protobuf message of the expected shape."""


def encode(schema: dict, values: dict) -> bytes:
    """Encode `values` (field name -> value; None or missing means absent) with `schema`."""
    out = bytearray()
    for name, (number, kind) in schema.items():
        value = values.get(name)
        if value is None:
            continue
        repeated = kind.endswith("*")
        for item in value if repeated else (value,):
            _encode_field(out, number, kind.rstrip("*"), item)
    return bytes(out)


def _encode_field(out: bytearray, number: int, kind: str, value) -> None:
    if kind in ("uint", "bool"):
        out += encode_uvarint(number << 3 | VARINT)
        out += encode_uvarint(int(value))
        return
    if kind == "string":
        value = value.encode()
    elif kind not in ("bytes", "message"):
        raise ValueError(f"unknown protobuf field kind {kind!r}")
    out += encode_uvarint(number << 3 | LENGTH_DELIMITED)
    out += encode_uvarint(len(value))
    out += value


def decode(schema: dict, data) -> dict:
    """Decode `data` into a dict of the schema's field names. Repeated fields become lists."""
    by_number = {number: (name, kind) for name, (number, kind) in schema.items()}
    result: dict = {name: [] for name, (_, kind) in schema.items() if kind.endswith("*")}
    data = memoryview(data)
    offset = 0
    value: int | bytes
    try:
        while offset < len(data):
            tag, offset = decode_uvarint(data, offset)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == VARINT:
                value, offset = decode_uvarint(data, offset)
            elif wire_type == LENGTH_DELIMITED:
                length, offset = decode_uvarint(data, offset)
                if offset + length > len(data):
                    raise ProtobufError("length-delimited field runs past the end of the message")
                value, offset = bytes(data[offset : offset + length]), offset + length
            elif wire_type in (FIXED64, FIXED32):
                offset += 8 if wire_type == FIXED64 else 4
                if offset > len(data):
                    raise ProtobufError("fixed-width field runs past the end of the message")
                continue
            else:
                raise ProtobufError(f"unsupported wire type {wire_type} in field {number}")
            if number not in by_number:
                continue
            name, kind = by_number[number]
            result_value = _convert(kind.rstrip("*"), value, wire_type, name)
            if kind.endswith("*"):
                result[name].append(result_value)
            else:
                result[name] = result_value
    except (NeedMoreData, VarintError) as error:
        raise ProtobufError(f"malformed varint in protobuf message: {error!r}") from None
    return result


def _convert(kind: str, value, wire_type: int, name: str):
    expected = VARINT if kind in ("uint", "bool") else LENGTH_DELIMITED
    if wire_type != expected:
        raise ProtobufError(f"field {name!r} has wire type {wire_type}, expected {expected}")
    if kind == "bool":
        return bool(value)
    if kind == "string":
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise ProtobufError(f"field {name!r} is not valid UTF-8") from None
    return value
