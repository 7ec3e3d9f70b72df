"""How many routing-table entries one network may hold: an IP diversity rule against Sybils.

Theory of operation. A DHT id costs nothing to make, so one machine can run hundreds of
identities and fill every honest routing table with them (a Sybil attack); frozen, they then make
lookups wait on silence, and live, they can steer lookups. Addresses are scarcer than ids, so
S/Kademlia (Baumgart & Mies 2007, section 4) and libp2p's kad-dht peer diversity filter bound how
many entries may share a network. Here each peer's IP (as the transport saw its connection) maps
to a *group*:

- a public IPv4 address to its /24 and a public IPv6 address to its /48 (what one operator, one
  cloud tenant or one home line usually holds);
- an address in `per_address_networks` (the private ranges: RFC 1918, CGNAT, link-local, ULA) to
  itself alone: a LAN gives each machine an address of its own, so a LAN swarm is not throttled,
  while one machine on it still gets no more than its share;
- an address in `exempt_networks` (loopback by default: tests and swarms on one machine) to no
  group, and so does a peer whose address is unknown (reached through a relay, or on an in-memory
  network without addresses): those are not limited.

The routing table admits a peer while its group holds fewer than `max_per_bucket` of the peers at
its distance (the same common-prefix length with our id, as kad-dht counts: one k-bucket of a
fully split table) and fewer than `max_per_table` entries in the whole table; otherwise it refuses
the peer (it is not even kept as a replacement), and the refusal is logged. A group already at
its bounds keeps the entries it has: those peers answered first, and eviction of silent ones
makes room again. No I/O here: the transport supplies addresses, the table counts.
"""

import dataclasses
import ipaddress
from functools import cached_property


@dataclasses.dataclass(frozen=True)
class DiversityOptions:
    """Bounds on routing-table entries per network (see the module docstring). `None` disables a bound."""

    max_per_bucket: int | None = 2
    """Peers of one group at one distance from us: with one common-prefix length with our id, i.e.
    in one k-bucket of a fully split table (libp2p's kad-dht allows 2 per common-prefix length)."""
    max_per_table: int | None = 8
    """Entries of one group in the whole table: room for a few honest peers behind one /24, far
    from the hundreds of slots a Sybil operator would take."""
    ipv4_prefix: int = 24
    """A public IPv4 address belongs to the group of this prefix (one operator's network)."""
    ipv6_prefix: int = 48
    """A public IPv6 address belongs to the group of this prefix (one site's allocation)."""
    per_address_networks: tuple[str, ...] = (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
    """Private ranges, where one subnet is a LAN of distinct machines: each address is a group of its own."""
    exempt_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    """Networks not limited at all (loopback: local tests and single-machine swarms). Pass () to
    limit loopback peers too, e.g. to run a Sybil experiment on one machine."""

    def __post_init__(self):
        for name in ("max_per_bucket", "max_per_table"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"DiversityOptions.{name} must be None or at least 1, got {value}")
        if not 0 <= self.ipv4_prefix <= 32 or not 0 <= self.ipv6_prefix <= 128:
            raise ValueError(
                f"DiversityOptions prefixes must be in [0, 32] and [0, 128], got "
                f"{self.ipv4_prefix} and {self.ipv6_prefix}"
            )
        for network in (*self.per_address_networks, *self.exempt_networks):
            ipaddress.ip_network(network)  # a malformed network fails here, not at the first peer

    @cached_property
    def _exempt(self) -> tuple:
        return tuple(ipaddress.ip_network(network) for network in self.exempt_networks)

    @cached_property
    def _per_address(self) -> tuple:
        return tuple(ipaddress.ip_network(network) for network in self.per_address_networks)

    def group_of(self, ip: str | None) -> str | None:
        """The group an IP address counts against, as a network in text (None: not limited)."""
        if ip is None:
            return None
        try:
            address = ipaddress.ip_address(ip.split("%")[0])
        except ValueError:
            return None  # not an IP (a DNS name the transport could not resolve): nothing to count
        if address.version == 6 and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in network for network in self._exempt if network.version == address.version):
            return None
        if any(address in network for network in self._per_address if network.version == address.version):
            return str(address)
        prefix = self.ipv4_prefix if address.version == 4 else self.ipv6_prefix
        return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))
