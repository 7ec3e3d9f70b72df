"""Pre-train a tiny ALBERT with a swarm on this machine: a monitor, three trainers, one client-mode trainer.

    plexus demo                     # 30 global steps on 127.0.0.1, a few minutes on two CPU cores
    plexus demo --steps 10 --trainers 2 --client_trainers 0
    plexus demo --ping-only         # just two peers that ping each other (no ML libraries needed)

The swarm is plexus.examples.albert.run_demo (the repository's examples/albert/run_demo.py runs
the same); it needs the `albert` extra: pip install "plexus[albert]". It builds a small English
corpus (from the documentation of installed packages: no download) and a tokenizer once, shows a live view of the peers, the global epoch, the loss and the samples/s, prints the
`--initial_peers` line another machine could join with, and ends with a summary and the loss curve
(PNG and CSV). Ctrl+C stops every process it started.
"""

import asyncio
import importlib.util
import os

from ..errors import UsageError
from ..p2p.host import Host
from ..utils.logging import get_logger
from . import checks

logger = get_logger(__name__)
PASSED_ON = ("steps", "trainers", "client_trainers", "host", "target_batch_size", "data_dir", "run_dir")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--steps", type=checks.positive_int, help="stop after this many global steps (default 30)"
    )
    parser.add_argument(
        "--trainers", type=checks.positive_int, help="trainers that accept connections (default 3)"
    )
    parser.add_argument(
        "--client_trainers", type=checks.non_negative_int, help="trainers in client mode (default 1)"
    )
    parser.add_argument(
        "--host",
        type=checks.ip_address,
        help="interface to listen on; 0.0.0.0 lets other machines join (default 127.0.0.1)",
    )
    parser.add_argument(
        "--target_batch_size", type=checks.positive_int, help="samples per global step (default 256)"
    )
    parser.add_argument(
        "--data_dir",
        type=checks.directory_to_use,
        help="corpus and tokenized data, built if missing (default ./data)",
    )
    parser.add_argument(
        "--run_dir",
        type=checks.directory_to_use,
        help="logs, metrics and the loss curve (default ./data/demo_run)",
    )
    parser.add_argument(
        "--ping-only", action="store_true", help="only start two peers and ping one from the other"
    )
    parser.add_argument(
        "--pings", type=checks.positive_int, help="how many pings (default 5); implies --ping-only"
    )


def run(args) -> int:
    if args.ping_only or args.pings is not None:
        return asyncio.run(_ping(5 if args.pings is None else args.pings))
    missing = [
        name
        for name in ("transformers", "tokenizers", "accelerate")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise UsageError(
            f'the demo needs {", ".join(missing)}: pip install "plexus[albert]" (from a checkout: '
            f'pip install -e ".[albert]", or make demo); plexus demo --ping-only needs none of them'
        )
    from ..examples.albert import run_demo

    argv = []
    for name in PASSED_ON:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name}", os.path.abspath(value) if name.endswith("_dir") else str(value)]
    return run_demo.main(argv)


async def _ping(pings: int) -> int:
    async with Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)) as first, Host(host_maddrs=()) as second:
        address = first.get_visible_maddrs()[0]
        logger.info(f"first peer is up; to connect other peers to it, use --initial_peers {address}")
        info = await second.identify((await second.connect(address)).peer, timeout=10)
        logger.info(
            f"second peer {second.peer_id} connected; the first peer runs {info.agent_version} "
            f"and speaks {', '.join(info.protocols)}"
        )
        for index in range(pings):
            rtt = await second.ping(first.peer_id)
            logger.info(f"ping {index + 1}/{pings}: {rtt * 1e3:.2f} ms")
    return 0
