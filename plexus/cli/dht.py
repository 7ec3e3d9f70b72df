"""Run a long-lived DHT peer, e.g. the first peer that others bootstrap from.

Prints the `--initial_peers` line for other peers, then every `--refresh_period` seconds the size
of its routing table and how many keys it stores. Stops cleanly on Ctrl+C or SIGTERM. The flags
and these lines are hivemind-dht's, so scripts that run or read `hivemind-dht` work with it.

Example:
    plexus dht --host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path dht.key
    plexus dht --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...
    plexus dht --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... --use_auto_relay   # behind NAT
    plexus dht --initial_peers /p2p/12D3KooW... --use_ipfs   # find that peer through the IPFS DHT
    plexus dht --dashboard 8080 --run_id albert   # and a live dashboard at http://127.0.0.1:8080/
"""

import signal
import threading

from ..dashboard.address import add_dashboard_argument, parse_bind_address
from ..dht.dht import DHT
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from . import checks
from .config import add_config_argument, add_peer_arguments

logger = get_logger(__name__)


def add_arguments(parser) -> None:
    add_peer_arguments(parser)
    parser.add_argument(
        "--client_mode",
        action="store_true",
        help="only dial out: for peers that cannot accept incoming connections",
    )
    parser.add_argument(
        "--relays",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        metavar="MADDR",
        help="relays for --use_auto_relay (default: initial peers that relay, then the DHT's)",
    )
    parser.add_argument(
        "--force_reachability",
        choices=["public", "private"],
        help="skip AutoNAT and take this as this peer's reachability",
    )
    parser.add_argument(
        "--use_ipfs",
        action="store_true",
        help="find initial peers given as /p2p/<peer id> through the public IPFS DHT",
    )
    parser.add_argument(
        "--ipfs_bootstrap_peers",
        nargs="*",
        type=checks.multiaddr,
        default=None,
        metavar="MADDR",
        help="where to join the Kademlia DHT for --use_ipfs (default: the IPFS bootstrap peers)",
    )
    parser.add_argument(
        "--refresh_period",
        type=checks.positive_float,
        default=30.0,
        help="seconds between status lines (default 30)",
    )
    add_dashboard_argument(parser)
    parser.add_argument(
        "--run_id",
        default=None,
        help="with --dashboard: the training run whose progress to show (its trainers' --run_id)",
    )
    add_config_argument(parser)


def run(args) -> int:
    if args.dashboard is not None:
        from ..dashboard.server import Dashboard, require_aiohttp

        require_aiohttp()  # before the DHT starts: a missing extra is a one-line error
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    dht = DHT(
        initial_peers=args.initial_peers,
        start=True,
        client_mode=args.client_mode,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        use_relay=not args.no_relay,
        use_auto_relay=args.use_auto_relay,
        relays=args.relays,
        force_reachability=args.force_reachability,
        use_ipfs=args.use_ipfs,
        ipfs_bootstrap_peers=args.ipfs_bootstrap_peers,
    )
    dashboard = None
    try:
        if args.dashboard is not None:
            # a --config file may give the port as a number, which argparse leaves unparsed
            address = args.dashboard
            host, port = address if isinstance(address, tuple) else parse_bind_address(str(address))
            dashboard = Dashboard(dht, args.run_id, host=host, port=port)
            logger.info(f"Dashboard: {dashboard.url}")
        if not args.client_mode:
            maddrs = " ".join(str(addr) for addr in dht.get_visible_maddrs())
            logger.info(
                f"Running a DHT instance. To connect other peers to this one, use --initial_peers {maddrs}"
            )
            logger.info(f"Full list of visible multiaddresses: {maddrs}")
            if args.use_ipfs:
                logger.info(f"With --use_ipfs, --initial_peers /p2p/{dht.peer_id} is enough")
        if dht.reachability != "unknown":
            logger.info(f"reachability: {dht.reachability}; {dht.nat_mode} mode")
        while not stop.wait(args.refresh_period):
            peers, keys = dht.run_coroutine(_status)
            logger.info(f"{peers + 1} DHT nodes (including this one) are in the local routing table")
            logger.info(f"Local storage contains {keys} keys")
    finally:
        if dashboard is not None:
            dashboard.shutdown()
        dht.shutdown()
        logger.info("DHT peer stopped")
    return 0


async def _status(dht, node) -> tuple[int, int]:
    return len(node.routing_table), sum(1 for _ in node.storage.items(get_dht_time()))
