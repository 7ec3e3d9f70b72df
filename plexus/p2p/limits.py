"""The host's bookkeeping of who holds what: connections by address, streams by peer, ping rates.

Theory of operation. A host must keep serving everyone while one peer (or one machine, or one
subnet) tries to take all it has. Every resource a remote party can make us hold is counted here
against a bound from `HostOptions`, and the host asks before it grants one:

- `InboundConnections`: inbound connections by source. A connection is counted from the moment the
  socket is accepted (still handshaking: "pending") until it closes, against the global bound
  (`max_connections`), the bound on handshakes at once (`max_pending_connections`), and per IP
  (an IPv4 address, an IPv6 /64) and per subnet (IPv4 /24, IPv6 /48), and new ones per IP are
  rate-limited (`max_connection_rate_per_ip`), so that a peer dialing in a loop costs us an accept
  and a close, not a handshake each time. Addresses in
  `limit_exempt_networks` (loopback by default: local swarms and tests) skip the per-IP and
  per-subnet bounds, not the global one. Connections per *peer* are bounded by the host itself once
  the handshake says who the peer is (`max_connections_per_peer`).
- `Counter`: how many of something each key holds at once (inbound streams per peer, per peer and
  protocol, RPC requests per peer and method), with acquire/release around each use.
- `TokenBucket`: a per-key rate with a burst allowance (pings per peer).

No I/O and no clock of its own: callers pass `now`. Every refusal comes back as a sentence that
says what was exceeded, for the caller to log (rate-limited) with the peer id.
"""

import ipaddress
from collections import Counter as _Counter
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

IP_PREFIX = {4: 32, 6: 64}  # what counts as "one IP": a v6 host usually owns a whole /64
SUBNET_PREFIX = {4: 24, 6: 48}


def address_keys(ip: str) -> tuple[str, str]:
    """(IP key, subnet key) of an IP address: '10.1.2.3' -> ('10.1.2.3/32', '10.1.2.0/24')."""
    address = ipaddress.ip_address(ip.split("%")[0])
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    version = address.version
    host = ipaddress.ip_network(f"{address}/{IP_PREFIX[version]}", strict=False)
    subnet = ipaddress.ip_network(f"{address}/{SUBNET_PREFIX[version]}", strict=False)
    return str(host), str(subnet)


@dataclass
class InboundTicket:
    """One counted inbound connection; handed back to `InboundConnections.release` when it closes."""

    ip_key: str | None
    subnet_key: str | None
    pending: bool = True


class InboundConnections:
    """Inbound connections by source address, against the global, pending, per-IP and per-subnet bounds."""

    def __init__(
        self,
        *,
        max_total: int,
        max_pending: int,
        per_ip: int,
        per_subnet: int,
        rate_per_ip: float = 1e9,
        exempt_networks: Iterable[str] = (),
    ):
        self.max_total, self.max_pending = max_total, max_pending
        self.per_ip, self.per_subnet = per_ip, per_subnet
        self.rate = TokenBucket(rate_per_ip, burst=per_ip)
        self.exempt = [ipaddress.ip_network(network) for network in exempt_networks]
        self.total = self.pending = 0
        self.by_ip: _Counter[str] = _Counter()
        self.by_subnet: _Counter[str] = _Counter()

    def is_exempt(self, ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%")[0])
        return any(address in network for network in self.exempt if network.version == address.version)

    def admit(self, ip: str | None, now: float = 0.0) -> tuple[InboundTicket | None, str | None]:
        """Count a new inbound connection from `ip` (None: unknown), or say why it is refused."""
        if self.total >= self.max_total:
            return None, f"the host has {self.total} inbound connections, its limit (max_connections)"
        if self.pending >= self.max_pending:
            return None, (
                f"{self.pending} inbound handshakes are under way, the limit (max_pending_connections)"
            )
        ip_key = subnet_key = None
        if ip is not None and not self.is_exempt(ip):
            ip_key, subnet_key = address_keys(ip)
            if self.by_ip[ip_key] >= self.per_ip:
                return None, (
                    f"{ip_key} holds {self.by_ip[ip_key]} connections, the limit (max_connections_per_ip)"
                )
            if self.by_subnet[subnet_key] >= self.per_subnet:
                return None, (
                    f"subnet {subnet_key} holds {self.by_subnet[subnet_key]} connections, the "
                    f"limit (max_connections_per_subnet)"
                )
            if not self.rate.allow(ip_key, now):
                return None, (
                    f"{ip_key} opens connections faster than max_connection_rate_per_ip={self.rate.rate}/s"
                )
            self.by_ip[ip_key] += 1
            self.by_subnet[subnet_key] += 1
        self.total += 1
        self.pending += 1
        return InboundTicket(ip_key, subnet_key), None

    def upgraded(self, ticket: InboundTicket) -> None:
        """The handshake is over: the connection no longer counts as pending."""
        if ticket.pending:
            ticket.pending = False
            self.pending -= 1

    def release(self, ticket: InboundTicket) -> None:
        self.upgraded(ticket)
        self.total -= 1
        for counts, key in ((self.by_ip, ticket.ip_key), (self.by_subnet, ticket.subnet_key)):
            if key is not None:
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]


class Counter:
    """How many of something each key holds at once, each key bounded by the limit passed to `acquire`."""

    def __init__(self):
        self.held: dict[Hashable, int] = {}

    def acquire(self, key: Hashable, limit: int | None) -> bool:
        """Take one for `key` if it holds fewer than `limit` (None: no limit); False if it is full."""
        count = self.held.get(key, 0)
        if limit is not None and count >= limit:
            return False
        self.held[key] = count + 1
        return True

    def release(self, key: Hashable) -> None:
        count = self.held.get(key, 0) - 1
        if count > 0:
            self.held[key] = count
        else:
            self.held.pop(key, None)

    def __getitem__(self, key: Hashable) -> int:
        return self.held.get(key, 0)


class TokenBucket:
    """Per-key rate limit: `rate` events per second on average, `burst` at once; bounded in keys."""

    def __init__(self, rate: float, burst: float, max_keys: int = 4096):
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (tokens, when)

    def allow(self, key: Hashable, now: float) -> bool:
        """Spend one token of `key`'s bucket if it has one."""
        tokens, when = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        allowed = tokens >= 1
        self._buckets[key] = (tokens - 1 if allowed else tokens, now)
        if len(self._buckets) > self.max_keys:  # forget the key seen longest ago (a full bucket by now)
            self._buckets.popitem(last=False)
        return allowed
