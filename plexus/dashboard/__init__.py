"""A live, read-only web dashboard of a swarm: its peers, epoch, ETA, speed, loss and warnings.

`Dashboard(dht, run_id)` serves it from any process that runs a DHT (`plexus dht --dashboard
PORT`, the ALBERT example's training monitor). It needs aiohttp: `pip install plexus[dashboard]`.
"""

from .address import add_dashboard_argument, parse_bind_address
from .collector import PeerSighting, SwarmCollector, read_progress
from .log_buffer import LogBuffer
from .server import INSTALL_HINT, Dashboard, require_aiohttp

__all__ = [
    "INSTALL_HINT",
    "Dashboard",
    "LogBuffer",
    "PeerSighting",
    "SwarmCollector",
    "add_dashboard_argument",
    "parse_bind_address",
    "read_progress",
    "require_aiohttp",
]
