"""The libp2p identify message (`/ipfs/id/1.0.0`, `/ipfs/id/push/1.0.0`).

The responder writes one varint-length-prefixed protobuf and closes the stream. We send our
public key, listen addresses, supported protocols and the address we observed the peer at; we
accept (and ignore) signed peer records. Addresses travel in binary multiaddr form.
"""

from . import pb
from .errors import RemoteProtocolError

IDENTIFY_PROTOCOL = "/ipfs/id/1.0.0"
IDENTIFY_PUSH_PROTOCOL = "/ipfs/id/push/1.0.0"
MAX_IDENTIFY_SIZE = 64 << 10
PROTOCOL_VERSION = "ipfs/0.1.0"

SCHEMA = {
    "public_key": (1, "bytes"),
    "listen_addrs": (2, "bytes*"),
    "protocols": (3, "string*"),
    "observed_addr": (4, "bytes"),
    "protocol_version": (5, "string"),
    "agent_version": (6, "string"),
    "signed_peer_record": (8, "bytes"),
}


def encode_identify(fields: dict) -> bytes:
    return pb.encode(SCHEMA, fields)


def decode_identify(data: bytes) -> dict:
    if len(data) > MAX_IDENTIFY_SIZE:
        raise RemoteProtocolError(f"identify message of {len(data)} bytes exceeds {MAX_IDENTIFY_SIZE}")
    try:
        return pb.decode(SCHEMA, data)
    except pb.ProtobufError as error:
        raise RemoteProtocolError(f"malformed identify message: {error}") from None
