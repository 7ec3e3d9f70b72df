"""The libp2p-compatible transport: identity, multiaddrs, Host (TCP + Noise + yamux), streams, RPC,
private swarms."""

from ..utils.exports import lazy_exports

_EXPORTS = {
    "AccessToken": ".auth",
    "AuthorizationError": ".auth",
    "AuthorizerBase": ".auth",
    "SignedTokenAuthorizer": ".auth",
    "TokenAuthority": ".auth",
    "TokenAuthorizerBase": ".auth",
    "DialError": ".host",
    "Host": ".host",
    "HostOptions": ".host",
    "PeerInfo": ".host",
    "PeerID": ".identity",
    "PrivateKey": ".identity",
    "PublicKey": ".identity",
    "load_or_create_identity": ".identity",
    "Multiaddr": ".multiaddr",
    "MultiaddrError": ".multiaddr",
    "RPCError": ".rpc",
    "Stream": ".stream",
    "StreamClosedError": ".stream",
    "StreamError": ".stream",
    "StreamResetError": ".stream",
    "rpc": ".rpc",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
