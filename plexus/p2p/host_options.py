"""`HostOptions`: every knob of a Host, each bound with its default and what it is for."""

from dataclasses import dataclass, field

from .protocols import noise


@dataclass
class HostOptions:
    """Knobs of the host. Times are seconds."""

    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Addresses to listen on (port 0: the OS picks one). Empty for a dial-only (client) host."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to advertise instead of the listening ones (e.g. a public IP behind port forwarding)."""
    dial_timeout: float = 10.0
    """Deadline for TCP connect plus the Noise and yamux upgrade."""
    negotiate_timeout: float = 10.0
    """Deadline for the peer to pick a protocol on a new inbound stream (else the stream is reset)."""
    request_timeout: float = 30.0
    """Deadline for the first bytes on an inbound stream once its protocol is picked, and for each
    request on protocols served here (a ping, an identify push). RPC methods set their own
    (`rpc.add_handler`)."""
    idle_timeout: float = 120.0
    """Close connections on which nothing has arrived for this long, even with streams open on them;
    a connection with a stream of ours still open is kept alive with pings meanwhile."""
    max_connections: int = 1024
    """Inbound connections (handshaking or open) past this are refused."""
    max_pending_connections: int = 128
    """Inbound connections still in their handshake at once; more are refused until some finish."""
    max_connections_per_peer: int = 8
    """Connections to one peer id, both ways (a peer needs one, a few while hole punching or relayed);
    inbound ones past this are closed right after the handshake says who the peer is."""
    max_connections_per_ip: int = 64
    """Inbound connections from one IPv4 address or IPv6 /64 (many honest peers can share one NAT)."""
    max_connections_per_subnet: int = 256
    """Inbound connections from one IPv4 /24 or IPv6 /48."""
    max_connection_rate_per_ip: float = 10.0
    """New inbound connections per second from one IP on average, after a burst of
    `max_connections_per_ip`; faster ones are closed before their handshake costs us anything."""
    limit_exempt_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    """Networks that the per-IP and per-subnet bounds do not apply to (loopback: local swarms, tests).
    The global and per-peer bounds still do."""
    max_streams_per_connection: int = 512
    """Concurrent yamux streams per connection."""
    max_inbound_streams_per_peer: int = 512
    """Inbound streams one peer may keep open at once over all its connections and protocols (each
    costs us a task and a few KB); past this new ones are reset. One connection's worth: a DHT node
    sends up to 256 requests at once."""
    ping_rate: float = 10.0
    """Pings per second one peer may send on average (`/ipfs/ping/1.0.0`); faster pingers are reset."""
    ping_burst: int = 20
    """Pings one peer may send at once before `ping_rate` applies."""
    reuse_port: bool = False
    """Let outgoing sockets bind our listening ports (SO_REUSEPORT, set once each listener is bound, so a
    second listener on the same port still fails): hole punching (plexus/p2p/dcutr.py) dials from them."""
    swarm_key: bytes | None = field(default=None, repr=False)
    """The 32-byte pre-shared key of a private network (libp2p pnet; read a `swarm.key` file with
    `plexus.p2p.pnet.load_swarm_key`): peers without it cannot even complete a connection."""
    noise_ciphers: tuple[str, ...] = tuple(noise.SUITES)
    """Noise cipher functions to offer, most preferred first. ChaChaPoly is libp2p's "/noise", which every
    libp2p peer speaks; AESGCM, which Plexus peers also speak, is 2-3x faster on CPUs with AES instructions."""

    def __post_init__(self):
        for name in (
            "max_connections",
            "max_pending_connections",
            "max_connections_per_peer",
            "max_connections_per_ip",
            "max_connections_per_subnet",
            "max_streams_per_connection",
            "max_inbound_streams_per_peer",
            "ping_burst",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HostOptions.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ping_rate", "max_connection_rate_per_ip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HostOptions.{name} must be positive, got {getattr(self, name)}")
        if self.swarm_key is not None and len(self.swarm_key) != 32:
            raise ValueError(
                f"HostOptions.swarm_key must be 32 bytes (a swarm.key file's key), got {len(self.swarm_key)}"
            )
        unknown = [name for name in self.noise_ciphers if name not in noise.SUITES]
        if unknown or not self.noise_ciphers:
            raise ValueError(
                f"noise_ciphers must name one or more of {sorted(noise.SUITES)}, "
                f"got {list(self.noise_ciphers)}"
            )
