"""Run a long-lived DHT peer, e.g. the first peer that others bootstrap from.

Prints the `--initial_peers` line for other peers, then every `--refresh_period` seconds the size
of its routing table and how many keys it stores. Stops cleanly on Ctrl+C or SIGTERM.

Example:
    plexus dht --host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path dht.key
    plexus dht --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...
"""

import signal
import threading

from ..dht.dht import DHT
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from .config import add_config_argument

HELP = "run a DHT peer that others can bootstrap from"
logger = get_logger(__name__)


def add_arguments(parser) -> None:
    parser.add_argument("--initial_peers", nargs="*", default=[], metavar="MADDR",
                        help="multiaddrs of peers to join (…/p2p/<peer id>); none starts a new swarm")
    parser.add_argument("--host_maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                        help="addresses to listen on (default: all interfaces, port chosen by the OS)")
    parser.add_argument("--announce_maddrs", nargs="*", default=[], metavar="MADDR",
                        help="addresses to advertise instead of the listening ones (e.g. a public IP)")
    parser.add_argument("--identity_path", help="file with this peer's private key (created when missing), "
                        "so its peer id and address stay the same across restarts")
    parser.add_argument("--client_mode", action="store_true",
                        help="only dial out: for peers that cannot accept incoming connections")
    parser.add_argument("--refresh_period", type=float, default=30.0,
                        help="seconds between status lines (default 30)")
    add_config_argument(parser)


def run(args) -> int:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    dht = DHT(initial_peers=args.initial_peers, start=True, client_mode=args.client_mode,
              host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs, identity_path=args.identity_path)
    try:
        if not args.client_mode:
            maddrs = " ".join(str(addr) for addr in dht.get_visible_maddrs())
            logger.info(f"To connect other peers to this one, use --initial_peers {maddrs}")
        while not stop.wait(args.refresh_period):
            peers, keys = dht.run_coroutine(_status)
            logger.info(f"routing table: {peers} peers; storing {keys} keys")
    finally:
        dht.shutdown()
        logger.info("DHT peer stopped")
    return 0


async def _status(dht, node) -> tuple[int, int]:
    return len(node.routing_table), sum(1 for _ in node.storage.items(get_dht_time()))
