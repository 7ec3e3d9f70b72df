"""Which addresses a peer may make us dial: the rule behind AutoNAT dial-backs and hole punching.

AutoNAT (a peer asks us to dial it back) and DCUtR (a peer tells us where to dial it to punch
through NATs) let a remote peer name the addresses we connect to. Unchecked, that would make every
node a tool for reaching third hosts: port scans, floods reflected off the swarm. So we dial an
address that a peer names only if all of this holds:

1. It is TCP over IPv4 or IPv6 to a unicast address (not unspecified, multicast or broadcast).
2. Its IP is one the peer was observed at: the source IP of a direct connection it has with us,
   or, on a relayed connection, the IP the relay saw the peer's own connection come from (the relay
   reports it when it sets the circuit up; a relay is a peer we chose: we hold a reservation on it,
   or we dialed through it). A peer cannot forge where its packets come from, so this is proof.
3. It is not an address we know to be someone else's: one of ours, or where another peer we are
   connected to listens or connects from.

So a peer can make us dial only ports behind its own IP address, never ourselves, never a peer we
know. The AutoNAT v1 and DCUtR specs ask for (2) only. Ports are not proven: another host behind
the same IP (a NAT shared with the peer) can still be dialed, as every libp2p implementation
allows; each exchange dials a bounded number of addresses (AutoNAT also per peer per interval).
"""

import ipaddress
from collections.abc import Iterable

from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError, parse_host_port


def observed_ips(host, peer: PeerID) -> set[str]:
    """IPs that `peer`'s connections were seen coming from, by us or by the relays carrying them."""
    ips = set()
    for connection in host.connections_to(peer):
        if getattr(connection, "relayed", False):
            addrs = getattr(connection, "relay_observed_addrs", ())
        else:
            addrs = (connection.remote_addr,) if connection.remote_addr is not None else ()
        for addr in addrs:
            if (ip := _ip(addr)) is not None:
                ips.add(ip)
    return ips


def foreign_addrs(host, peer: PeerID) -> set[tuple[str, int]]:
    """(IP, port) pairs that belong to us or to other connected peers, never to be dialed for `peer`."""
    endpoints: set[tuple[str, int] | None] = set()
    for addr in host.get_listen_maddrs() + host.get_visible_maddrs():
        endpoints.add(_endpoint(addr))
    for other in host.connected_peers():
        if other == peer:
            continue
        info = host.peer_info(other)
        for addr in info.addrs if info else []:
            endpoints.add(_endpoint(addr))
        for connection in host.connections_to(other):
            if connection.remote_addr is not None and not getattr(connection, "relayed", False):
                endpoints.add(_endpoint(connection.remote_addr))
    return {endpoint for endpoint in endpoints if endpoint is not None}


def dialable(host, peer: PeerID, raw_addrs: Iterable[bytes]) -> tuple[list[Multiaddr], list[str]]:
    """The addresses named by `peer` (binary multiaddrs) that we may dial, and why the others are not."""
    ips, foreign = observed_ips(host, peer), foreign_addrs(host, peer)
    allowed, refused = [], []
    for raw in raw_addrs:
        try:
            addr = Multiaddr.from_bytes(raw)
            ip, port, _family = parse_host_port(addr)
        except MultiaddrError:
            refused.append(f"{raw[:32].hex()}…: not a TCP address")
            continue
        reason = _refusal(ip, port, ips, foreign)
        if reason is None:
            if addr not in allowed:
                allowed.append(addr)
        else:
            refused.append(f"{addr}: {reason}")
    return allowed, refused


def _refusal(ip: str, port: int, observed: set[str], foreign: set[tuple[str, int]]) -> str | None:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return "not an IP address"
    if address.is_unspecified or address.is_multicast or ip == "255.255.255.255" or not 0 < port < 65536:
        return "not a unicast address"
    if str(address) not in observed:
        return f"not on an IP the peer was observed at ({', '.join(sorted(observed)) or 'none'})"
    if (str(address), port) in foreign:
        return "it belongs to us or to another peer"
    return None


def _ip(addr: Multiaddr) -> str | None:
    try:
        return str(ipaddress.ip_address(parse_host_port(addr)[0]))
    except (MultiaddrError, ValueError):
        return None


def _endpoint(addr: Multiaddr) -> tuple[str, int] | None:
    try:
        ip, port, _ = parse_host_port(addr.without_peer_id())
        return str(ipaddress.ip_address(ip)), port
    except (MultiaddrError, ValueError):
        return None
