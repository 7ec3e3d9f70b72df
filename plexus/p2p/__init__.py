"""The libp2p-compatible transport: identity, multiaddrs, Host (TCP + Noise + yamux), streams and RPC."""

from . import rpc
from .host import DialError, Host, HostOptions, PeerInfo
from .identity import PeerID, PrivateKey, PublicKey, load_or_create_identity
from .multiaddr import Multiaddr, MultiaddrError
from .rpc import RPCError
from .stream import Stream, StreamClosedError, StreamError, StreamResetError

__all__ = [
    "DialError", "Host", "HostOptions", "Multiaddr", "MultiaddrError", "PeerID", "PeerInfo", "PrivateKey",
    "PublicKey", "RPCError", "Stream", "StreamClosedError", "StreamError", "StreamResetError",
    "load_or_create_identity", "rpc",
]
