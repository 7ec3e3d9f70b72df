"""Start two Plexus peers on 127.0.0.1 and ping one from the other.

Each peer is a full libp2p host (TCP, Noise, yamux, identify, ping); the first prints the address
another machine could use to reach it, the second dials that address, identifies the first peer
and pings it a few times.
"""

import asyncio

from ..p2p.host import Host
from ..utils.logging import get_logger

HELP = "start two local peers and ping one from the other"
logger = get_logger(__name__)


def add_arguments(parser) -> None:
    parser.add_argument("--pings", type=int, default=5, help="how many pings to send (default 5)")


def run(args) -> int:
    return asyncio.run(_demo(args.pings))


async def _demo(pings: int) -> int:
    async with Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)) as first, Host(host_maddrs=()) as second:
        address = first.get_visible_maddrs()[0]
        logger.info(f"first peer is up; to connect other peers to it, use --initial_peers {address}")
        info = await second.identify((await second.connect(address)).remote_peer, timeout=10)
        logger.info(f"second peer {second.peer_id} connected; the first peer runs {info.agent_version} "
                    f"and speaks {', '.join(info.protocols)}")
        for index in range(pings):
            rtt = await second.ping(first.peer_id)
            logger.info(f"ping {index + 1}/{pings}: {rtt * 1e3:.2f} ms")
    return 0
