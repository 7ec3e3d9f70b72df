"""The libp2p-compatible transport: identity, multiaddrs, Host (TCP + Noise + yamux), streams, RPC,
private swarms."""

from . import rpc
from .auth import (
    AccessToken,
    AuthorizationError,
    AuthorizerBase,
    SignedTokenAuthorizer,
    TokenAuthority,
    TokenAuthorizerBase,
)
from .host import DialError, Host, HostOptions, PeerInfo
from .identity import PeerID, PrivateKey, PublicKey, load_or_create_identity
from .multiaddr import Multiaddr, MultiaddrError
from .rpc import RPCError
from .stream import Stream, StreamClosedError, StreamError, StreamResetError

__all__ = [
    "AccessToken",
    "AuthorizationError",
    "AuthorizerBase",
    "DialError",
    "Host",
    "HostOptions",
    "Multiaddr",
    "MultiaddrError",
    "PeerID",
    "PeerInfo",
    "PrivateKey",
    "PublicKey",
    "RPCError",
    "SignedTokenAuthorizer",
    "Stream",
    "StreamClosedError",
    "StreamError",
    "StreamResetError",
    "TokenAuthority",
    "TokenAuthorizerBase",
    "load_or_create_identity",
    "rpc",
]
